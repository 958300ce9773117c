"""``moe-sbo demo --elastic``: a rank killed mid-run, the others' recovery and verdict; bad combinations
refused before any rank starts."""

from __future__ import annotations

import json

import pytest

from moe_sbo.cli.demo_elastic import spare_slots_needed
from moe_sbo.cli.main import main


def test_demo_elastic_shows_the_loss_the_recovery_and_the_verdict(tmp_path, capsys):
    out = tmp_path / "elastic.json"
    argv = ["demo", "--elastic", "--ranks", "4", "--dispatcher", "alltoall", "--kill-rank", "1", "--at", "pre_combine"]
    code = main([*argv, "--device", "cpu", "--tokens", "16", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "rank 1 killed at pre_combine of forward 1" in printed
    assert printed.splitlines()[-1] == (
        "verdict: OK: rank 1 lost at pre_combine; 1/1 dispatchers recovered and matched the reference"
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["lost"] == [1] and row["agreed"] and row["ok"] and row["max_rel_err"] <= 1e-5
    assert row["restored_from"] == "checkpoint" and row["missing_experts"] and row["degraded_tokens"] > 0
    assert all(row[k] < 10_000 for k in ("t_detect_ms", "t_reform_ms", "t_rerun_ms", "t_restore_ms"))
    assert max(len(line) for line in printed.splitlines() if str(out) not in line) <= 100


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ranks", "1"], "--elastic loses a rank and needs the others"),
        (["--ranks", "4", "--kill-rank", "4"], "--kill-rank must be a rank in [0, 4), got 4"),
        (["--ranks", "2", "--eplb"], "got --eplb; leave one out"),
        (["--ranks", "2", "--dispatcher", "local"], "--elastic needs a dispatcher over several ranks"),
    ],
)
def test_demo_elastic_refuses_bad_combinations_before_any_rank(extra, message, capsys):
    code = main(["demo", "--elastic", "--device", "cpu", *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_spare_slots_needed_fit_every_expert_on_the_survivors():
    assert [spare_slots_needed(16, p) for p in (2, 4, 8)] == [8, 2, 1]

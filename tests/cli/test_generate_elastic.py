"""``moe-sbo generate --elastic --kill-rank R``: a whole model keeps generating the same tokens through
the loss of a rank that owned no prompt, and the closing note shows the loss; bad combinations are
refused before any rank starts."""

from __future__ import annotations

import json

import pytest

from hf_blocks import make_hf_model
from moe_sbo.cli.main import main

PROMPTS = ["--prompt-ids", "1,2,3,4", "--prompt-ids", "5,6,7"]  # ranks 0 and 1 own one each


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_hf_model("deepseek_v3", seed=5).save_pretrained(path)
    return str(path)


def _generate(checkpoint, out, *extra):
    argv = ["generate", "--checkpoint", checkpoint, *PROMPTS, "--ranks", "4", "--device", "cpu"]
    return main([*argv, "--max-new-tokens", "5", "--decode", "transformers", "--json", str(out), *extra])


def test_generation_goes_on_through_a_lost_rank_with_the_same_tokens(checkpoint, tmp_path, capsys):
    assert _generate(checkpoint, tmp_path / "plain.json") == 0
    assert _generate(checkpoint, tmp_path / "elastic.json", "--elastic", "--kill-rank", "3") == 0
    printed = capsys.readouterr().out
    plain, lost = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "elastic"))
    assert [r["token_ids"] for r in lost["rows"]] == [r["token_ids"] for r in plain["rows"]]
    assert len(lost["ranks"]) == 3 and all(r["recoveries"][0]["lost"] == [3] for r in lost["ranks"])
    assert "elastic: rank(s) [3] lost mid-generation (owning no prompt)" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kill-rank", "0"], "--kill-rank 0 owns prompts [0]"),
        (["--kill-rank", "3", "--decode", "static"], "--decode transformers, got static"),
        (["--kill-rank", "4"], "--kill-rank in [0, 4), got 4"),
    ],
)
def test_generate_elastic_refuses_bad_combinations(checkpoint, extra, message, capsys):
    argv = ["generate", "--checkpoint", checkpoint, *PROMPTS, "--ranks", "4", "--device", "cpu", "--elastic"]
    assert main([*argv, *extra]) == 2 and message in capsys.readouterr().err

"""The CLI as a newcomer runs it: ``moe-sbo demo`` on CPU ranks, JSON rows, exit codes, what it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from moe_sbo.cli.main import main
from moe_sbo.dispatch import DISPATCHERS


def _moe_sbo(*args, timeout=240, module="moe_sbo"):
    """``python -m moe_sbo ARGS`` (the same as ``moe-sbo``) in a terminal 100 columns wide."""
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_demo_runs_every_dispatcher_and_matches(tmp_path):
    out = tmp_path / "demo.json"
    proc = _moe_sbo("demo", "--device", "cpu", "--tokens", "9", "--iters", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {r["dispatcher"] for r in result["rows"]} == set(DISPATCHERS)
    assert all(r["ok"] and r["rel_err"] <= 1e-5 for r in result["rows"])
    assert all(r["bytes_sent"] > 0 for r in result["rows"] if r["dispatcher"] != "local")
    assert result["meta"]["world_size"] == 2 and result["meta"]["torch"]  # the default: 2 CPU ranks
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("memory per rank, estimated: ") and "(rough)" in lines[3]
    assert "alltoall" in proc.stdout and "dispatch" in lines[5] and "|err| max/rel" in lines[5]
    # One table row per dispatcher: nothing folded onto a second line at 100 columns.
    assert sum(line.startswith(tuple(DISPATCHERS)) for line in lines) == len(DISPATCHERS)
    assert max(len(line) for line in lines if str(out) not in line) <= 100, proc.stdout  # paths are not broken
    assert "= none: bitwise equal to overlap none" in proc.stdout  # the legend of the derived columns
    assert "CPU timings: gloo on" in proc.stdout and f"rows written to {out}" in proc.stdout
    n = len(DISPATCHERS)
    assert (
        lines[-1]
        == f"{n}/{n} dispatcher x overlap runs match the single-rank reference; {n}/{n} equal overlap none bitwise"
    )


def _main_exit(argv, capsys) -> tuple[int, str]:
    """``moe-sbo ARGV`` in this process (bad input is refused before any rank starts): exit code, stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    return code, capsys.readouterr().err


def test_demo_bad_input_exits_2_with_a_message(capsys):
    code, err = _main_exit(["demo", "--ranks", "3", "--device", "cpu"], capsys)
    assert code == 2 and "divisible by the EP size, got 16 experts on 3 ranks" in err
    code, err = _main_exit(["demo", "--dispatcher", "deepep", "--ranks", "2"], capsys)
    assert code == 2 and "--dispatcher must be one of" in err
    # FP8 experts need 128x128 blocks; the tiny preset's hidden size is 64: one line, before any rank.
    code, err = _main_exit(["demo", "--expert-dtype", "fp8", "--device", "cpu"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("moe-sbo demo: error: --expert-dtype fp8 needs hidden_size and moe_intermediate_size")
    assert "got {'hidden_size': 64, 'moe_intermediate_size': 32} for model tiny" in err


def test_demo_overlap_all_checks_every_mode_against_none(tmp_path):
    out = tmp_path / "demo.json"
    proc = _moe_sbo(
        "demo",
        "--ranks",
        "2",
        "--device",
        "cpu",
        "--tokens",
        "6",
        "--iters",
        "1",
        "--dispatcher",
        "alltoall",
        "--overlap",
        "all",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["overlap"] for r in rows] == ["none", "dispatch", "combine", "combine_sm", "split", "auto"]
    assert all(r["ok"] and r["same_as_none"] for r in rows)
    assert proc.stdout.splitlines()[-1].startswith("6/6 dispatcher x overlap runs match")
    assert max(len(line) for line in proc.stdout.splitlines() if str(out) not in line) <= 100, proc.stdout
    assert "overlap combine on cpu" in proc.stderr  # said once, by rank 0 only
    assert proc.stderr.count("overlap combine on cpu") == 1
    proc = _moe_sbo("demo", "--ranks", "2", "--device", "cpu", "--overlap", "sideways")
    assert proc.returncode == 2 and "--overlap must be one of ['none', 'dispatch'" in proc.stderr


def test_demo_tbo_runs_the_decoder_layer_with_two_batch_overlap(tmp_path):
    out = tmp_path / "demo.json"
    proc = _moe_sbo(
        "demo",
        "--ranks",
        "2",
        "--device",
        "cpu",
        "--tokens",
        "100",
        "--iters",
        "1",
        "--tbo",
        "--overlap",
        "split",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dispatcher"], r["overlap"]) for r in rows} == {(d, m) for d in DISPATCHERS for m in ("none", "split")}
    assert all(r["tbo"] and r["ok"] and r["same_as_none"] for r in rows)
    assert "two-batch overlap" in proc.stdout

"""The CLI as a newcomer runs it: ``moe-sbo demo`` on CPU ranks, JSON rows, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys


def _moe_sbo(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "moe_sbo.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_runs_every_dispatcher_and_matches(tmp_path):
    out = tmp_path / "demo.json"
    proc = _moe_sbo("demo", "--ranks", "2", "--device", "cpu", "--tokens", "9", "--iters", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {r["dispatcher"] for r in result["rows"]} == {"local", "allgather", "alltoall"}
    assert all(r["ok"] and r["rel_err"] <= 1e-5 for r in result["rows"])
    assert all(r["bytes_sent"] > 0 for r in result["rows"] if r["dispatcher"] != "local")
    assert result["meta"]["world_size"] == 2 and result["meta"]["torch"]
    assert "alltoall" in proc.stdout and "dispatch µs" in proc.stdout


def test_demo_bad_input_exits_2_with_a_message():
    proc = _moe_sbo("demo", "--ranks", "3", "--device", "cpu")
    assert proc.returncode == 2
    assert "divisible by the EP size, got 16 experts on 3 ranks" in proc.stderr
    proc = _moe_sbo("demo", "--dispatcher", "deepep", "--ranks", "2")
    assert proc.returncode == 2 and "--dispatcher must be one of" in proc.stderr

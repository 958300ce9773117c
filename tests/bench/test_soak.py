"""Smoke tests of ``benchmarks/soak.py`` in its CPU mode (2 gloo ranks, a few forwards, in a
subprocess): it exits 0 and writes result-file rows. The soak's own
flatness checks (``--check``) must pass even this short: no hook, Python object or output drift.
(The 2,000-forward figures are in docs/RELIABILITY.md; benchmarks are not tests.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("bench", "preset", "ep", "tokens_per_rank", "dispatcher", "overlap", "tbo", "dtype", "graph")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["GIT_OPTIONAL_LOCKS"] = "0"  # the result's meta reads the commit; never lock the index for it
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", "--ranks", "2", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def test_soak_smoke(tmp_path):
    out = tmp_path / "soak.json"
    # A few forwards only: RSS is not judged (a fresh process's allocator is still settling).
    _run(
        "soak.py",
        "--forwards",
        "30",
        "--warmup",
        "3",
        "--settle",
        "0",
        "--tbo",
        "--dispatchers",
        "low_latency",
        "--overlaps",
        "split",
        "--check",
        "--rss-tolerance-kib",
        "1000000",
        "--out",
        str(out),
    )
    result = json.loads(out.read_text())
    assert result["meta"]["forwards"] == 30 and result["meta"]["device"] == "cpu"
    rows = result["rows"]
    assert [(r["dispatcher"], r["overlap"], r["tbo"]) for r in rows] == [
        ("low_latency", "split", False),
        ("low_latency", "split", True),
    ]
    for row in rows:
        assert "error" not in row, row
        assert all(field in row for field in FIELDS) and row["graph"] is False and row["flat"]
        assert row["forwards"] == 30 and row["t_forward_us"] > 0
        # Objects: a transient one or two may come and go; a leak of one per forward would be ~27 here.
        assert row["hooks_growth"] == 0 and row["hooks_after"] == 0 and row["py_objects_growth"] <= 8
        assert row["outputs_differing"] == 0 and len(row["rss_kib_checkpoints_rank0"]) == 11
        # Where the growth would be: file-backed pages and glibc's heap (in use, held), per checkpoint.
        for memory in ("rss_file_kib", "malloc_in_use_kib", "malloc_held_kib"):
            checkpoints = row[f"{memory}_checkpoints_rank0"]
            assert len(checkpoints) == 11 and all(kib > 0 for kib in checkpoints), (memory, checkpoints)
        assert all(g["growth_kib"] > 0 and g["size_kib"] > 0 for g in row["rss_growth_by_mapping_rank0"])
        # low_latency's rows name the path "auto" resolved to: on CPU the torch ops over the process group.
        assert (row["kernels"], row["transport"]) == ("torch", "nccl")


def test_soak_judges_growth_not_a_fall():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    flat = {
        "hooks_growth": 0,
        "hooks_after": 0,
        "py_objects_growth": 0,
        "rss_growth_kib": 12,
        "cuda_allocated_growth": 0,
        "outputs_differing": 0,
        "device": "cuda",
    }
    assert soak.violations(flat, rss_tolerance_kib=1024) == []
    assert soak._rise_at_end([100, 100, 100]) == 0
    assert soak._rise_at_end([100, 98, 98]) == 0  # freed, not leaked
    assert soak._rise_at_end([100, 98, 109]) == 11  # a rise after an early fall still counts
    assert soak._rise_at_end([100, 101, 100]) == 0  # a transient object in the middle is not growth
    assert soak.violations(dict(flat, py_objects_growth=1), rss_tolerance_kib=1024) == []  # one transient object
    assert soak.violations(dict(flat, py_objects_growth=30), rss_tolerance_kib=1024) == ["30 more Python objects"]
    assert soak.violations(dict(flat, rss_growth_kib=2044), rss_tolerance_kib=1024) == ["host RSS grew by 2044 KiB"]
    assert soak.violations(dict(flat, cuda_allocated_growth=512), rss_tolerance_kib=1024) == [
        "CUDA memory grew by 512 B"
    ]
    # Bitwise drift fails on CPU but is reported, not failed, on CUDA (combine_sm may pick another GEMM).
    assert soak.violations(dict(flat, outputs_differing=3), rss_tolerance_kib=1024) == []
    assert soak.violations(dict(flat, outputs_differing=3, device="cpu"), rss_tolerance_kib=1024) == [
        "3 outputs differ bitwise (CPU is deterministic)"
    ]

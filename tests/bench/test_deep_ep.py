"""Smoke test of ``moe-sbo bench deep-ep``: its CPU mode (2 gloo ranks, small shapes, eager) runs in a
subprocess, exits 0 and writes ``deep_ep.json`` with one row per dispatch dtype whose compatible and
native outputs agree. It checks that the mode works, not what it measures (benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode


def test_cpu_smoke_writes_a_row_per_dispatch_dtype(tmp_path):
    run_mode(
        *("deep-ep", "--out", str(tmp_path), "--device", "cpu", "--ranks", "2"),
        *("--hidden", "256", "--top-k", "4", "--tokens", "8", "--warmup", "1", "--iters", "2"),
        timeout=180,
    )
    result = json.loads((tmp_path / "deep_ep.json").read_text())
    assert result["meta"]["device"] == "cpu"
    assert [row["dispatch_dtype"] for row in result["rows"]] == ["bfloat16", "fp8_e4m3"]
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["t_native_us"] > 0 and row["t_compat_us"] > 0 and row["host_compat_us"] > 0
        assert row["rel_err_compat_vs_native"] < (0.1 if row["dispatch_dtype"] == "fp8_e4m3" else 1e-2)

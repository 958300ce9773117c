"""Smoke test of ``moe-sbo bench foundation``: its CPU mode (2 gloo ranks, ``tiny``, ``--quick``)
runs in a subprocess, exits 0, and writes ``foundation.json`` with the result-file fields
(docs/BENCHMARKS.md) and positive times. It checks that the mode works, not what it measures
(benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode

LAYER_FIELDS = (
    "bench",
    "preset",
    "ep",
    "tokens_per_rank",
    "dispatcher",
    "dtype",
    "graph",
    "t_layer_us",
    "t_dispatch_us",
    "t_combine_us",
    "t_routed_us",
    "bytes_sent",
    "bytes_recv",
    "algbw_GBps",
    "ref_algbw_GBps",
    "ratio_vs_ref",
)
GEMM_FIELDS = (
    "bench",
    "preset",
    "rows_per_expert",
    "experts_per_gpu",
    "tflops",
    "dense_tflops",
    "ratio",
    "t_routed_us",
)


def test_cpu_smoke_writes_result_file(tmp_path):
    proc = run_mode(
        "foundation",
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--quick",
        "--ranks",
        "2",
        "--tokens",
        "16",
        "64",
        timeout=120,
    )
    assert "MoE layer per phase" in proc.stdout

    result = json.loads((tmp_path / "foundation.json").read_text())
    meta = result["meta"]
    for key in ("command", "commit", "date", "device", "torch", "world_size"):
        assert key in meta, key
    assert meta["device"] == "cpu"

    layer_rows = [r for r in result["rows"] if r["bench"] == "moe_layer"]
    assert {(r["dispatcher"], r["tokens_per_rank"]) for r in layer_rows} == {
        (d, t) for d in ("allgather", "alltoall") for t in (16, 64)
    }
    for row in layer_rows:
        assert "error" not in row, row
        for field in LAYER_FIELDS:
            assert field in row, (field, row)
        assert row["ep"] == 2 and row["preset"] == "tiny" and row["graph"] is False
        for field in (
            "t_layer_us",
            "t_dispatch_us",
            "t_combine_us",
            "t_routed_us",
            "ref_t_dispatch_us",
            "ref_t_combine_us",
        ):
            assert row[field] > 0, (field, row)
        assert row["bytes_sent"] > 0 and row["bytes_recv"] > 0
        assert row["algbw_GBps"] > 0 and row["ref_algbw_GBps"] > 0 and row["ratio_vs_ref"] > 0

    gemm_rows = [r for r in result["rows"] if r["bench"] == "grouped_gemm"]
    assert len(gemm_rows) >= 2
    for row in gemm_rows:
        assert "error" not in row, row
        for field in GEMM_FIELDS:
            assert field in row, (field, row)
        assert row["t_routed_us"] > 0 and row["tflops"] > 0 and row["dense_tflops"] > 0 and row["ratio"] > 0

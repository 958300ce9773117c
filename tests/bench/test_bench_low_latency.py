"""Smoke test of ``moe-sbo bench low-latency``: its CPU mode (2 gloo ranks, ``tiny`` at H = 128 so
fp8 applies, ``--quick``) runs in a subprocess, exits 0, and writes ``low_latency.json`` with the
result-file fields, positive times and the fixed-block bytes. It checks that the mode works, not
what it measures (benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode

FIELDS = (
    "bench",
    "preset",
    "ep",
    "tokens_per_rank",
    "dispatcher",
    "dtype",
    "dispatch_dtype",
    "graph",
    "experts_per_gpu",
    "t_layer_us",
    "t_dispatch_us",
    "t_combine_us",
    "bytes_sent",
    "bytes_recv",
    "ref_t_dispatch_us",
    "ref_t_combine_us",
    "algbw_GBps",
    "ref_algbw_GBps",
)


def test_cpu_smoke_writes_result_file(tmp_path):
    proc = run_mode(
        "low-latency",
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--hidden-size",
        "128",
        "--experts-per-gpu",
        "4",
        "--quick",
        "--ranks",
        "2",
        "--tokens",
        "4",
        "16",
        timeout=180,
    )
    assert "low-latency decode" in proc.stdout

    result = json.loads((tmp_path / "low_latency.json").read_text())
    assert result["meta"]["device"] == "cpu" and result["meta"]["experts_per_gpu"] == 4
    rows = result["rows"]
    assert {(r["dispatcher"], r["dispatch_dtype"], r["tokens_per_rank"]) for r in rows} == {
        *((d, "float32", t) for d in ("low_latency", "allgather", "alltoall") for t in (4, 16)),
        *(("low_latency", "float8_e4m3fn", t) for t in (4, 16)),
    }
    for row in rows:
        assert "error" not in row, row
        for field in FIELDS:
            assert field in row, (field, row)
        assert row["ep"] == 2 and row["num_experts"] == 8 and row["graph"] is False
        for field in ("t_layer_us", "t_dispatch_us", "t_combine_us", "ref_t_dispatch_us", "ref_t_combine_us"):
            assert row[field] > 0, (field, row)
    for row in (r for r in rows if r["dispatcher"] == "low_latency"):
        # One other rank, capacity = tokens rows: H values (fp8: H bytes + H/128 scales) + K ids + K weights.
        row_bytes = 128 * 4 + 32 if row["dispatch_dtype"] == "float32" else 128 + 4 + 32 + 12  # 16-aligned
        assert row["dispatch_bytes_sent"] == row["tokens_per_rank"] * row_bytes
        assert row["combine_bytes_sent"] == row["tokens_per_rank"] * 128 * 4
        assert row["dispatch_overhead"] > 0 and row["combine_overhead"] > 0


def test_cpu_smoke_index_graph_settings(tmp_path):
    """``--index-graphs on fixed_rows off`` (fused kernels under Triton's interpreter): one eager row
    per setting, each saying how it ran."""
    run_mode(
        *("low-latency", "--out", str(tmp_path), "--device", "cpu", "--preset", "tiny"),
        *("--hidden-size", "128", "--experts-per-gpu", "4", "--quick", "--ranks", "2", "--tokens", "4"),
        *("--kernels", "triton", "--transports", "nccl", "--fp8", "off", "--baselines"),
        *("--index-graphs", "on", "fixed_rows", "off"),
        timeout=300,
    )
    rows = json.loads((tmp_path / "low_latency.json").read_text())["rows"]
    settings = [(r["kernels"], r["index_graphs"], r.get("fixed_expert_rows", False)) for r in rows]
    assert settings == [("triton", True, False), ("triton", True, True), ("triton", False, False)], settings
    assert all("error" not in r and r["t_dispatch_us"] > 0 for r in rows), rows


def test_cpu_smoke_expert_kernels(tmp_path):
    """``--expert-kernels tiled torch``: one eager row per choice, each naming the routed experts'
    GEMMs that ran (the tiled Triton GEMM under the interpreter, torch's grouped GEMM)."""
    run_mode(
        *("low-latency", "--out", str(tmp_path), "--device", "cpu", "--preset", "tiny"),
        *("--hidden-size", "128", "--experts-per-gpu", "4", "--quick", "--ranks", "1", "--tokens", "4"),
        *("--kernels", "torch", "--transports", "nccl", "--fp8", "off", "--baselines"),
        *("--expert-kernels", "tiled", "torch"),
        timeout=300,
    )
    rows = json.loads((tmp_path / "low_latency.json").read_text())["rows"]
    assert [(r["expert_kernels"], r["expert_path"]) for r in rows] == [("tiled", "tiled"), ("torch", "grouped_mm")]
    assert all("error" not in r and r["t_layer_us"] > 0 for r in rows), rows


def test_choices_named_without_torch_are_the_runners():
    """The parser names ``--expert-kernels`` and ``--fp8``'s choices without importing torch: they
    must be ``RoutedExperts``' kernels and the runner's fp8 settings."""
    from moe_sbo.bench import low_latency
    from moe_sbo.cli.parsers import bench_low_latency
    from moe_sbo.experts.select import DENSE_KERNELS

    assert bench_low_latency.EXPERT_KERNELS == DENSE_KERNELS
    assert bench_low_latency.FP8_CHOICES == tuple(sorted(low_latency.FP8_CHOICES))

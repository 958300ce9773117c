"""Smoke test of ``moe-sbo bench fp8-experts``: its CPU mode (the torch path, small dims,
``--quick``) runs in a subprocess, exits 0 and writes ``fp8_experts.json`` with the fields its rows
promise (docs/BENCHMARKS.md). It checks that the mode works, not what it measures (benchmarks are
not tests); the GPU-only fields (``ref_scaled_mm_tflops``) are written on CUDA."""

from __future__ import annotations

import json

from bench_modes import run_mode

MLP_FIELDS = ("weight_dtype", "experts", "rows_per_expert", "t_us", "t_eager_us", "tflops", "weight_gbps")
FP8_MLP_FIELDS = ("speedup_vs_bf16", "speedup_eager_vs_bf16", "eager_path", "rel_err_vs_bf16")


def test_cpu_smoke_writes_mlp_and_layer_rows(tmp_path):
    run_mode(
        "fp8-experts",
        *("--out", str(tmp_path), "--device", "cpu", "--quick", "--experts", "4", "--decode-rows", "4"),
        *("--prefill-rows", "16", "--hidden-size", "256", "--intermediate-size", "128"),
        *("--layer-experts", "8", "--layer-tokens", "16"),
        timeout=300,
    )
    rows = json.loads((tmp_path / "fp8_experts.json").read_text())["rows"]
    mlp = [r for r in rows if r["bench"] == "fp8_experts"]
    assert {(r["weight_dtype"], r["rows_per_expert"]) for r in mlp} == {
        (dtype, n) for dtype in ("bf16", "fp8") for n in (4, 16)
    }
    for row in mlp:
        fields = MLP_FIELDS + (FP8_MLP_FIELDS if row["weight_dtype"] == "fp8" else ())
        assert all(field in row for field in fields), row
        assert row["t_us"] > 0 and row["tflops"] > 0
    # The activations' e4m3 rounding, twice: a few percent, never zero (the FP8 path really ran).
    assert all(0 < r["rel_err_vs_bf16"] < 0.1 for r in mlp if r["weight_dtype"] == "fp8")
    layer = [r for r in rows if r["bench"] == "fp8_layer"]
    assert [(r["experts_dtype"], r["dispatch_dtype"]) for r in layer] == [
        ("bf16", "bf16"),
        ("bf16", "fp8"),
        ("fp8", "fp8"),
    ]
    assert layer[0]["speedup_vs_bf16"] == 1.0 and all(r["t_layer_us"] > 0 for r in layer)
    assert 0 < layer[2]["rel_err_vs_bf16"] < 0.1 and "rel_err_vs_bf16" not in layer[1]

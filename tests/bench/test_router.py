"""Smoke test of ``moe-sbo bench router``: its CPU mode (``tiny``, Triton's interpreter, two host
calls) runs in a subprocess, exits 0 and writes ``router.json`` whose row says both selections picked
the same experts. It checks that the mode works, not what it measures (benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode


def test_cpu_smoke_writes_router_rows(tmp_path):
    run_mode(
        *("router", "--out", str(tmp_path), "--device", "cpu", "--presets", "tiny"),
        *("--tokens", "4", "--host-calls", "2"),
        timeout=120,
    )
    result = json.loads((tmp_path / "router.json").read_text())
    assert result["meta"]["device"] == "cpu"
    [row] = result["rows"]
    assert (row["bench"], row["preset"], row["tokens"]) == ("router", "tiny", 4)
    assert row["t_host_torch_us"] > 0 and row["t_host_triton_us"] > 0
    assert row["t_graph_torch_us"] is None and row["same_experts"] is True

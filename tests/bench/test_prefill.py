"""Smoke test of ``moe-sbo bench prefill``: its CPU mode (2 gloo ranks, H = 256, ``--quick``)
runs in a subprocess, exits 0, and writes ``prefill.json`` whose eager ``low_latency`` row carries the
host time of each dispatcher call, the compute floor and the wire reference. It checks that the
mode works, not what it measures (benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode


def test_cpu_smoke_writes_host_floor_and_wire_fields(tmp_path):
    run_mode(
        "prefill",
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--quick",
        "--hidden-size",
        "256",
        "--experts-per-gpu",
        "4",
        "--tokens",
        "8",
        "--one-pass-max",
        "0",
        "--no-direct-launches",
        "--baselines",
        timeout=600,
    )
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    eager = [r for r in rows if r["dispatcher"] == "low_latency" and not r["graph"]]
    assert eager, rows
    for row in eager:
        for call in ("dispatch_launch", "dispatch_wait", "combine_launch", "combine_wait"):
            assert row[f"host_{call}_us"] > 0, (call, row)
        assert row["t_floor_us"] > 0 and row["floor_ratio"] > 0
        assert row["ref_t_dispatch_us"] > 0 and row["ref_t_combine_us"] > 0

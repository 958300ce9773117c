"""Smoke test of ``moe-sbo bench load-memory``: a small checkpoint (16 experts, 2 layers) loaded on 2
CPU ranks in a subprocess; it exits 0 and writes the per-rank peak growth and held bytes. It checks
that the mode works, not what it measures (benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode


def test_cpu_smoke_writes_per_rank_memory(tmp_path):
    out = tmp_path / "load_memory.json"
    run_mode("load-memory", "--ranks", "2", "--experts", "16", "--layers", "2", "--out", str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and len(result["per_rank"]) == 2
    assert result["checkpoint_mb"] > 0 and result["largest_tensor_mb"] > 0
    for rank in result["per_rank"]:
        assert rank["held_mb"] > 0 and rank["peak_rss_growth_mb"] > 0, rank
    assert result["peak_over_held_plus_one_tensor"] > 0

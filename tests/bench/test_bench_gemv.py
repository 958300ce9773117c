"""``benchmarks/bench_gemv.py``'s row draw, imported as a module (no GPU, nothing timed)."""

from __future__ import annotations

import importlib.util

from bench_scripts import ROOT


def test_bench_gemv_draws_rows_at_random_or_evenly():
    """``bench_gemv.py --draw``: each row on a random expert (seeded by the row count), or R / L rows on
    every expert, the first R mod L one more; the counts always add up to R."""
    spec = importlib.util.spec_from_file_location("bench_gemv", ROOT / "benchmarks" / "bench_gemv.py")
    assert spec is not None and spec.loader is not None
    bench_gemv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gemv)
    assert bench_gemv.row_counts(8, 1030, "equal").tolist() == [129] * 6 + [128] * 2
    random = bench_gemv.row_counts(8, 1024, "random")
    assert random.sum() == 1024 and random.tolist() == bench_gemv.row_counts(8, 1024, "random").tolist()
    assert random.max() > random.min()  # 1024 rows on 8 experts at random: never all alike

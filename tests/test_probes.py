"""CPU smoke tests of the GPU probes in ``benchmarks/``: each runs as a user runs it and writes rows
whose fields say what the docs read from them (host clock on CPU: the times are not measurements)."""

from __future__ import annotations

import importlib.util
import json

from bench_scripts import ROOT, run_bench_script


def test_uneven_rows_probe_smoke(tmp_path):
    run_bench_script(
        "probe_uneven_rows.py",
        *("--out", str(tmp_path), "--device", "cpu", "--quick", "--experts", "16", "--tokens", "64"),
        *("--hidden-size", "256"),
        timeout=300,
    )
    rows = {r["case"]: r for r in json.loads((tmp_path / "uneven_rows.json").read_text())["rows"]}
    assert set(rows) == {"routed", "routed_halves", "equal", "equal_halves"}
    assert rows["routed"]["rows_per_expert"] == 64 * 8 / 16  # 64 tokens, top-8, 16 experts
    assert rows["routed_halves"]["rows_per_expert"] == rows["routed"]["rows_per_expert"] / 2
    for case in ("equal", "equal_halves"):
        assert rows[case]["max_over_mean"] == 1.0
    # 32 rows per expert fill a quarter of a 128-row tile: three quarters padding; halves, 16 rows: 7/8.
    assert rows["equal"]["tile_waste"] == 3.0
    assert rows["equal_halves"]["tile_waste"] == 7.0
    assert rows["routed"]["max_over_mean"] >= 1.0
    assert all(r["t_us"] > 0 for r in rows.values())
    assert {"ratio_vs_whole"} <= set(rows["routed_halves"]) and "ratio_vs_whole" not in rows["routed"]


def test_gather_gemm_probe_smoke(tmp_path):
    # Under Triton's interpreter (CPU, float32): the probe checks both variants of the tiled GEMM
    # under both configs (per-thread loads; descriptor loads) against its reference itself and names
    # the configs it timed and the best.
    run_bench_script("probe_gather_gemm.py", "--out", str(tmp_path), "--device", "cpu", "--quick", timeout=300)
    (row,) = json.loads((tmp_path / "gather_gemm.json").read_text())["rows"]
    assert row["rows"] > 0 and row["gather_us"] > 0
    configs = {"16x32x32_g2_w1_s1", "16x32x32_g2_w1_s1_tma"}
    for variant in ("triton_contiguous", "triton_gather"):
        assert {f"{variant}_us_{c}" for c in configs} <= set(row)
        assert row[f"{variant}_config"] in configs


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

"""``moe-sbo bench dense-experts``'s options (runner: ``moe_sbo.bench.dense_experts``)."""

from __future__ import annotations

import argparse
from pathlib import Path

DRAWS = ("random", "equal")  # the runner's row_counts draws


DESCRIPTION = """\
Time dense routed experts on one GPU from decode to prefill sizes: the grouped GEMV, the tiled grouped
GEMM and torch._grouped_mm, against the weight-read and compute floors measured in the same run
(OUT/gemv.json); with --sweep each GEMM alone per tile config (OUT/dense_gemm_config.json). Needs CUDA."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument(
        "--rows", type=int, nargs="+", default=[8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    )
    p.add_argument("--gemv-max-rows", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--sweep", action="store_true", help="time each GEMM under each tile config instead")
    p.add_argument("--rows-per-expert", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--draw", choices=DRAWS, default="random", help="rows on random experts, or R / L on every expert")
    p.add_argument("--configs", nargs="+", help="sweep only the tile configs whose names contain one of these")
    p.add_argument(
        "--graph", action="store_true", help="time each kernel replayed from a CUDA graph (its GPU time alone)"
    )

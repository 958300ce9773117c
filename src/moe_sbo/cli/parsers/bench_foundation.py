"""``moe-sbo bench foundation``'s options (runner: ``moe_sbo.bench.foundation``)."""

from __future__ import annotations

import argparse

from ...config import PRESETS
from .common import add_ep_sweep_args

DISPATCHERS = ("allgather", "alltoall")

DESCRIPTION = """\
Time the expert-parallel MoE layer per phase on N ranks for each EP size (dispatchers allgather and
alltoall, beside raw all_to_all_single on the same bytes), then the routed experts' grouped GEMM against
dense GEMMs of the same FLOPs on rank 0. Rows go to OUT/foundation.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_ep_sweep_args(parser, "foundation.json", iters=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096], help="tokens per rank")
    parser.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    parser.add_argument("--dispatchers", nargs="+", default=list(DISPATCHERS), choices=list(DISPATCHERS))
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument(
        "--gemm-ep",
        type=int,
        default=4,
        help="EP size whose experts per GPU the grouped-GEMM rows use (default 4: 64 for V3)",
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=["layer", "gemm"], help="parts to leave out")

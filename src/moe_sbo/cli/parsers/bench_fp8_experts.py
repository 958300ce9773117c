"""``moe-sbo bench fp8-experts``'s options (runner: ``moe_sbo.bench.fp8_experts``)."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Time FP8 routed experts against bf16 on the same weights on one GPU: the routed MLP per experts and
rows per expert (graph-replayed and eager), the whole layer per token count, and with --sweep each
GEMM alone per tile config. Rows go to OUT/fp8_experts.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="short timings (CPU smoke)")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--decode-rows", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    parser.add_argument("--prefill-rows", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    parser.add_argument("--max-rows", type=int, default=65536, help="skip cases with more rows in all")
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="also time each GEMM per tile config")
    parser.add_argument("--sweep-only", action="store_true", help="only the per-GEMM sweep (no MLP or layer rows)")
    parser.add_argument(
        "--sweep-chosen",
        action="store_true",
        help="sweep only the configs fp8_gemm chooses from (and the sm90 kernel's)",
    )
    parser.add_argument("--layer-experts", type=int, default=32)
    parser.add_argument("--layer-tokens", type=int, nargs="*", default=[32, 128, 4096])

"""``moe-sbo bench generate``'s options (runner: ``moe_sbo.bench.generate``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...config import DECODE_LOOPS, MLA_STEPS, OVERLAP_MODES

DESCRIPTION = """\
Generate with a random DeepSeek-V3-shaped checkpoint: transformers on one GPU against moe-sbo's
expert-parallel MoE layers on --ranks ranks, the same prompts, per dispatcher and decode loop.
Rows go to OUT/generate.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 1], help="moe-sbo rows at each EP size")
    p.add_argument(
        "--dispatcher",
        nargs="+",
        default=["alltoall", "low_latency"],
        help="prefill dispatchers at EP > 1 (EP1: local)",
    )
    p.add_argument("--decode", nargs="+", default=list(DECODE_LOOPS), choices=DECODE_LOOPS)
    p.add_argument(
        "--mla",
        nargs="+",
        default=["absorbed"],
        choices=MLA_STEPS,
        help="MLA decode step: latent-space attention (load_model's absorb_mla) or transformers' own",
    )
    p.add_argument("--overlap", default="none", choices=list(OVERLAP_MODES), help="the MoE layers' overlap mode")
    p.add_argument("--compare-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed generations per row (the row: their median)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="where to write it (default: a temp dir)")

"""``moe-sbo bench sbo``'s options: single-batch overlap, every overlap mode x dispatcher x token count."""

from __future__ import annotations

import argparse

from ...config import OVERLAP_MODES
from .common import SWEEP_NOTES, add_sweep_arguments, add_tokens_arg

DESCRIPTION = f"""\
Time the MoE layer on N ranks: every overlap mode x dispatcher x token count (single-batch overlap).
Each mode's efficiency and speedup are measured against overlap none.

{SWEEP_NOTES}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_sweep_arguments(parser)
    add_tokens_arg(parser)
    parser.add_argument("--overlap", nargs="+", default=["all"], help=f"among {list(OVERLAP_MODES)}, or all")
    parser.add_argument(
        "--timeline", default=None, metavar="PNG", help="draw one forward per mode at --timeline-tokens"
    )
    parser.add_argument("--timeline-tokens", type=int, default=None, help="default: largest of --tokens up to 4096")
    parser.add_argument("--trace", default=None, metavar="PREFIX", help="also keep Chrome traces PREFIX.<mode>.json")

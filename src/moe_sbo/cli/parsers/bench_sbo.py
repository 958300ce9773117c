"""``moe-sbo bench sbo``'s options: single-batch overlap, every overlap mode x dispatcher x token count."""

from __future__ import annotations

import argparse

from ...config import OVERLAP_MODES
from .common import SWEEP_NOTES, add_sweep_arguments, add_tokens_arg

DESCRIPTION = f"""\
Time the MoE layer on N ranks: every overlap mode x dispatcher x token count,
each mode's speedup over overlap none, and last the best mode per token count.
{SWEEP_NOTES}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [options]"  # the options are listed below, in groups
    groups = add_sweep_arguments(parser)
    add_tokens_arg(groups["what"])
    groups["what"].add_argument(
        "--overlap", nargs="+", default=["all"], metavar="M", help=f"among {', '.join(OVERLAP_MODES)}, or all"
    )
    output = groups["output"]
    output.add_argument("--timeline", default=None, metavar="PNG", help="draw one forward per mode")
    output.add_argument(
        "--timeline-tokens", type=int, default=None, metavar="T", help="its tokens (default: largest <= 4096)"
    )
    output.add_argument("--trace", default=None, metavar="PREFIX", help="keep Chrome traces PREFIX.<mode>.json")

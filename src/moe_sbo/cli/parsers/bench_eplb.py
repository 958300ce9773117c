"""``moe-sbo bench eplb``'s options: expert load balancing on a skewed router."""

from __future__ import annotations

import argparse

from .common import PLACEMENT_POLICY_NAMES, SWEEP_NOTES, add_sweep_arguments, add_tokens_arg

DESCRIPTION = f"""\
Time expert load balancing on N ranks, the router skewed to --skew: per
dispatcher, tokens and redundant count, the rank load and the layer time
before and after a rebalance.
{SWEEP_NOTES}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [options]"  # the options are listed below, in groups
    groups = add_sweep_arguments(parser)
    add_tokens_arg(groups["what"])
    eplb = parser.add_argument_group("expert load balancing")
    eplb.add_argument(
        "--redundant",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="redundant slots/rank, a row each (default: 0 1 2)",
    )
    eplb.add_argument("--skew", default=None, metavar="LOAD", help="zipf:S or a --record-load file (default: zipf:1)")
    eplb.add_argument(
        "--policy",
        default=None,
        choices=PLACEMENT_POLICY_NAMES,
        metavar="NAME",
        help=f"{', '.join(PLACEMENT_POLICY_NAMES)} (default: global)",
    )
    eplb.add_argument(
        "--record-load", default=None, metavar="PATH", help="write the measured load, for --skew and plan --load"
    )

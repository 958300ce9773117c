"""``moe-sbo bench eplb``'s options: expert load balancing on a skewed router."""

from __future__ import annotations

import argparse

from .common import PLACEMENT_POLICY_NAMES, SKEW_HELP, SWEEP_NOTES, add_sweep_arguments, add_tokens_arg

DESCRIPTION = f"""\
Time expert load balancing on N ranks: per dispatcher, tokens per rank and redundant count, the
router skewed to --skew, the rank load and the layer time (overlap none) before and after a
rebalance, what moved and what the rebalance cost.

{SWEEP_NOTES}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_sweep_arguments(parser)
    add_tokens_arg(parser)
    eplb = parser.add_argument_group("expert load balancing")
    eplb.add_argument(
        "--redundant",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="redundant expert slots per rank, one case each (default: 0 1 2; 0 with --policy trivial or one rank)",
    )
    eplb.add_argument("--skew", default=None, metavar="zipf:S|PATH", help=f"{SKEW_HELP} (default: zipf:1)")
    eplb.add_argument(
        "--policy",
        default=None,
        choices=PLACEMENT_POLICY_NAMES,
        help="how the rebalance places experts (default: global); hierarchical: nodes of 8 ranks from "
        "16 ranks on, the model's expert groups",
    )
    eplb.add_argument(
        "--record-load",
        default=None,
        metavar="PATH",
        help="write the EP group's measured tokens per expert (every case's load window, summed) as JSON, "
        "for --skew PATH and plan --load",
    )

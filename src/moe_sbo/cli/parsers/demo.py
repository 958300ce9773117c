"""``moe-sbo demo``'s options: every dispatcher on local ranks against the single-rank reference."""

from __future__ import annotations

import argparse

from ...config import DISPATCHER_NAMES, OVERLAP_MODES, PRESETS
from ...hooks import HOOK_EVENTS
from .common import RANKS_HELP, add_device_arg, add_expert_dtype_arg

SUMMARY = "run every dispatcher on local ranks and compare with one rank"
DESCRIPTION = """\
Run every dispatcher (or --dispatcher) on N local ranks and compare each rank's output with the
single-rank reference layer (dispatcher local: all experts, same seed, so the same weights). Shows
the error, the bytes each rank sent and the time of each phase; --overlap all also checks every
overlap mode against none. Exit code 0 only if every run matches.

--elastic instead loses a rank mid-run (SIGKILL at --at of the second forward) and shows the others
recover: the lost set they agreed on, the group re-formed without it, the forward in flight re-run
degraded (equal to the single-rank layer with the lost experts masked) and the experts restored
(equal to the full layer), with the time of each step."""

# Where --elastic's victim dies: at a hook event of the second forward, or between the first two.
KILL_POINTS = (*HOOK_EVENTS, "between_forwards")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=None, help=RANKS_HELP)
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"model shapes: {', '.join(sorted(PRESETS))}",
    )
    parser.add_argument("--dispatcher", default="all", help=f"one of {sorted(DISPATCHER_NAMES)}, or all")
    parser.add_argument(
        "--tbo", action="store_true", help="put the MoE in a decoder layer (attention + MoE) run with two-batch overlap"
    )
    parser.add_argument(
        "--overlap",
        default="none",
        help=f"one of {list(OVERLAP_MODES)}, or all; other than none, none runs too for comparison",
    )
    parser.add_argument(
        "--eplb",
        action="store_true",
        help="expert load balancing: each layer with one redundant expert slot per rank (none on one rank), its "
        "router skewed to a Zipf(1) load; shows the rank load before and after a rebalance, the experts moved, "
        "and checks the output against the reference both times",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="kill one rank mid-run and show the others recover: agree on the loss, re-form, re-run the forward "
        "in flight degraded, restore the lost experts (needs --ranks >= 2)",
    )
    parser.add_argument(
        "--kill-rank", type=int, default=None, metavar="R", help="with --elastic: the rank to kill (default: the last)"
    )
    parser.add_argument(
        "--at",
        default="dispatch_in_flight",
        choices=KILL_POINTS,
        metavar="EVENT",
        help=f"with --elastic: where the rank dies: {', '.join(KILL_POINTS)}",
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    add_device_arg(parser)
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA"
    )
    add_expert_dtype_arg(parser)
    parser.add_argument("--iters", type=int, default=5, help="timed forwards per dispatcher (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON ({meta, rows}; -: standard output)")
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="run MoE layer --layer of this Hugging Face model "
        "directory instead of --preset with random weights (see docs/CHECKPOINTS.md)",
    )
    parser.add_argument(
        "--layer", type=int, default=None, help="with --checkpoint: layer index (default: first MoE layer)"
    )

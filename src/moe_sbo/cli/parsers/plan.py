"""``moe-sbo plan``'s options: the communication-budget planner (no GPU needed)."""

from __future__ import annotations

import argparse

from ... import planner
from ...config import PRESETS
from .common import SKEW_HELP

SUMMARY = "communication budget: bytes, bandwidth and overlap feasibility (--detail: the worked example)"
DESCRIPTION = """\
The communication-budget planner: bytes per token, per all-to-all and per decode step, the per-GPU
bandwidth a time-per-output-token target needs, and which overlap (single- or two-batch) fits; the
verdict is the last line. The tables asked for come first: --load (or --skew) the expert load
balance each placement policy reaches per EP size, --node-aware-ep flat against node-aware dispatch,
--memory-ep the weights each GPU holds. --detail adds the published DeepSeek-V3 decode budget (a
worked example) line by line, why each overlap fits or not, allgather against alltoall and the
weight memory. Needs no GPU."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = planner.PlanInputs.__dataclass_fields__
    parser.add_argument(
        "--model",
        default=None,
        help=f"preset ({', '.join(sorted(PRESETS))}) or path to a Hugging Face config.json (default: the "
        f"model a --load file was recorded on, else {planner.SEED_INPUTS['model']})",
    )
    parser.add_argument("--batch", type=int, default=d["batch"].default, help="decode tokens per GPU")
    parser.add_argument("--tpot-ms", type=float, default=d["tpot_ms"].default, help="time per output token SLO")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers with an all-to-all (default: all layers in the seed convention, MoE layers in the byte model)",
    )
    parser.add_argument("--attn-us", type=float, default=d["attn_us"].default, help="attention time per layer, T")
    parser.add_argument("--moe-us", type=float, default=d["moe_us"].default, help="MoE compute time per layer, t")
    parser.add_argument("--ep", type=int, default=d["ep"].default, help="expert-parallel size P")
    parser.add_argument("--hw", default=d["hw"].default, help=f"hardware: {', '.join(planner.HARDWARE)}")
    parser.add_argument(
        "--dispatch-dtype", default="fp8", choices=sorted(planner.ELEMENT_B), help="element type dispatch sends"
    )
    parser.add_argument(
        "--combine-dtype", default="bf16", choices=sorted(planner.ELEMENT_B), help="element type combine sends"
    )
    parser.add_argument(
        "--weight-dtype",
        default="bf16",
        choices=sorted(planner.ELEMENT_B),
        help="shared-expert weights, for the SBO time estimate",
    )
    parser.add_argument(
        "--micro-batches", type=int, default=d["micro_batches"].default, help="2 = two-batch overlap (TBO), 1 = none"
    )
    parser.add_argument(
        "--fanout",
        default="uniform",
        choices=planner.FANOUT_MODELS,
        help="destination ranks per token: exact uniform model, router Monte-Carlo, or worst case",
    )
    parser.add_argument(
        "--memory-ep",
        type=int,
        nargs="+",
        metavar="EP",
        help=(
            "EP sizes of the weight-memory table, routed experts / EP and the rest replicated (default: "
            f"{' '.join(map(str, planner.DEFAULT_MEMORY_EP))}, those that divide the experts, else --ep)"
        ),
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--load",
        metavar="FILE",
        help="a load file (bench eplb --record-load): add the expert load balance per EP size, redundant "
        "count and placement policy, and the predicted gain on the expert time",
    )
    load.add_argument("--skew", metavar="zipf:S|FILE", help=f"as --load, from {SKEW_HELP}")
    parser.add_argument(
        "--eplb-ep",
        type=int,
        nargs="+",
        metavar="EP",
        help=(
            "EP sizes of the load-balance table (default: "
            f"{' '.join(map(str, planner.DEFAULT_BALANCE_EP))}, those that divide the experts)"
        ),
    )
    parser.add_argument(
        "--redundant",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="redundant expert slots per rank of the load-balance table (default: "
        f"{' '.join(map(str, planner.DEFAULT_REDUNDANT))})",
    )
    parser.add_argument(
        "--node-aware-ep",
        type=int,
        nargs="+",
        metavar="EP",
        help="EP sizes (whole nodes of --hw's GPUs) of a table comparing flat and node-aware dispatch: "
        "crossings per token and dispatch + combine time of --batch tokens per GPU, e.g. 16 32 64 128 256",
    )
    parser.add_argument(
        "--detail",
        action="store_true",
        help="also the worked example, why each verdict, allgather vs alltoall and the weight memory per GPU",
    )
    parser.add_argument("--json", metavar="PATH", help="write inputs and results as JSON (-: standard output)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: batch vs a2a time and bandwidth")
    parser.add_argument(
        "--calibrate",
        metavar="RESULT.json",
        help="benchmark result file whose measured bandwidth/latency replace the datasheet",
    )

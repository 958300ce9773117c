"""``moe-sbo bench tbo``'s options: the decoder layer (attention + MoE) without and with two-batch overlap."""

from __future__ import annotations

import argparse

from ...config import OVERLAP_MODES
from .common import SWEEP_NOTES, add_sweep_arguments, device_default

DESCRIPTION = f"""\
Time a decoder layer (attention + MoE) on N ranks without and with two-batch overlap, per overlap
mode x dispatcher x prefill or decode size. Each row's speedup is measured against the same size
without TBO and with overlap none.

{SWEEP_NOTES}"""


def gemm_sm_budget_arg(text: str) -> int | str | None:
    """``--tbo-gemm-sm-budget``: a number of SMs, ``auto`` or ``all`` (None: no budget)."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of SMs, 'auto' or 'all', got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_sweep_arguments(parser)
    parser.add_argument("--overlap", nargs="+", default=["all"], help=f"among {list(OVERLAP_MODES)}, or all")
    parser.add_argument("--timeline", default=None, metavar="PNG", help="draw one forward per case")
    parser.add_argument(
        "--trace", default=None, metavar="PREFIX", help="also keep Chrome traces PREFIX.tbo.<case>.json"
    )
    tbo = parser.add_argument_group("two-batch overlap: a decoder layer, attention + MoE")
    tbo.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="*",
        default=None,
        help=device_default("prefill_tokens", "prefill tokens per rank"),
    )
    tbo.add_argument(
        "--decode-seqs",
        type=int,
        nargs="*",
        default=None,
        help=device_default("decode_seqs", "decode sequences per rank"),
    )
    tbo.add_argument(
        "--kv-len", type=int, default=None, help=device_default("kv_len", "cached tokens per decode sequence")
    )
    tbo.add_argument("--heads", type=int, default=None, help=device_default("heads", "attention heads"))
    tbo.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help=device_default("kv_heads", "GQA key/value heads (8: about MLA's cache)"),
    )
    tbo.add_argument("--head-dim", type=int, default=None, help=device_default("head_dim", "attention head dimension"))
    tbo.add_argument(
        "--delay",
        type=int,
        nargs="+",
        default=[0, 1],
        help="stages micro-batch A runs before B starts; one TBO row per value",
    )
    tbo.add_argument(
        "--auto-tbo",
        action="store_true",
        help="also a row per overlap mode where TBO is on or off as moe_sbo.overlap.tbo_auto.AutoTbo "
        "chooses after timing both (with the first --delay); its choice is in the row",
    )
    tbo.add_argument(
        "--tbo-gemm-sm-budget",
        type=gemm_sm_budget_arg,
        default="auto",
        metavar="SMS|auto|all",
        help="CUDA: the SMs every GEMM under TBO plans for, leaving the others to the other micro-batch's "
        "transfer: a number, 'all', or 'auto' (default: all but the SMs the transfer holds, "
        "moe_sbo.overlap.tbo.resolve_gemm_sm_budget); the number used is in every TBO row as tbo_gemm_sm_budget",
    )

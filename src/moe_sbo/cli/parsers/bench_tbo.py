"""``moe-sbo bench tbo``'s options: the decoder layer (attention + MoE) without and with two-batch overlap."""

from __future__ import annotations

import argparse

from ...config import OVERLAP_MODES
from .common import SWEEP_NOTES, add_sweep_arguments, device_default

DESCRIPTION = f"""\
Time a decoder layer on N ranks with and without two-batch overlap, per size.
{SWEEP_NOTES}"""


def gemm_sm_budget_arg(text: str) -> int | str | None:
    """``--tbo-gemm-sm-budget``: a number of SMs, ``auto`` or ``all`` (None: no budget)."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of SMs, 'auto' or 'all', got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [options]"  # the options are listed below, in groups
    groups = add_sweep_arguments(parser)
    groups["what"].add_argument(
        "--overlap", nargs="+", default=["all"], metavar="M", help=f"among {', '.join(OVERLAP_MODES)}, or all"
    )
    groups["output"].add_argument("--timeline", default=None, metavar="PNG", help="draw one forward per case")
    groups["output"].add_argument(
        "--trace", default=None, metavar="PREFIX", help="keep Chrome traces PREFIX.tbo.<case>.json"
    )
    tbo = parser.add_argument_group("decoder layer and two-batch overlap")
    for flag, key, what in (
        ("--prefill-tokens", "prefill_tokens", "tokens/rank"),
        ("--decode-seqs", "decode_seqs", "sequences/rank"),
    ):
        tbo.add_argument(flag, type=int, nargs="*", default=None, metavar="N", help=device_default(key, what))
    for flag, key, what in (
        ("--kv-len", "kv_len", "cached tokens/sequence"),
        ("--heads", "heads", "attention heads"),
        ("--kv-heads", "kv_heads", "key/value heads"),
        ("--head-dim", "head_dim", "head dimension"),
    ):
        tbo.add_argument(flag, type=int, default=None, metavar="N", help=device_default(key, what))
    tbo.add_argument(
        "--delay", type=int, nargs="+", default=[0, 1], metavar="N", help="stages A runs before B; a row each"
    )
    tbo.add_argument("--auto-tbo", action="store_true", help="also rows where AutoTbo turns TBO on or off")
    tbo.add_argument(
        "--tbo-gemm-sm-budget",
        type=gemm_sm_budget_arg,
        default="auto",
        metavar="SMS",
        help="SMs of TBO's GEMMs: N, all or auto",
    )

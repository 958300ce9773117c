"""``moe-sbo check``'s options: one MoE layer of a checkpoint against transformers' own module."""

from __future__ import annotations

import argparse

from ...config import DISPATCHER_NAMES
from .common import RANKS_HELP, add_device_arg, add_expert_dtype_arg

SUMMARY = "load one MoE layer of a checkpoint, run every dispatcher, compare with transformers"
DESCRIPTION = """\
Load one MoE layer of a Hugging Face checkpoint (config.json + safetensors), each rank reading only
its own experts, run every dispatcher on it, and compare each rank's output with transformers' own
MoE block for the model (built in this process on the whole layer, in float32). Tolerance, relative
L2 error per rank: 1e-5 with --dtype float32, 2e-2 with bfloat16, 6e-2 with --expert-dtype fp8
(e4m3 expert weights with 128x128 block scales; the reference runs on those weights dequantised, and
the experts' two e4m3 activation quantisations, ~2.6% RMS each, leave ~4%). Exit code 0 only if
every dispatcher on every rank is within it. The checkpoint is checked (config.json, layer, every
tensor name, shape and FP8 scale) before any rank starts."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="model directory: config.json + model.safetensors or model.safetensors.index.json",
    )
    parser.add_argument("--layer", type=int, default=None, help="decoder layer index (default: the first MoE layer)")
    parser.add_argument("--ranks", type=int, default=None, help=RANKS_HELP)
    parser.add_argument(
        "--dispatcher",
        default="all",
        help=f"one of {sorted(DISPATCHER_NAMES)}, or all (the expert-parallel ones; local on 1 rank)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="random tokens per rank")
    add_device_arg(parser)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="our layer's dtype; the transformers reference runs in float32",
    )
    add_expert_dtype_arg(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON ({meta, rows}; -: standard output)")

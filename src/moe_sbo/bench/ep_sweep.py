"""The options the EP-size sweeps share (``foundation``, ``low-latency``, ``prefill``), and their
resolution before any rank starts.

The hard part is ``--help``: the modes' parsers call ``add_ep_sweep_args``, so this module imports
nothing heavy at its top; ``EpSweep.from_args`` imports torch when a run starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def default_dtype_name(device: str) -> str:
    """The activation dtype a run uses unless told: bf16 on GPUs, float32 on CPU ranks."""
    return "bfloat16" if device == "cuda" else "float32"


def add_ep_sweep_args(p: argparse.ArgumentParser, file_name: str, iters: int) -> None:
    """The options of the EP-size sweeps; ``iters``: the default timed calls (``--quick``: 3)."""
    p.add_argument("--out", required=True, help=f"directory for {file_name}")
    p.add_argument(
        "--ranks", type=int, nargs="+", default=None, help="EP sizes, one pool each (default: every GPU; 2 on CPU)"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; --quick 1)")
    p.add_argument("--iters", type=int, default=None, help=f"timed calls (default {iters}; --quick 3)")
    p.add_argument("--quick", action="store_true", help="few iterations: a smoke run, not a measurement")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(default_iters=iters)


@dataclass(frozen=True)
class EpSweep:
    """``add_ep_sweep_args``' options resolved and checked before any rank starts: the device, untimed
    and timed calls, and the EP sizes (every GPU, or 2 CPU ranks, when ``--ranks`` is not given)."""

    device: str
    warmup: int
    iters: int
    ep_sizes: list[int]

    @classmethod
    def from_args(cls, args: argparse.Namespace, tokens: list[int]) -> EpSweep:
        import torch

        from ..launch.group import resolve_device

        device = resolve_device(args.device)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10)
        iters = args.iters if args.iters is not None else (3 if args.quick else args.default_iters)
        if args.ranks and min(args.ranks) < 1:
            raise ValueError(
                f"--ranks must be >= 1, got {min(args.ranks)}; leave it out for the default (every GPU on CUDA, "
                "2 on CPU)"
            )
        ep_sizes = list(args.ranks) if args.ranks else [torch.cuda.device_count() if device == "cuda" else 2]
        if min(tokens) < 0 or warmup < 0 or iters < 1:
            raise ValueError(f"--tokens must be >= 0 and --iters >= 1, got {tokens} and {iters}")
        return cls(device, warmup, iters, ep_sizes)

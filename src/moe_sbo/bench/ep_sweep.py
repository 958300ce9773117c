"""The options the EP-size sweeps share (``foundation``, ``low-latency``, ``prefill``; their parsers
call ``cli.parsers.common.add_ep_sweep_args``), resolved and checked before any rank starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..launch.group import resolve_device
from ..measure.options import default_ep_size, resolve_ranks


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
        device = resolve_device(args.device)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10)
        iters = args.iters if args.iters is not None else (3 if args.quick else args.default_iters)
        ep_sizes = [resolve_ranks(p, device) for p in args.ranks] if args.ranks else [default_ep_size(device)]
        if min(tokens) < 0 or warmup < 0 or iters < 1:
            raise ValueError(f"--tokens must be >= 0 and --iters >= 1, got {tokens} and {iters}")
        return cls(device, warmup, iters, ep_sizes)

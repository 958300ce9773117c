"""Command-line options and defaults the subcommands and the ``benchmarks/`` drivers share.

The hard part is checking before starting: every option is resolved and checked here, on the
launching process, so a bad value is a usage error before any rank starts.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from ..config import PRESETS
from ..runtime import resolve_device


def make_console() -> Console:
    """A console that keeps wide tables readable when output is piped (rich assumes 80 columns)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def default_dtype_name(device: str) -> str:
    """The activation dtype a run uses unless told: bf16 on GPUs, float32 on CPU ranks."""
    return "bfloat16" if device == "cuda" else "float32"


def default_ep_size(device: str) -> int:
    """Ranks a benchmark starts unless told: every visible GPU, or 2 CPU ranks."""
    return torch.cuda.device_count() if device == "cuda" else 2


def add_rank_args(p: argparse.ArgumentParser, preset: str = "tiny") -> None:
    """The options a one-setup driver (soak, validation cost) shares: device, rank count, preset, dtype."""
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: every GPU, or 2 on CPU)")
    p.add_argument("--preset", default=preset, choices=sorted(PRESETS))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")


def result_path(out: str, stem: str, device: str) -> Path:
    """``out`` as given, or ``out/<stem>_<device>.json`` when it names a directory."""
    path = Path(out)
    return path / f"{stem}_{device}.json" if path.is_dir() else path


def add_sweep_args(p: argparse.ArgumentParser, file_name: str, iters: int) -> None:
    """The options of the EP-size sweeps (``bench_foundation``, ``bench_low_latency``); ``iters``: the
    default timed calls (``--quick``: 3)."""
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
class Sweep:
    """``add_sweep_args``' options resolved and checked before any rank starts."""

    device: str
    warmup: int
    iters: int
    ep_sizes: list[int]

    @classmethod
    def from_args(cls, args: argparse.Namespace, tokens: list[int]) -> Sweep:
        device = resolve_device(args.device)
        warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10)
        iters = args.iters if args.iters is not None else (3 if args.quick else args.default_iters)
        ep_sizes = args.ranks or [default_ep_size(device)]
        if min(tokens) < 0 or warmup < 0 or iters < 1:
            raise ValueError(f"--tokens must be >= 0 and --iters >= 1, got {tokens} and {iters}")
        for p in ep_sizes:
            if device == "cuda" and p > torch.cuda.device_count():
                raise ValueError(f"--ranks must be <= the {torch.cuda.device_count()} visible GPUs, got {p}")
        return cls(device, warmup, iters, ep_sizes)

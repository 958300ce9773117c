"""``moe-sbo bench router``'s options (runner: ``moe_sbo.bench.router``)."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Time the router's expert selection, torch ops against the fused Triton kernel, per preset and token
count: graph-replayed device time and host time per eager call. Rows go to OUT/router.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--presets", nargs="+", default=["deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 4096, 16384])
    parser.add_argument("--host-calls", type=int, default=200)

"""``moe-sbo bench load-memory``'s options (runner: ``moe_sbo.bench.load_memory``)."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Write a random DeepSeek-V3-style checkpoint, load it on --ranks CPU ranks and report each rank's
peak host-memory growth against the bytes it must hold. Prints one JSON object; --out writes it too."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)

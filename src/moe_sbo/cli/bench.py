"""``moe-sbo bench <mode>``: runs the mode's runner, imported only now (``parsers.bench.BENCH_MODES``
names it), so the parsers of every mode stay torch-free and a new mode touches only the registry."""

from __future__ import annotations

import argparse
import importlib

from ..launch.signals import signals_deferred
from .parsers.bench import BENCH_MODES


def run_bench(args: argparse.Namespace) -> int:
    """The runner of ``args.mode``: its ``main(args)``, whose exit status this returns."""
    with signals_deferred():  # as ``main._run``: a signal inside a native library's import can abort
        runner = importlib.import_module(BENCH_MODES[args.mode][2])
    return runner.main(args)

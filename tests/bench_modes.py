"""Running a ``moe-sbo bench`` mode as a user would, in a subprocess, for the CPU smoke tests of the modes.

The mode's parser (``moe_sbo.cli.bench_parsers.<mode>``) fills a parser of its own and its runner's
``main`` takes the parsed options: what ``moe-sbo bench <mode>`` does, without the ``bench``
dispatcher (``moe_sbo.cli.parsers``), which this helper does not go through.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_MODE = """
import argparse, importlib, sys
mode = sys.argv[1]
parser = argparse.ArgumentParser(prog="moe-sbo bench " + mode)
importlib.import_module("moe_sbo.cli.bench_parsers." + mode.replace("-", "_")).add_arguments(parser)
args = parser.parse_args(sys.argv[2:])
sys.exit(importlib.import_module("moe_sbo.bench." + mode.replace("-", "_")).main(args))
"""


def run_mode(mode: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``moe-sbo bench <mode> <args>`` from the repository root with ``src`` importable; asserts that it
    exited 0 (showing the end of its output if not) and returns the finished process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", RUN_MODE, mode, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc

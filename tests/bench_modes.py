"""Running a ``moe-sbo bench`` mode as a user would (``python -m moe_sbo bench <mode> ...`` in a
subprocess), for the CPU smoke tests of the modes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_mode(mode: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``moe-sbo bench <mode> <args>`` from the repository root with ``src`` importable; asserts that it
    exited 0 (showing the end of its output if not) and returns the finished process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "moe_sbo", "bench", mode, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc

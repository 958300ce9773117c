"""The ``meta`` block every result file carries (DESIGN.md §7): command, commit, GPU, versions, date."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def result_meta(device: str, world_size: int) -> dict:
    cuda = device == "cuda" and torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "world_size": world_size,
        "torch": torch.__version__,
        "nccl": nccl,
    }


def write_results(path, meta: dict, rows: list[dict]) -> None:
    """``{"meta", "rows"}`` to ``path`` (DESIGN.md §7), floats to 4 significant digits (medians: more
    digits are noise). Benchmarks call it after every step, so a run cut short keeps what it measured."""
    rounded = [{k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()} for row in rows]
    Path(path).write_text(json.dumps({"meta": meta, "rows": rounded}, indent=1))

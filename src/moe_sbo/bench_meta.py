"""Result files (DESIGN.md §7): the ``meta`` block every one carries (command, commit, GPU, versions,
date), and ``ResultFile``, which every benchmark driver fills one step at a time; and the defaults
and sweep options the benchmark drivers share."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass
class ResultFile:
    """A benchmark's rows and meta, written to ``path`` (if any) after every step.

    ``add_step`` turns a failed step (a rank raised: ``RankError``) into an error row instead of
    ending the sweep, so one bad configuration never loses the others' measurements. ``errors``
    counts the error rows, a step's own or the ones its rows carry.
    """

    path: Path | None
    meta: dict
    rows: list[dict] = field(default_factory=list)
    errors: int = 0

    def save(self) -> None:
        if self.path is not None:
            write_results(self.path, self.meta, self.rows)

    def add_step(self, run: Callable[[], list[dict]], error_row: dict) -> str | None:
        """Append ``run()``'s rows, or ``error_row`` plus the failure if a rank failed; save. Returns
        the failure's text (``None`` when the step worked) for the caller to show."""
        from .runtime import RankError

        try:
            new_rows, failure = run(), None
        except RankError as exc:
            failure = str(exc)[-3000:]
            new_rows = [{**error_row, "error": failure}]
        self.rows.extend(new_rows)
        self.errors += sum("error" in row for row in new_rows)
        self.save()
        return failure

    def add_timed_step(self, label: str, run: Callable[[], list[dict]], error_row: dict, started: float) -> None:
        """``add_step``, then the failure (if any) on stderr and one progress line: seconds since
        ``started`` (a ``time.perf_counter()`` value) and this step's own seconds."""
        t0 = time.perf_counter()
        failure = self.add_step(run, error_row)
        if failure:
            print(failure, file=sys.stderr)
        print(f"[{time.perf_counter() - started:6.1f}s] {label}: {time.perf_counter() - t0:.1f}s", flush=True)


# ---- what the benchmark drivers share ----------------------------------------------------------------


def default_dtype_name(device: str) -> str:
    """The activation dtype a run uses unless told: bf16 on GPUs, float32 on CPU ranks."""
    return "bfloat16" if device == "cuda" else "float32"


def default_ep_size(device: str) -> int:
    """Ranks a benchmark starts unless told: every visible GPU, or 2 CPU ranks."""
    return torch.cuda.device_count() if device == "cuda" else 2


def add_rank_args(p: argparse.ArgumentParser, preset: str = "tiny") -> None:
    """The options a one-setup driver (soak, validation cost) shares: device, rank count, preset, dtype."""
    from .config import PRESETS

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
    p.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="EP sizes, one pool each (default: every GPU; 2 on CPU)")
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
    def from_args(cls, args: argparse.Namespace, tokens: list[int]) -> "Sweep":
        from .runtime import resolve_device

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

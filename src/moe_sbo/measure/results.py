"""Result files: ``{"meta": {...}, "rows": [...]}``, the ``meta`` block every one carries (command,
commit, GPU, date, and the versions: moe-sbo, Python, torch, Triton, CUDA, NCCL), and
``ResultFile``, which every benchmark driver fills one step at a time.

The hard part is losing nothing: a sweep's step can fail on one rank, so the file is rewritten after
every step and a failed step becomes an error row instead of ending the sweep.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..launch.group import ranks_per_gpu
from .environment import environment


def source_digest(root: Path | None = None) -> str:
    """The first 12 hex digits of a sha256 over the package's Python sources (paths and bytes).

    It names the code a result ran on where git cannot: a copy of the tree without its history, or
    with history older than the files (as on a remote GPU machine); equal digests, equal code.
    """
    root = root or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def shared_gpu_note(device: str, world_size: int) -> str | None:
    """The line a run prints when its ``world_size`` CUDA ranks share GPUs (placed round-robin), else
    None: such a run checks correctness, hangs and host cost, never wire speed."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    gpus = torch.cuda.device_count()
    if ranks_per_gpu(world_size, gpus) == 1:
        return None
    return (
        f"{world_size} ranks share {gpus} GPU(s): a functional run (correctness, hangs, host cost), not wire "
        "speed; its rows say wire shared-gpu"
    )


def result_meta(device: str, world_size: int, wire: str | None = None) -> dict:
    """What every result file's ``meta`` records; ``wire`` (``nvlink``, ``gloo-cpu``, ``emulated-internode``,
    ``none``, ...: ``bench.defaults.WIRE_LABELS``), for the benchmarks that record one, names the link the
    ranks' transfers crossed: ``shared-gpu`` whenever CUDA ranks share GPUs (``ranks_per_gpu`` > 1)."""
    cuda = device == "cuda" and torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    env = environment(gpus=False)  # the GPU and NCCL below are the ones torch ran with
    meta = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": git_commit(),
        "source_sha": source_digest(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "world_size": world_size,
        "moe_sbo": env["moe_sbo"],
        "python": env["python"],
        "torch": torch.__version__,
        "triton": env["triton"],
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }
    if cuda:
        per_gpu = meta["ranks_per_gpu"] = ranks_per_gpu(world_size, torch.cuda.device_count())
        if per_gpu > 1:
            wire = "shared-gpu"
    if wire is not None:
        meta["wire"] = wire
    return meta


class StandardOutput:
    """An output path given as ``-``: the document goes to standard output, once, whole (``STDOUT``)."""

    def __str__(self) -> str:
        return "standard output"


STDOUT = StandardOutput()


def dump_json(target: Path | str | StandardOutput, doc: dict, indent: int = 1) -> None:
    """``doc`` as JSON to ``target``: a file (its folder made now: the command checked before any
    work that it can be written), or standard output."""
    text = json.dumps(doc, indent=indent) + "\n"
    if isinstance(target, StandardOutput):
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside it, then renamed over it: a run cut short mid-write leaves the previous file whole.
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def write_results(path: Path | str | StandardOutput, meta: dict, rows: list[dict]) -> None:
    """``{"meta", "rows"}`` to ``path``, floats to 4 significant digits (medians: more
    digits are noise). Benchmarks call it after every step, so a run cut short keeps what it measured."""
    rounded = [{k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()} for row in rows]
    dump_json(path, {"meta": meta, "rows": rounded})


@dataclass
class ResultFile:
    """A benchmark's rows and meta, written to ``path`` (if any) after every step (standard output:
    once, by the last ``save``).

    ``add_step`` turns a failed step (a rank raised: ``RankError``) into an error row instead of
    ending the sweep, so one bad configuration never loses the others' measurements. ``errors``
    counts the error rows, a step's own or the ones its rows carry.
    """

    path: Path | StandardOutput | None
    meta: dict
    rows: list[dict] = field(default_factory=list)
    errors: int = 0

    def save(self) -> None:
        """Write the file now (standard output: the whole document, so call it once, at the end)."""
        if self.path is not None:
            write_results(self.path, self.meta, self.rows)

    def _save_step(self) -> None:
        """After a step: the file rewritten; standard output waits for ``save`` at the end."""
        if not isinstance(self.path, StandardOutput):
            self.save()

    def add_step(self, run: Callable[[], list[dict]], error_row: dict) -> str | None:
        """Append ``run()``'s rows, or ``error_row`` plus the failure if a rank failed; save. Returns
        the failure's text (``None`` when the step worked) for the caller to show."""
        from ..launch.failures import RankError

        try:
            new_rows, failure = run(), None
        except RankError as exc:
            failure = str(exc)[-3000:]
            new_rows = [{**error_row, "error": failure}]
        self.rows.extend(new_rows)
        self.errors += sum("error" in row for row in new_rows)
        self._save_step()
        return failure

    def add_timed_step(self, label: str, run: Callable[[], list[dict]], error_row: dict, started: float) -> None:
        """``add_step``, then the failure (if any) on stderr and one progress line: seconds since
        ``started`` (a ``time.perf_counter()`` value) and this step's own seconds."""
        t0 = time.perf_counter()
        failure = self.add_step(run, error_row)
        if failure:
            print(failure, file=sys.stderr)
        print(f"[{time.perf_counter() - started:6.1f}s] {label}: {time.perf_counter() - t0:.1f}s", flush=True)

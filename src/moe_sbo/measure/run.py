"""A command's run on local ranks, the steps every one takes in this order (``demo``, ``check``,
``generate`` and each ``bench`` mode): its output files made writable, the device and rank count
resolved, the memory checked (``memory.check_memory``), the ranks started (a spinner while they
start), a rank function run on each, a table printed, the rows written as JSON.

The hard part is the order: everything that can be refused is refused before the first rank starts,
so a bad value is a usage error (exit 2), never a failure half way through; and the output paths
come first, so writing the results cannot fail after the work. ``LocalRanks`` and ``RankPool`` are
started here and nowhere else in the commands.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from ..launch.group import resolve_device
from ..launch.ranks import LocalRanks, RankPool
from .options import in_ranks, make_console, resolve_ranks
from .progress import starting_ranks


def output_file(flag: str, value: str | None) -> Path | None:
    """The file ``flag`` (``--json``, ``--out``, ...) names, ready to be written: its folder is made
    now, before any work, as every subcommand does, so writing the results cannot fail after the
    work. ``ValueError`` (exit 2) for a path that names a folder or cannot be written; None for None."""
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{flag} must name a file, got the folder {value}; add a file name, e.g. {path / 'out.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        existing = next(p for p in path.parents if p.exists())
        why = f"{existing} is a file" if not existing.is_dir() else err.strerror
        raise ValueError(
            f"{flag} must be in a folder that can be made, got {value}: {why}; choose another path"
        ) from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} must be a path this user can write, got {value}; choose another path")
    return path


@dataclass(frozen=True)
class Ranks:
    """Where a command runs, resolved before any rank starts: the device (``cpu`` or ``cuda``) and how
    many ranks; ``console``: where its tables and lines go."""

    device: str
    count: int
    console: Console

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(device, *args, **kwargs)`` on every rank, started for this call (a spinner on stderr
        while they start) and stopped after it; every rank's return value, in rank order."""
        with starting_ranks(self.count, self.device):
            workers = LocalRanks(self.count, device=self.device)
        with workers:
            return workers.run(in_ranks(fn), *args, **kwargs)

    def pool(self, environ: dict[str, str] | None = None) -> RankPool:
        """Ranks for a sweep of several calls, started at the first (``RankPool``)."""
        return RankPool(self.count, self.device, environ=environ)


def prepare(device: str, ranks: int | None, *outputs: tuple[str, str | None]) -> tuple[Ranks, list[Path | None]]:
    """The first steps of every command, in order: each ``(flag, value)`` of ``outputs`` made writable
    (``output_file``; their paths returned, None where not given), then ``--device`` and ``--ranks``."""
    paths = [output_file(flag, value) for flag, value in outputs]
    resolved = resolve_device(device)
    return Ranks(resolved, resolve_ranks(ranks, resolved), make_console()), paths


def write_json(path: Path, doc: dict, console: Console, said: str) -> None:
    """``doc`` as JSON at ``path``; then ``said`` (the line naming the file) on ``console``, unbroken."""
    path.write_text(json.dumps(doc, indent=1))
    console.print(said, highlight=False, soft_wrap=True)  # a path is printed whole, never broken

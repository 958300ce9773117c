"""A command's run on local ranks, the steps every one takes in this order (``demo``, ``check``,
``generate`` and each ``bench`` mode): its output paths checked, the device and rank count
resolved, the memory checked (``memory.check_memory``), the ranks started (a spinner while they
start), a rank function run on each, a table printed, the rows written as JSON.

The hard part is the order: everything that can be refused is refused before the first rank starts,
so a bad value is a usage error (exit 2), never a failure half way through; and the output paths
come first, so writing the results cannot fail after the work (a folder is made only when written:
a command refused for bad input leaves none behind). ``LocalRanks`` and ``RankPool`` are
started here and nowhere else in the commands.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from ..launch.group import resolve_device
from ..launch.ranks import LocalRanks, RankPool
from .options import in_ranks, make_console, resolve_ranks
from .progress import starting_ranks
from .results import STDOUT, StandardOutput, dump_json


def output_file(flag: str, value: str | None) -> Path | StandardOutput | None:
    """Where a JSON output (``--json``, ``--out``) goes, checked before any work: ``-`` is standard
    output (``STDOUT``), anything else a file, as ``output_path`` checks it."""
    return STDOUT if value == "-" else output_path(flag, value)


def output_path(flag: str, value: str | None) -> Path | None:
    """The file ``flag`` names, checked before any work, so the work is never lost to a path found
    bad at its end: a file this user can write, in a folder that exists or can be made. Nothing is
    made here (a command refused for bad input leaves no folder behind): the folder is made when the
    file is written. ``ValueError`` (exit 2) for a path that cannot be; None for None."""
    if value is None:
        return None
    if value == "-":
        raise ValueError(f"{flag} must name a file, got -; standard output takes JSON only (--json -, --out -)")
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{flag} must name a file, got the folder {value}; add a file name, e.g. {path / 'out.json'}")
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ValueError(
            f"{flag} must be in a folder that can be made, got {value}: {existing} is a file; choose another path"
        )
    try:
        if path.exists():
            with open(path, "ab"):  # opened to append: nothing written, its contents kept
                pass
        else:  # a file made and removed at once where the first missing folder would go
            tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise ValueError(
            f"{flag} must be a path this user can write, got {value}: {err.strerror} in {existing}; choose another path"
        ) from None
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


def prepare(
    device: str, ranks: int | None, *outputs: tuple[str, str | None]
) -> tuple[Ranks, list[Path | StandardOutput | None]]:
    """The first steps of every command, in order: each ``(flag, value)`` of ``outputs`` checked
    (``output_file``; their paths returned, None where not given), then ``--device`` and ``--ranks``.
    With an output on standard output (``-``), the console prints on stderr."""
    paths = [output_file(flag, value) for flag, value in outputs]
    resolved = resolve_device(device)
    console = make_console(stdout_taken=any(path is STDOUT for path in paths))
    return Ranks(resolved, resolve_ranks(ranks, resolved), console), paths


def write_json(path: Path | StandardOutput, doc: dict, console: Console, said: str) -> None:
    """``doc`` as JSON at ``path`` (its folder made now) or on standard output; then ``said`` (the
    line naming where) on ``console``, unbroken."""
    dump_json(path, doc)
    console.print(said, highlight=False, soft_wrap=True)  # a path is printed whole, never broken

"""Progress on stderr for what takes more than a few seconds: a spinner while the ranks start, and a
bar rank 0 draws over a rank function's steps (``demo``: dispatcher x overlap runs; ``check``:
dispatchers; ``generate``: decode steps).

The hard part is keeping stdout's contract: tables and the closing verdict line go to stdout, which
scripts and tests read, so progress goes to stderr, and only to a terminal (piped or captured, it
draws nothing, not even a blank line). Ranks are other processes: rank 0 draws its own bar (its
stderr is the launcher's), the other ranks draw nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


def _stderr_console():
    """A rich console on stderr, or None when stderr is not a terminal."""
    from rich.console import Console

    console = Console(stderr=True)
    return console if console.is_terminal else None


@contextlib.contextmanager
def starting_ranks(ranks: int, device: str) -> Iterator[None]:
    """A spinner on stderr for the block in which ``ranks`` ranks start (it ends with the block)."""
    console = _stderr_console()
    if console is None:
        yield
        return
    with console.status(f"starting {ranks} {device} ranks"):
        yield


def rank_progress(rank: int, total: int, what: str) -> Callable[..., None] | None:
    """On rank 0, a bar of ``total`` steps on stderr: call the function returned after each step, with
    the step's label or none (shown after ``what``); it ends itself after the last. None on the other
    ranks, and where stderr is not a terminal."""
    console = _stderr_console() if rank == 0 else None
    if console is None or total < 1:
        return None
    from rich.progress import Progress

    progress = Progress(console=console, transient=True)
    task = progress.add_task(what, total=total)
    progress.start()

    def step(label: str = "") -> None:
        progress.update(task, advance=1, description=f"{what} {label}".strip())
        if progress.finished:
            progress.stop()

    return step

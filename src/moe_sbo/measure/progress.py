"""Progress on stderr for what takes more than a few seconds: a spinner while the ranks start, a
bar rank 0 draws over a rank function's steps (``demo``: dispatcher x overlap runs; ``check``:
dispatchers; ``generate``: decode steps), and a bar the launching process draws over a ``bench``
sweep's steps. ``progress_console`` is the one place that decides where progress is drawn.

The hard part is keeping stdout's contract: tables and the closing verdict line go to stdout, which
scripts and tests read, so progress goes to stderr, and only to a terminal (piped or captured, it
draws nothing, not even a blank line). Ranks are other processes: rank 0 draws its own bar (its
stderr is the launcher's), the other ranks draw nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


def progress_console():
    """Where every progress display is drawn: a rich console on stderr, or None when stderr is not a
    terminal (nothing is drawn)."""
    from rich.console import Console

    console = Console(stderr=True)
    return console if console.is_terminal else None


@contextlib.contextmanager
def starting_ranks(ranks: int, device: str) -> Iterator[None]:
    """A spinner on stderr for the block in which ``ranks`` ranks start (it ends with the block)."""
    console = progress_console()
    if console is None:
        yield
        return
    with console.status(f"starting {ranks} {device} ranks"):
        yield


def rank_progress(rank: int, total: int, what: str) -> Callable[..., None] | None:
    """On rank 0, a bar of ``total`` steps on stderr: call the function returned after each step, with
    the step's label or none (shown after ``what``); it ends itself after the last. None on the other
    ranks, and where stderr is not a terminal."""
    console = progress_console() if rank == 0 else None
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


class StepBar:
    """A bar over a loop of the launching process (``bench``'s steps) on stderr: ``start(label)`` as a
    step begins, ``advance()`` as it ends. Draws nothing where stderr is not a terminal."""

    def __init__(self, total: int) -> None:
        console = progress_console()
        self._progress = None
        if console is not None and total > 0:
            import sys

            from rich.progress import Progress

            # Lines printed to stdout while the bar is drawn go above it, when both are the terminal;
            # piped, stdout is left alone.
            self._progress = Progress(console=console, transient=True, redirect_stdout=sys.stdout.isatty())
            self._task = self._progress.add_task("", total=total)

    def __enter__(self) -> StepBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start(self, label: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=label)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

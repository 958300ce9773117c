"""Running stage generators: a forward written as a generator that pauses (``yield``) while a
transfer is in flight, run straight through or interleaved with another.

The hard part is cleanup: when one of two interleaved forwards raises, the other must still leave
its hook scope, so both generators are closed before the error propagates.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

A = TypeVar("A")
B = TypeVar("B")


def run_to_end(stages: Generator[None, None, A]) -> A:
    """Run a ``stages`` generator without pausing; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def run_interleaved(stages_a: Generator[None, None, A], stages_b: Generator[None, None, B], delay: int) -> tuple[A, B]:
    """Run A ``delay`` stages ahead, then alternate A, B; both generators' return values.

    If either raises, both are closed (so each exits its hook scope) and the error propagates.
    """
    if delay < 0:
        raise ValueError(f"delay must be >= 0 stages, got {delay}")
    gens: tuple[Generator[None, None, object], Generator[None, None, object]] = (stages_a, stages_b)
    results: list = [None, None]
    done = [False, False]

    def step(i: int) -> None:
        try:
            next(gens[i])
        except StopIteration as finished:
            done[i], results[i] = True, finished.value

    try:
        for _ in range(delay):
            if not done[0]:
                step(0)
        while not all(done):
            for i in (0, 1):
                if not done[i]:
                    step(i)
    except BaseException:
        for gen in gens:
            gen.close()
        raise
    return results[0], results[1]

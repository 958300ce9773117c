"""Profiler ranges around the library's phases (``moe_sbo.<kind>``), free when the profiler is off,
and a mark of the dispatcher phase this process is in, for the error path.

The hard part is cost: a ``record_function`` takes microseconds of host time, too much for every
decode forward, so a range is opened only while the PyTorch profiler runs. ``measure/trace.py`` reads
these names back out of a trace.

The phase mark answers "where was this rank when its peer died or stalled?". Entering one of the
dispatcher's four calls (``DISPATCHER_PHASES``) writes two bytes: the phase, and "inside"; leaving it
normally clears "inside", leaving it by an exception does not (the failure happened in there). The
bytes live in a buffer a launcher may share with the rank (``record_phases_into``), so the launcher
can read the phase of a rank that is blocked or already dead; by default it is private to the
process. No allocation, no device work: three small stores per call.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

PREFIX = "moe_sbo."
# The dispatcher's public calls, as ``dispatch/base.py`` names them; each opens an ``annotate`` range.
DISPATCHER_PHASES = ("dispatch_launch", "dispatch_wait", "combine_launch", "combine_wait")

# [phase code (1 + index in DISPATCHER_PHASES; 0: none yet), 1 while inside it]
_slot: Any = bytearray(2)


class _PhaseMark:
    """The context manager of one dispatcher phase (one instance per phase, reused: no allocation)."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code

    def __enter__(self) -> None:
        _slot[0] = self.code
        _slot[1] = 1

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            _slot[1] = 0


class _ProfiledPhase:
    """A phase mark and a profiler range together (only while the profiler runs)."""

    def __init__(self, mark: _PhaseMark, prof_range: contextlib.AbstractContextManager) -> None:
        self.mark, self.prof_range = mark, prof_range

    def __enter__(self) -> None:
        self.mark.__enter__()
        self.prof_range.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.prof_range.__exit__(*exc)
        self.mark.__exit__(*exc)


_MARKS = {name: _PhaseMark(code) for code, name in enumerate(DISPATCHER_PHASES, start=1)}


def annotate(kind: str, phase: str | None = None) -> contextlib.AbstractContextManager:
    """A ``record_function("moe_sbo.<kind>")`` while the profiler runs; nothing otherwise. ``phase``
    (one of ``DISPATCHER_PHASES``, given by the dispatcher's four calls) is also marked for the
    error path."""
    mark = None if phase is None else _MARKS[phase]
    if torch._C._autograd._profiler_enabled():
        prof_range = torch.profiler.record_function(PREFIX + kind)
        return prof_range if mark is None else _ProfiledPhase(mark, prof_range)
    return contextlib.nullcontext() if mark is None else mark


def record_phases_into(slot: Any = None) -> None:
    """Write this process's phase marks into ``slot`` (two writable bytes, e.g. a launcher's shared
    memory), cleared first; ``None``: a private buffer again."""
    global _slot
    _slot = bytearray(2) if slot is None else slot
    clear_phase()


def clear_phase() -> None:
    """Forget the last phase (a rank starts each task with no phase)."""
    _slot[0] = _slot[1] = 0


def describe_phase(slot: Any) -> str:
    """``in dispatch_wait`` (inside that phase, or failed in it), ``after combine_wait`` (left it
    normally, nothing since), or ``""`` (no dispatcher phase yet) for a two-byte phase slot."""
    code, inside = slot[0], slot[1]
    if not 1 <= code <= len(DISPATCHER_PHASES):
        return ""
    return f"{'in' if inside else 'after'} {DISPATCHER_PHASES[code - 1]}"


def current_phase() -> str:
    """This process's dispatcher phase (``describe_phase`` of its own slot)."""
    return describe_phase(_slot)

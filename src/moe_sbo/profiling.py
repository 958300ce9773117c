"""Profiler ranges around the library's phases (``moe_sbo.<kind>``), free when the profiler is off.

The hard part is cost: a ``record_function`` takes microseconds of host time, too much for every
decode forward, so a range is opened only while the PyTorch profiler runs. ``measure/trace.py`` reads
these names back out of a trace.
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "moe_sbo."


def annotate(kind: str) -> contextlib.AbstractContextManager:
    """A ``record_function("moe_sbo.<kind>")`` while the profiler runs; nothing otherwise."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + kind)
    return contextlib.nullcontext()

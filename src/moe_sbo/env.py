"""Every environment variable the library reads, in one place.

The hard part is that ranks must agree: a variable that changes a collective's shape or a
transport's choice has to read the same on every rank, so each reader here documents who sets it
(the user, torchrun, or Triton's test mode) and what it may change.
"""

from __future__ import annotations

import os


def collective_timeout_s() -> float:
    """``MOE_SBO_TIMEOUT_S`` (default 60): seconds a rank waits inside one collective before it fails."""
    value = os.environ.get("MOE_SBO_TIMEOUT_S", "60")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"MOE_SBO_TIMEOUT_S must be a number of seconds > 0, got {value!r}")
    return seconds


def triton_interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels in its CPU interpreter (the CPU tests use it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def torchrun_rank() -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as torchrun sets them, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def local_world_size(default: int) -> int:
    """``LOCAL_WORLD_SIZE`` (torchrun: ranks on this node), or ``default`` when it is not set."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))

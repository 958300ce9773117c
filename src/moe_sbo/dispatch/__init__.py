"""Dispatchers, one per file, chosen by name: ``local``, ``allgather``, ``alltoall``."""

from . import allgather, alltoall, local  # noqa: F401  (registers each scheme)
from .base import (DISPATCHERS, CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Dispatcher,
                   EPGroup, Pending, Traffic, make_dispatcher)

__all__ = [
    "DISPATCHERS", "CombineInput", "DispatchHandle", "DispatchInput", "DispatchOutput", "Dispatcher",
    "EPGroup", "Pending", "Traffic", "make_dispatcher",
]

"""Dispatchers, one per file, chosen by name: ``local``, ``allgather``, ``alltoall``, ``low_latency``,
``node_aware``."""

from ..config import DISPATCHER_NAMES
from . import allgather, alltoall, local, low_latency, node_aware  # noqa: F401  (registers each scheme)
from .base import DISPATCHERS, Dispatcher, EPGroup, dispatcher_option_names, make_dispatcher, options_for_tokens
from .low_latency import LowLatencyDispatcher, mask_padding_tokens
from .records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending, Traffic

# The command line lists the names before torch is imported (``moe_sbo.config``): the two must agree.
assert sorted(DISPATCHERS) == sorted(DISPATCHER_NAMES), (
    f"moe_sbo.config.DISPATCHER_NAMES {sorted(DISPATCHER_NAMES)} must list the registered {sorted(DISPATCHERS)}"
)

__all__ = [
    "DISPATCHERS",
    "CombineInput",
    "DispatchHandle",
    "DispatchInput",
    "DispatchOutput",
    "Dispatcher",
    "EPGroup",
    "LowLatencyDispatcher",
    "Pending",
    "Traffic",
    "dispatcher_option_names",
    "make_dispatcher",
    "mask_padding_tokens",
    "options_for_tokens",
]

"""The ``deep_ep`` module vLLM imports when the plugin is on: ``moe_sbo.deep_ep`` with one change.

vLLM's DeepEP managers build ``deep_ep.Buffer(group=<the EP group's CPU (gloo) group>, ...)``: DeepEP
only exchanges IPC handles over it and moves the data through NVSHMEM. moe-sbo moves the data over
the group it is given, so this ``Buffer`` swaps vLLM's CPU group for the same ranks' device group
(NCCL on GPUs; gloo again on a CPU platform). Everything else is ``moe_sbo.deep_ep``'s.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed import get_ep_group

from ... import deep_ep
from ...deep_ep import Config, EventOverlap, topk_idx_t


def device_group_of(group: Any) -> Any:
    """vLLM's EP device group when ``group`` is its CPU group, else ``group`` itself."""
    try:
        ep = get_ep_group()
    except AssertionError:  # vLLM's EP group is not initialised (a caller's own group)
        return group
    return ep.device_group if group is ep.cpu_group else group


class Buffer(deep_ep.Buffer):
    """``moe_sbo.deep_ep.Buffer`` on the device group of the ranks vLLM names (see the module)."""

    def __init__(self, group: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(device_group_of(group), *args, **kwargs)


__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

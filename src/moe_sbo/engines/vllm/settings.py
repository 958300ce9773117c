"""The vLLM plugin's environment variables, read in one place.

Every rank of a vLLM job reads the same environment, so every rank makes the same choice:

===========================  ======================================================================
``MOE_SBO_VLLM``             ``1``: the plugin is on; unset or ``0``: the plugin does nothing
``MOE_SBO_VLLM_MODE``        ``native`` (default): ``deepep_high_throughput`` runs moe-sbo's own
                             prepare/finalize (``MoeSboPrepareAndFinalize``) and both DeepEP backends'
                             buffers are ``moe_sbo.deep_ep``'s; ``deep_ep``: vLLM's own DeepEP
                             classes for both backends, over ``moe_sbo.deep_ep``
``MOE_SBO_VLLM_DISPATCHER``  the moe-sbo dispatcher of the native prepare/finalize: ``alltoall``
                             (default), ``allgather``, ``node_aware``, ``low_latency``
``MOE_SBO_VLLM_OVERLAP``     where vLLM's shared experts run relative to the combine: ``combine``
                             (default: while it is in flight) or ``none`` (after it)
===========================  ======================================================================

The other SBO modes (``dispatch``, ``split``, ``combine_sm``) need the shared experts inside the
prepare/finalize; vLLM 0.33.0's modular kernel hands them over only between the combine's launch
and its wait, so under vLLM they are refused here (``MoeSboPrepareAndFinalize(shared=...)`` takes
them all when it holds the shared experts itself).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MODES = ("native", "deep_ep")
DISPATCHERS = ("alltoall", "allgather", "node_aware", "low_latency")
OVERLAPS = ("combine", "none")


@dataclass(frozen=True)
class PluginSettings:
    """What the environment asks of the plugin; ``enabled`` False means it does nothing."""

    enabled: bool = False
    mode: str = "native"
    dispatcher: str = "alltoall"
    overlap: str = "combine"


def read_settings(environ: Mapping[str, str] | None = None) -> PluginSettings:
    """The plugin's settings from ``environ`` (default: ``os.environ``); a bad value raises
    ``ValueError`` naming the variable and what it may be."""
    env = os.environ if environ is None else environ
    switch = env.get("MOE_SBO_VLLM", "0")
    if switch not in ("0", "1"):
        raise ValueError(f"MOE_SBO_VLLM must be 1 (plugin on) or 0 (off), got {switch!r}")
    settings = PluginSettings(
        enabled=switch == "1",
        mode=env.get("MOE_SBO_VLLM_MODE", "native"),
        dispatcher=env.get("MOE_SBO_VLLM_DISPATCHER", "alltoall"),
        overlap=env.get("MOE_SBO_VLLM_OVERLAP", "combine"),
    )
    for name, value, allowed in (
        ("MOE_SBO_VLLM_MODE", settings.mode, MODES),
        ("MOE_SBO_VLLM_DISPATCHER", settings.dispatcher, DISPATCHERS),
        ("MOE_SBO_VLLM_OVERLAP", settings.overlap, OVERLAPS),
    ):
        if value not in allowed:
            hint = ""
            if name == "MOE_SBO_VLLM_OVERLAP":
                hint = (
                    "; the SBO modes that run the shared experts during dispatch need them inside the "
                    "prepare/finalize, which vLLM's modular kernel does not hand over"
                )
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}{hint}")
    return settings

"""The ``vllm.general_plugins`` entry point: ``register()``, run by vLLM in every process it starts.

A no-op unless ``MOE_SBO_VLLM=1`` (``settings.py`` lists the variables). When on, in this order:

1. ``moe_sbo.engines.vllm.deep_ep_alias`` becomes the module ``deep_ep`` (vLLM's DeepEP managers and
   classes import it by that name), and vLLM's cached "is deep_ep installed" answer is dropped;
2. ``selection.install`` fills the DeepEP slots of vLLM's backend selection.

Run with ``--all2all-backend deepep_high_throughput`` (native: moe-sbo's prepare/finalize and
dispatcher) or ``deepep_low_latency`` (vLLM's DeepEP low-latency class over ``moe_sbo.deep_ep``).
The hard part is order: vLLM loads general plugins before it builds a model, so the alias is in place
before any DeepEP import; ``register`` may run more than once in a process and changes nothing the
second time.
"""

from __future__ import annotations

import logging
import sys

from .settings import read_settings

log = logging.getLogger("moe_sbo.engines.vllm")


def register() -> None:
    """Switch vLLM's DeepEP backends to moe-sbo when ``MOE_SBO_VLLM=1``; else do nothing."""
    settings = read_settings()
    if not settings.enabled:
        return
    from vllm.utils import import_utils

    from . import deep_ep_alias, selection

    sys.modules["deep_ep"] = deep_ep_alias
    import_utils._has_module.cache_clear()  # vLLM caches "is deep_ep importable" per process
    selection.install(settings)
    log.info(
        "moe-sbo vLLM plugin on: mode %s, dispatcher %s, overlap %s",
        settings.mode,
        settings.dispatcher,
        settings.overlap,
    )

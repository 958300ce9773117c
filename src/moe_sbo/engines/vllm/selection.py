"""Where vLLM's own backend selection finds the plugin: the DeepEP slots of ``all2all_utils``.

vLLM 0.33.0 selects a prepare/finalize in ``all2all_utils.maybe_make_prepare_finalize`` from a fixed
list (there is no registry to add to): for ``--all2all-backend deepep_high_throughput`` it builds
``DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=, dp_size=, rank_expert_offset=)`` with the
buffer its manager made, and reads ``DeepEPHTPrepareAndFinalize.maybe_roundup_layer_hidden_size``
to size the layer. Both names are looked up in the module when the function runs, so filling the
slot changes what vLLM's unmodified selection returns and nothing else:

- native mode: the high-throughput slot builds ``MoeSboPrepareAndFinalize`` on the buffer's group;
- otherwise the slots hold vLLM's own DeepEP classes, imported here (vLLM imports them only on CUDA
  platforms, and only when ``deep_ep`` imported at that moment), so they run on a CPU platform too.
"""

from __future__ import annotations

from typing import Any

import torch
import vllm.model_executor.layers.fused_moe.all2all_utils as all2all_utils
from vllm.config import get_current_vllm_config_or_none

from .prepare_finalize import DispatcherRecipe, MoeSboPrepareAndFinalize
from .settings import PluginSettings

HT_SLOT = "DeepEPHTPrepareAndFinalize"
LL_SLOT = "DeepEPLLPrepareAndFinalize"


class NativeHighThroughput:
    """What vLLM calls ``DeepEPHTPrepareAndFinalize`` in native mode: called as that class is, it
    returns a ``MoeSboPrepareAndFinalize`` with the dispatcher and overlap of ``settings``."""

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings

    @staticmethod
    def maybe_roundup_layer_hidden_size(hidden_size: int, dtype: torch.dtype) -> int:
        """moe-sbo moves rows of any width: the hidden size stays."""
        return hidden_size

    def __call__(
        self, buffer: Any, num_dispatchers: int, dp_size: int, rank_expert_offset: int
    ) -> MoeSboPrepareAndFinalize:
        max_tokens = None
        if self.settings.dispatcher == "low_latency":
            config = get_current_vllm_config_or_none()
            if config is None:
                raise ValueError(
                    "MOE_SBO_VLLM_DISPATCHER=low_latency sizes its buffers by vLLM's max_num_batched_tokens, "
                    "but no vLLM config is current; build the layer under vLLM's set_current_vllm_config"
                )
            max_tokens = config.scheduler_config.max_num_batched_tokens
        recipe = DispatcherRecipe(self.settings.dispatcher, buffer.group, max_tokens)
        return MoeSboPrepareAndFinalize(recipe, overlap=self.settings.overlap)


def install(settings: PluginSettings) -> None:
    """Fill the DeepEP slots of vLLM's ``all2all_utils`` as ``settings`` asks: the high-throughput
    slot with ``NativeHighThroughput`` (native mode) or vLLM's own class (``deep_ep`` mode), the
    low-latency slot with vLLM's own class. Idempotent; a later call with other settings replaces them."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_ht, deepep_ll

    setattr(
        all2all_utils,
        HT_SLOT,
        NativeHighThroughput(settings) if settings.mode == "native" else deepep_ht.DeepEPHTPrepareAndFinalize,
    )
    setattr(all2all_utils, LL_SLOT, deepep_ll.DeepEPLLPrepareAndFinalize)
    all2all_utils.DEEPEP_QUANT_BLOCK_SHAPE = deepep_ll.DEEPEP_QUANT_BLOCK_SHAPE

"""SGLang's ``deepep`` backend on ``moe_sbo.deep_ep.Buffer``.

SGLang 0.5.23 reads DeepEP through the module globals of ``sglang.srt.layers.moe.token_dispatcher.deepep``
(``Buffer``, ``Config``, and ``use_deepep``, False when ``import deep_ep`` failed) and keeps one buffer
per process in ``DeepEPBuffer``'s state. ``install`` points those globals at moe-sbo's API;
``get_deepep_buffer`` stands in for ``DeepEPBuffer.get_deepep_buffer``.

The hard part is what SGLang's own ``get_deepep_buffer`` does besides making the buffer: it sizes
NVSHMEM queues, counts the GPU's SMs and probes MNNVL fabric, all for DeepEP's kernels and all CUDA-only.
moe-sbo's ``Buffer`` allocates per shape and ignores those numbers, so the stand-in makes the buffer
with the mode alone, keeps SGLang's state fields (``DeepEPBuffer.clean_buffer`` reads them) and runs
on CPU ranks too.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from sglang.srt.layers.moe.token_dispatcher import deepep as sglang_deepep

import moe_sbo.deep_ep as moe_sbo_deep_ep


def install() -> None:
    """Make SGLang's DeepEP module use ``moe_sbo.deep_ep`` (also where the real ``deep_ep`` imported)."""
    sglang_deepep.Buffer = moe_sbo_deep_ep.Buffer
    sglang_deepep.Config = moe_sbo_deep_ep.Config
    sglang_deepep.use_deepep = True
    sglang_deepep._deepep_import_error = None


def get_deepep_buffer(
    original: Any,
    cls: Any,
    group: dist.ProcessGroup,
    hidden_size: int,
    param_bytes: int,
    deepep_mode: Any,
    num_max_dispatch_tokens_per_rank: int = -1,
    num_experts: int = -1,
) -> moe_sbo_deep_ep.Buffer:
    """``DeepEPBuffer.get_deepep_buffer`` (an SGLang ``HookType.AROUND`` hook; ``original`` unused):
    the process's ``moe_sbo.deep_ep.Buffer`` on ``group``, made at the first call.

    Sync: the first call builds the buffer's EP group view (no collective); later calls return it."""
    state = cls._state()
    if state.buffer is None:
        state.hidden_size = hidden_size
        state.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        state.num_experts = num_experts
        state.buffer = moe_sbo_deep_ep.Buffer(group, low_latency_mode=deepep_mode.enable_low_latency())
    return state.buffer


def process_buffer(
    group: dist.ProcessGroup,
    hidden_size: int,
    deepep_mode: Any,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
) -> moe_sbo_deep_ep.Buffer:
    """The buffer in SGLang's process-wide DeepEP slot (made there if empty): every MoE layer shares it,
    as they share DeepEP's."""
    return get_deepep_buffer(
        None,
        sglang_deepep.DeepEPBuffer,
        group,
        hidden_size,
        2,
        deepep_mode,
        num_max_dispatch_tokens_per_rank,
        num_experts,
    )

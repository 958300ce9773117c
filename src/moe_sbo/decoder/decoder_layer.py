"""A transformer decoder layer with an expert-parallel MoE: the unit two-batch overlap works on.

One forward::

    x [T, H] -> RMSNorm -> attention (KV cache) -> + x = h
             -> RMSNorm -> MoE (router, dispatch, experts, combine, + shared) -> + h

Like ``MoELayer``, the forward is a generator of stages (``stages``) that pauses while the MoE's
dispatch and combine are in flight, so ``overlap/tbo.py`` can run the attention of one micro-batch
inside the other's transfers. Weights are random from ``seed`` (identical on every rank).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from torch import nn

from ..dispatch import Dispatcher
from ..layer import MoELayer
from ..overlap.stages import run_to_end
from ..overlap.tbo import Split
from ..weights import seeded_normal
from .attention import Attention, AttentionConfig, Batch, KVCache
from .micro_batches import split_batch


class DecoderLayer(nn.Module):
    """RMSNorm -> attention -> residual -> RMSNorm -> ``moe`` -> residual, on ``[T, H]`` packed tokens."""

    def __init__(self, attn_cfg: AttentionConfig, moe: MoELayer, *, seed: int = 0):
        super().__init__()
        if attn_cfg.hidden_size != moe.cfg.hidden_size:
            raise ValueError(f"attention hidden size {attn_cfg.hidden_size} != MoE hidden size {moe.cfg.hidden_size}")
        device, dtype = moe.router.weight.device, moe.dtype
        self.attn_cfg = attn_cfg
        self.input_norm = nn.RMSNorm(attn_cfg.hidden_size, eps=attn_cfg.rms_norm_eps, device=device, dtype=dtype)
        self.attention = Attention(attn_cfg, dtype=dtype, device=device)
        self.post_attention_norm = nn.RMSNorm(
            attn_cfg.hidden_size, eps=attn_cfg.rms_norm_eps, device=device, dtype=dtype
        )
        self.moe = moe
        with torch.no_grad():
            h, nd = attn_cfg.hidden_size, attn_cfg.num_heads * attn_cfg.head_dim
            self.attention.qkv_proj.copy_(
                seeded_normal(tuple(self.attention.qkv_proj.shape), h**-0.5, seed, "qkv", 0, device)
            )
            self.attention.o_proj.copy_(seeded_normal((h, nd), nd**-0.5, seed, "o_proj", 0, device))

    def make_cache(self, num_slots: int, capacity: int) -> KVCache:
        """An empty KV cache for ``num_slots`` sequences of up to ``capacity`` tokens."""
        return KVCache(self.attn_cfg, num_slots, capacity, dtype=self.moe.dtype, device=self.moe.router.weight.device)

    def forward(self, x_TH: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        return run_to_end(self.stages(x_TH, batch, cache))

    def stages(
        self, x_TH: torch.Tensor, batch: Batch, cache: KVCache, dispatcher: Dispatcher | None = None
    ) -> Generator[None, None, torch.Tensor]:
        """The forward, pausing while the MoE's transfers are in flight; returns ``[T, H]``.
        ``dispatcher``: the MoE's (default) or, for two-batch overlap's micro-batch B, its twin."""
        self._check_batch(x_TH, batch, cache)
        h_TH = x_TH + self.attention(self.input_norm(x_TH), batch, cache) if x_TH.shape[0] else x_TH
        moe_TH = yield from self.moe.stages(self.post_attention_norm(h_TH), dispatcher)
        return h_TH + moe_TH

    def split_micro_batches(
        self, x_TH: torch.Tensor, batch: Batch, cache: KVCache, *, threshold: float, min_prefill_tokens: int
    ) -> Split:
        """``batch`` as two-batch overlap's two micro-batches (``micro_batches.split_batch``), after
        checking ``x_TH``, ``batch`` and ``cache`` as a forward does."""
        self._check_batch(x_TH, batch, cache)
        return split_batch(batch, threshold=threshold, min_prefill_tokens=min_prefill_tokens)

    def _check_batch(self, x_TH: torch.Tensor, batch: Batch, cache: KVCache) -> None:
        """Before the first collective: a bad batch must not leave other ranks waiting."""
        if x_TH.shape[0] != batch.num_tokens:
            raise ValueError(f"x has {x_TH.shape[0]} tokens but the batch describes {batch.num_tokens}")
        cache.check(batch)

"""Causal self-attention with a KV cache: packed variable-length prefill and one-token decode.

Legend: T tokens in the packed batch, H hidden, N query heads, G key/value heads (GQA: N % G == 0),
D head dim, S cache slots (one per sequence), C cache capacity in tokens per sequence.

A ``Batch`` says which tokens belong to which sequence: segment i is ``lengths[i]`` tokens of the
sequence in cache slot ``slots[i]``, at positions ``starts[i] ...``; the ``starts[i]`` tokens before
it are already in the cache. Prefill segments start at 0, except the second half of a sequence that
two-batch overlap cut in two, which attends to the first half through the cache. A decode batch is
one token for each of the consecutive slots ``slots[0] ... slots[0] + B - 1``.

The hard part is decode cost: a decode step reads every cached key and value of its sequences, so
the cache is attended in place (a view of consecutive slots, never a gathered copy), with a mask
that hides each sequence's unused tail; positions live on the device so a decode step is capturable.
Prefill runs each segment through ``scaled_dot_product_attention`` with ``is_causal`` (flash kernels
on the GPU); a segment with a cached prefix uses an explicit bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..profiling import annotate


@dataclass(frozen=True)
class AttentionConfig:
    """Shapes of the attention block (DeepSeek-V3 decode benchmark: 128 heads x 128 dims)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


@dataclass(frozen=True)
class Batch:
    """Which packed tokens belong to which sequence (host-side layout; see the module docstring).

    ``positions_T`` (device, int64) is each token's position in its sequence; for decode it is the
    only per-step data, so replays of a captured decode step just update it in place.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    positions_T: torch.Tensor
    decode: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @staticmethod
    def prefill(lengths: list[int], *, slots: list[int] | None = None, starts: list[int] | None = None,
                device: torch.device | str = "cpu") -> "Batch":
        """Packed prefill: sequence i has ``lengths[i]`` new tokens after ``starts[i]`` cached ones."""
        slots = list(range(len(lengths))) if slots is None else list(slots)
        starts = [0] * len(lengths) if starts is None else list(starts)
        if not len(slots) == len(starts) == len(lengths):
            raise ValueError(f"slots, starts and lengths must have one entry per segment, got {slots}, {starts}, {lengths}")
        if any(n < 1 for n in lengths) or any(s < 0 for s in starts):
            raise ValueError(f"segment lengths must be >= 1 and starts >= 0, got {lengths} and {starts}")
        positions = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
        positions_T = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        return Batch(tuple(slots), tuple(starts), tuple(lengths), positions_T.to(device))

    @staticmethod
    def decode_step(first_slot: int, positions_B: torch.Tensor) -> "Batch":
        """One new token for each of the slots ``first_slot ... first_slot + B - 1`` at ``positions_B``."""
        b = positions_B.shape[0]
        return Batch(tuple(range(first_slot, first_slot + b)), (0,) * b, (1,) * b, positions_B, decode=True)


class KVCache:
    """Keys and values of ``num_slots`` sequences, up to ``capacity`` tokens each: ``[S, G, C, D]``."""

    def __init__(self, cfg: AttentionConfig, num_slots: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (num_slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k_SGCD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_SGCD = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def check(self, batch: Batch) -> None:
        """Raise, naming the segment, if a batch would write outside the cache (before any write)."""
        num_slots = self.k_SGCD.shape[0]
        # A decode batch's slots are consecutive by construction: its two ends bound them all, so a
        # decode step of hundreds of sequences checks two numbers, not every segment.
        segments = zip(batch.slots[:1] + batch.slots[-1:], (0, 0), (1, 1)) if batch.decode else zip(
            batch.slots, batch.starts, batch.lengths)
        for slot, start, length in segments:
            if not 0 <= slot < num_slots:
                raise ValueError(f"cache slot {slot} is outside the {num_slots} slots of the KV cache")
            if not batch.decode and start + length > self.capacity:
                raise ValueError(f"sequence in slot {slot} needs {start + length} positions, the KV cache holds "
                                 f"{self.capacity}; make the cache larger")


class Attention(nn.Module):
    """Multi-head (GQA) causal attention with rotary positions: ``[T, H] -> [T, H]``."""

    def __init__(self, cfg: AttentionConfig, *, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Parameter(torch.empty(qkv_rows, cfg.hidden_size, dtype=dtype, device=device))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device))

    def forward(self, x_TH: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        n, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        with annotate("attention"):
            qkv = F.linear(x_TH, self.qkv_proj)
            q_TND = qkv[:, : n * d].view(-1, n, d)
            k_TGD = qkv[:, n * d: (n + g) * d].view(-1, g, d)
            v_TGD = qkv[:, (n + g) * d:].view(-1, g, d)
            q_TND, k_TGD = _rotate(q_TND, batch.positions_T, cfg.rope_theta), _rotate(k_TGD, batch.positions_T, cfg.rope_theta)
            if batch.decode:
                out_TND = _decode(q_TND, k_TGD, v_TGD, batch, cache)
            else:
                out_TND = _prefill(q_TND, k_TGD, v_TGD, batch, cache)
            return F.linear(out_TND.reshape(-1, n * d), self.o_proj)


def _rotate(x_TXD: torch.Tensor, positions_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention) at ``positions_T``, computed in float32."""
    d = x_TXD.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x_TXD.device, dtype=torch.float32) / d)
    angles_TF = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles_TF.cos()[:, None, :], angles_TF.sin()[:, None, :]
    x1, x2 = x_TXD.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_TXD.dtype)


def _prefill(q_TND, k_TGD, v_TGD, batch: Batch, cache: KVCache) -> torch.Tensor:
    out_TND = torch.empty_like(q_TND)
    gqa = q_TND.shape[1] != k_TGD.shape[1]
    offset = 0
    for slot, start, length in zip(batch.slots, batch.starts, batch.lengths):
        rows = slice(offset, offset + length)
        offset += length
        cache.k_SGCD[slot, :, start:start + length] = k_TGD[rows].transpose(0, 1)
        cache.v_SGCD[slot, :, start:start + length] = v_TGD[rows].transpose(0, 1)
        q_NLD = q_TND[rows].transpose(0, 1)
        if start == 0:
            k, v, mask, causal = k_TGD[rows].transpose(0, 1), v_TGD[rows].transpose(0, 1), None, True
        else:  # a cut sequence's second part: attend to the cached first part too (bottom-right causal)
            k, v = cache.k_SGCD[slot, :, :start + length], cache.v_SGCD[slot, :, :start + length]
            key_pos = torch.arange(start + length, device=q_TND.device)
            mask = key_pos[None, :] <= (start + torch.arange(length, device=q_TND.device))[:, None]
            causal = False
        out = F.scaled_dot_product_attention(q_NLD[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                             enable_gqa=gqa)
        out_TND[rows] = out[0].transpose(0, 1)
    return out_TND


def _decode(q_BND, k_BGD, v_BGD, batch: Batch, cache: KVCache) -> torch.Tensor:
    first, b = batch.slots[0] if batch.slots else 0, len(batch.slots)
    positions_B = batch.positions_T
    slots = torch.arange(first, first + b, device=q_BND.device)
    cache.k_SGCD[slots, :, positions_B] = k_BGD  # index_put: no host read of the positions
    cache.v_SGCD[slots, :, positions_B] = v_BGD
    k_BGCD, v_BGCD = cache.k_SGCD[first:first + b], cache.v_SGCD[first:first + b]  # views, no copy
    visible_BC = torch.arange(cache.capacity, device=q_BND.device)[None, :] <= positions_B[:, None]
    out = F.scaled_dot_product_attention(q_BND[:, :, None], k_BGCD, v_BGCD, attn_mask=visible_BC[:, None, None, :],
                                         enable_gqa=q_BND.shape[1] != k_BGD.shape[1])
    return out[:, :, 0]

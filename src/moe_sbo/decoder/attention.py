"""Causal self-attention with a KV cache: packed variable-length prefill and one-token decode.

Legend: see ``moe_sbo/__init__.py`` (here T is the tokens of the packed batch, and N % A == 0: GQA).

A ``Batch`` says which tokens belong to which sequence: segment i is ``lengths[i]`` tokens of the
sequence in cache slot ``slots[i]``, at positions ``starts[i] ...``; the ``starts[i]`` tokens before
it are already in the cache. Prefill segments start at 0, except the second half of a sequence that
two-batch overlap cut in two, which attends to the first half through the cache. A decode batch is
one token for each of the Z consecutive slots ``slots[0] ... slots[0] + Z - 1``.

The hard part is decode cost: a decode step reads every cached key and value of its sequences, so
the cache is attended in place (a view of consecutive slots, never a gathered copy), with a mask
that hides each sequence's unused tail; positions live on the device so a decode step is capturable.
Prefill runs each segment through ``scaled_dot_product_attention`` with ``is_causal`` (flash kernels
on the GPU). A segment with a cached prefix needs the causal mask aligned bottom-right (query i sees
keys up to ``start + i``). An explicit boolean mask makes a GPU kernel compute every query-key block,
so on CUDA such a segment runs causal kernels instead (``attend_after_prefix``); on CPU the explicit
mask is the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..profiling import annotate
from ..streams import compute_capability


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
    def prefill(
        lengths: list[int],
        *,
        slots: list[int] | None = None,
        starts: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> Batch:
        """Packed prefill: sequence i has ``lengths[i]`` new tokens after ``starts[i]`` cached ones."""
        slots = list(range(len(lengths))) if slots is None else list(slots)
        starts = [0] * len(lengths) if starts is None else list(starts)
        if not len(slots) == len(starts) == len(lengths):
            raise ValueError(
                f"slots, starts and lengths must have one entry per segment, got {slots}, {starts}, {lengths}"
            )
        if any(n < 1 for n in lengths) or any(s < 0 for s in starts):
            raise ValueError(f"segment lengths must be >= 1 and starts >= 0, got {lengths} and {starts}")
        positions = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
        positions_T = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        return Batch(tuple(slots), tuple(starts), tuple(lengths), positions_T.to(device))

    @staticmethod
    def decode_step(first_slot: int, positions_Z: torch.Tensor) -> Batch:
        """One new token for each of the Z slots ``first_slot ... first_slot + Z - 1`` at ``positions_Z``."""
        z = positions_Z.shape[0]
        return Batch(tuple(range(first_slot, first_slot + z)), (0,) * z, (1,) * z, positions_Z, decode=True)


class KVCache:
    """Keys and values of ``num_slots`` sequences, up to ``capacity`` tokens each: ``[Z, A, W, D]``."""

    def __init__(
        self, cfg: AttentionConfig, num_slots: int, capacity: int, *, dtype: torch.dtype, device: torch.device | str
    ):
        shape = (num_slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k_ZAWD = torch.zeros(shape, dtype=dtype, device=device)
        self.v_ZAWD = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def check(self, batch: Batch) -> None:
        """Raise, naming the segment, if a batch would write outside the cache (before any write)."""
        num_slots = self.k_ZAWD.shape[0]
        # A decode batch's slots are consecutive by construction: its two ends bound them all, so a
        # decode step of hundreds of sequences checks two numbers, not every segment.
        segments = (
            zip(batch.slots[:1] + batch.slots[-1:], (0, 0), (1, 1))
            if batch.decode
            else zip(batch.slots, batch.starts, batch.lengths)
        )
        for slot, start, length in segments:
            if not 0 <= slot < num_slots:
                raise ValueError(f"cache slot {slot} is outside the {num_slots} slots of the KV cache")
            if not batch.decode and start + length > self.capacity:
                raise ValueError(
                    f"sequence in slot {slot} needs {start + length} positions, the KV cache holds "
                    f"{self.capacity}; make the cache larger"
                )


class Attention(nn.Module):
    """Multi-head (GQA) causal attention with rotary positions: ``[T, H] -> [T, H]``."""

    def __init__(self, cfg: AttentionConfig, *, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Parameter(torch.empty(qkv_rows, cfg.hidden_size, dtype=dtype, device=device))
        self.o_proj = nn.Parameter(
            torch.empty(cfg.hidden_size, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
        )

    def forward(self, x_TH: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        n, a, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        with annotate("attention"):
            qkv = F.linear(x_TH, self.qkv_proj)
            q_TND = qkv[:, : n * d].view(-1, n, d)
            k_TAD = qkv[:, n * d : (n + a) * d].view(-1, a, d)
            v_TAD = qkv[:, (n + a) * d :].view(-1, a, d)
            q_TND, k_TAD = (
                _rotate(q_TND, batch.positions_T, cfg.rope_theta),
                _rotate(k_TAD, batch.positions_T, cfg.rope_theta),
            )
            if batch.decode:
                out_TND = _decode(q_TND, k_TAD, v_TAD, batch, cache)
            else:
                out_TND = _prefill(q_TND, k_TAD, v_TAD, batch, cache)
            return F.linear(out_TND.reshape(-1, n * d), self.o_proj)


def _rotate(x_TYD: torch.Tensor, positions_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention) at ``positions_T``, computed in float32 (Y: N or A heads)."""
    d = x_TYD.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x_TYD.device, dtype=torch.float32) / d)
    angles_TF = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles_TF.cos()[:, None, :], angles_TF.sin()[:, None, :]
    x1, x2 = x_TYD.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_TYD.dtype)


def _prefill(q_TND, k_TAD, v_TAD, batch: Batch, cache: KVCache) -> torch.Tensor:
    """Each segment attends on its own (Y: the tokens of one segment)."""
    out_TND = torch.empty_like(q_TND)
    gqa = q_TND.shape[1] != k_TAD.shape[1]
    mask: torch.Tensor | None
    offset = 0
    for slot, start, length in zip(batch.slots, batch.starts, batch.lengths):
        rows = slice(offset, offset + length)
        offset += length
        cache.k_ZAWD[slot, :, start : start + length] = k_TAD[rows].transpose(0, 1)
        cache.v_ZAWD[slot, :, start : start + length] = v_TAD[rows].transpose(0, 1)
        q_NYD = q_TND[rows].transpose(0, 1)
        if start == 0:
            k, v, mask, causal = k_TAD[rows].transpose(0, 1), v_TAD[rows].transpose(0, 1), None, True
        else:  # a cut sequence's second part: attend to the cached first part too (bottom-right causal)
            k, v = cache.k_ZAWD[slot, :, : start + length], cache.v_ZAWD[slot, :, : start + length]
            if q_TND.device.type == "cuda":
                out_TND[rows] = attend_after_prefix(q_NYD, k, v, start, gqa).transpose(0, 1)
                continue
            mask, causal = bottom_right_mask(start, length, q_TND.device), False
        out = F.scaled_dot_product_attention(
            q_NYD[None], k[None], v[None], attn_mask=mask, is_causal=causal, enable_gqa=gqa
        )
        out_TND[rows] = out[0].transpose(0, 1)
    return out_TND


CUT_ATTENTION_WAYS = ("auto", "merge", "padded", "lower_right")


def bottom_right_mask(start: int, length: int, device: torch.device | str) -> torch.Tensor:
    """The explicit causal mask of ``length`` queries after ``start`` cached tokens: ``[Y, start + Y]``
    boolean, True where query i may see key j (j <= start + i)."""
    return (
        torch.arange(start + length, device=device)[None, :] <= (start + torch.arange(length, device=device))[:, None]
    )


def attend_after_prefix(q_NYD, k_AWD, v_AWD, start: int, gqa: bool, way: str = "auto") -> torch.Tensor:
    """``Y`` queries at positions ``start ...`` over keys ``0 ... start + Y - 1``, causal aligned
    bottom-right (query i sees keys up to ``start + i``) -> ``[N, Y, D]``. What a cut sequence's
    second part runs on CUDA; every way gives the explicit mask's result.

    - ``merge``: the prefix keys (all visible: a rectangle) and the part's own keys (a causal square)
      as two attention calls that also return each row's log-sum-exp, merged by those (the split
      used by context-parallel attention): only the needed query-key pairs, at the causal kernel's
      rate (cuDNN's on CUDA, PyTorch's flash kernel for CPU), plus a second launch and the merge;
    - ``padded``: the queries padded in front with ``start`` zero rows through the whole sequence's
      ``is_causal`` kernel, the padding rows dropped: one launch, ``start^2 / 2`` wasted pairs;
    - ``lower_right``: ``torch.nn.attention.bias.causal_lower_right`` (PyTorch's FlashAttention-2 kernel
      on CUDA: the needed pairs, at about half cuDNN's rate on an H200);
    - ``auto``: ``merge``, the fastest of the three on an H200 at every cut measured (sequences of 2k
      to 16k tokens cut at 1/4, 1/2 and 3/4: docs/BENCHMARKS.md), on CPU and on
      CUDA GPUs of compute capability 9 with cuDNN's attention enabled and a head dim cuDNN takes
      (a multiple of 8, at most 128); ``lower_right`` elsewhere (PyTorch's own path for this mask).
      ``merge`` asked for explicitly calls cuDNN's kernel whatever the GPU."""
    if way not in CUT_ATTENTION_WAYS:
        raise ValueError(f"way must be one of {CUT_ATTENTION_WAYS}, got {way!r}")
    length = q_NYD.shape[1]
    if way == "auto":
        way = "merge" if _merge_measured(q_NYD.device, q_NYD.shape[-1]) else "lower_right"
    if way == "padded":
        padded_NWD = F.pad(q_NYD, (0, 0, start, 0))  # start zero rows in front: [N, start + Y, D]
        out = F.scaled_dot_product_attention(padded_NWD[None], k_AWD[None], v_AWD[None], is_causal=True, enable_gqa=gqa)
        return out[0, :, start:]
    if way == "lower_right":
        # Imported here: torch.nn.attention.bias pulls in torch._dynamo, seconds of every command's start.
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(length, start + length)
        return F.scaled_dot_product_attention(q_NYD[None], k_AWD[None], v_AWD[None], attn_mask=bias, enable_gqa=gqa)[0]
    prefix_NYD, prefix_lse_NY = _attention_with_lse(q_NYD, k_AWD[:, :start], v_AWD[:, :start], causal=False)
    own_NYD, own_lse_NY = _attention_with_lse(q_NYD, k_AWD[:, start:], v_AWD[:, start:], causal=True)
    # softmax over the union = each part's output weighted by its share of the total exp-sum
    prefix_share_NY1 = torch.sigmoid(prefix_lse_NY - own_lse_NY)[..., None].to(own_NYD.dtype)
    return torch.lerp(own_NYD, prefix_NYD, prefix_share_NY1)  # one pass; lerp computes in float32


def _merge_measured(device: torch.device, head_dim: int) -> bool:
    if device.type != "cuda":
        return True
    cudnn_takes = head_dim <= 128 and head_dim % 8 == 0
    return cudnn_takes and torch.backends.cuda.cudnn_sdp_enabled() and compute_capability(device)[0] == 9


def _attention_with_lse(q_NYD, k_AWD, v_AWD, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and each query row's log-sum-exp of its scaled scores (float32, ``[N, Y]``). The public
    ``scaled_dot_product_attention`` returns no log-sum-exp, so this calls the kernels behind it:
    cuDNN's on CUDA, the flash kernel for CPU on CPU (which takes no GQA: its key/value heads are
    repeated first)."""
    heads, length = q_NYD.shape[:2]
    if q_NYD.device.type == "cuda":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q_NYD[None], k_AWD[None], v_AWD[None], None, True, 0.0, causal, False
        )
        return out[0][0], out[1].reshape(heads, length)
    groups = heads // k_AWD.shape[0]
    k_NWD, v_NWD = k_AWD.repeat_interleave(groups, 0), v_AWD.repeat_interleave(groups, 0)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_NYD[None], k_NWD[None], v_NWD[None], 0.0, causal)
    return out[0][0], out[1].reshape(heads, length)


def _decode(q_ZND, k_ZAD, v_ZAD, batch: Batch, cache: KVCache) -> torch.Tensor:
    first, z = batch.slots[0] if batch.slots else 0, len(batch.slots)
    positions_Z = batch.positions_T
    slots = torch.arange(first, first + z, device=q_ZND.device)
    cache.k_ZAWD[slots, :, positions_Z] = k_ZAD  # index_put: no host read of the positions
    cache.v_ZAWD[slots, :, positions_Z] = v_ZAD
    k_ZAWD, v_ZAWD = cache.k_ZAWD[first : first + z], cache.v_ZAWD[first : first + z]  # views, no copy
    visible_ZW = torch.arange(cache.capacity, device=q_ZND.device)[None, :] <= positions_Z[:, None]
    out = F.scaled_dot_product_attention(
        q_ZND[:, :, None],
        k_ZAWD,
        v_ZAWD,
        attn_mask=visible_ZW[:, None, None, :],
        enable_gqa=q_ZND.shape[1] != k_ZAD.shape[1],
    )
    return out[:, :, 0]

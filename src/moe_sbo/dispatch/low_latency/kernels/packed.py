"""``pack_per_expert``: the receiver's expert rows moved into the packed per-expert layout
[L, N, H] (DeepEP's low-latency layout, DeepGEMM's "masked" one: expert l's j-th row at l * N + j),
and where each (slot, k) pair's row now lies (in place of where it lay), in one launch.

Legend: see ``moe_sbo/__init__.py``; here R = S * K expert rows (padding included, the same count as
the (slot, k) pairs) and N the rows of each expert in the packed layout.

The hard part is doing it with no host read and no second launch: every program takes the experts'
counts (a few hundred bytes) and derives from them the expert and in-expert position of its own row
(expert l holds rows [end_l - count_l, end_l) of the grouped order), so it needs nothing another
program computed. A row whose in-expert position reaches N (only a token that names one expert twice
can cause it) is not written; its program clears ``ok_1`` instead, which the caller asserts on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pack import pow2

BLOCK_BYTES = 2048  # bytes of a row each program copies (7 programs per DeepSeek-V3 bf16 row)


@triton.jit
def _packed_row(row, counts_L, ends_L, offs_l, rows_per_expert):
    """Packed index of grouped row ``row`` (``ends_L[-1]`` and past: none, returned as -1)."""
    expert = tl.sum((ends_L <= row).to(tl.int64))
    start = tl.sum(tl.where(offs_l == expert, ends_L - counts_L, 0))
    return tl.where(row < tl.sum(counts_L), expert * rows_per_expert + row - start, -1), row - start


@triton.jit
def _pack_per_expert_kernel(
    src_ptr,
    src_rows_ptr,
    src_scales_ptr,
    counts_ptr,
    pair_row_ptr,
    num_real_ptr,
    dst_ptr,
    dst_scales_ptr,
    count32_ptr,
    ok_ptr,
    num_local_experts,
    rows_per_expert,
    dump,
    src_stride,
    src_scales_stride,
    ROW: tl.constexpr,
    NUM_SCALES: tl.constexpr,
    L_P2: tl.constexpr,
    Q_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    INDEXED: tl.constexpr,
    SCALED: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs_l = tl.arange(0, L_P2)
    counts_L = tl.load(counts_ptr + offs_l, mask=offs_l < num_local_experts, other=0)
    ends_L = tl.cumsum(counts_L, axis=0)
    # The (slot, k) pair r: its grouped row becomes its packed row, in place (this program alone
    # reads and writes element r), ``dump`` for a pair with no local expert; with ``dump`` as the
    # real-row count, combine's kernel reads the outputs in the packed layout.
    pos, inside = _packed_row(tl.load(pair_row_ptr + r), counts_L, ends_L, offs_l, rows_per_expert)
    tl.store(pair_row_ptr + r, tl.where((pos >= 0) & (inside < rows_per_expert), pos, dump))
    if r == 0:
        tl.store(count32_ptr + offs_l, counts_L.to(tl.int32), mask=offs_l < num_local_experts)
        tl.store(num_real_ptr, dump)
    pos, inside = _packed_row(r, counts_L, ends_L, offs_l, rows_per_expert)
    if pos >= 0:
        if inside >= rows_per_expert:
            tl.store(ok_ptr, 0)
        else:
            src_row = tl.load(src_rows_ptr + r) if INDEXED else r
            for h0 in range(0, ROW, BLOCK):
                offs = h0 + tl.arange(0, BLOCK)
                values = tl.load(src_ptr + src_row * src_stride + offs, mask=offs < ROW)
                tl.store(dst_ptr + pos * ROW + offs, values, mask=offs < ROW)
            if SCALED:
                offs_q = tl.arange(0, Q_P2)
                scales = tl.load(src_scales_ptr + src_row * src_scales_stride + offs_q, mask=offs_q < NUM_SCALES)
                tl.store(dst_scales_ptr + pos * NUM_SCALES + offs_q, scales, mask=offs_q < NUM_SCALES)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as int32 words where they are whole words at word-aligned addresses, else bytes."""
    raw = t.view(torch.uint8)
    aligned = raw.shape[1] % 4 == 0 and raw.stride(0) % 4 == 0 and raw.data_ptr() % 4 == 0
    return raw.view(torch.int32) if aligned else raw


def pack_per_expert(
    src_MH: torch.Tensor,
    src_rows_R: torch.Tensor | None,
    src_scales_MQ: torch.Tensor | None,
    counts_L: torch.Tensor,
    pair_row_R: torch.Tensor,
    num_real_1: torch.Tensor,
    dst_NH: torch.Tensor,
    dst_scales_NQ: torch.Tensor | None,
    count32_L: torch.Tensor,
    ok_1: torch.Tensor,
    rows_per_expert: int,
) -> None:
    """Grouped expert row r (``src_MH[src_rows_R[r]]``, or ``src_MH[r]`` without an index; ``src_MH``
    and ``src_scales_MQ`` may be views whose rows are strided, each row's own values contiguous (the
    receive buffer's columns); the real ones are the
    first ``counts_L.sum()``) into row ``l * N + j`` of ``dst_NH`` (``[L * N + 1, H]``, N =
    ``rows_per_expert``: the last row is written by nothing), its scales likewise; ``count32_L``
    int32 copy of ``counts_L``.

    In place, so that the round's combine reads the experts' outputs in the packed layout:
    ``pair_row_R`` (int64, the grouped row of each (slot, k) pair) becomes each pair's packed row
    (L * N for a pair with no local expert) and ``num_real_1`` becomes L * N. ``ok_1`` (int32 [1],
    1 until now) becomes 0 when an expert got more than N rows (those are not written). Rows move
    as words or bytes, so e4m3 needs no fp8 kernel.

    Sync: one launch, no host read; CUDA-graph safe."""
    if not dst_NH.is_contiguous() or (dst_scales_NQ is not None and not dst_scales_NQ.is_contiguous()):
        raise ValueError("pack_per_expert writes whole rows: the packed rows and scales must be contiguous")
    src_words, dst_words = _words(src_MH), _words(dst_NH)
    if src_words.dtype != dst_words.dtype:
        src_words, dst_words = src_MH.view(torch.uint8), dst_NH.view(torch.uint8)
    row = src_words.shape[1]
    num_scales = 0 if src_scales_MQ is None else src_scales_MQ.shape[1]
    num_local = counts_L.shape[0]
    block = min(BLOCK_BYTES // src_words.element_size(), pow2(row))
    _pack_per_expert_kernel[(pair_row_R.shape[0],)](
        src_words,
        src_rows_R if src_rows_R is not None else pair_row_R,
        src_scales_MQ if src_scales_MQ is not None else counts_L,
        counts_L,
        pair_row_R,
        num_real_1,
        dst_words,
        dst_scales_NQ if dst_scales_NQ is not None else counts_L,
        count32_L,
        ok_1,
        num_local,
        rows_per_expert,
        num_local * rows_per_expert,
        src_words.stride(0),
        0 if src_scales_MQ is None else src_scales_MQ.stride(0),
        ROW=row,
        NUM_SCALES=num_scales,
        L_P2=pow2(max(num_local, 2)),
        Q_P2=pow2(max(num_scales, 2)),
        BLOCK=block,
        INDEXED=src_rows_R is not None,
        SCALED=src_scales_MQ is not None,
    )

"""Prefill-size variants of ``pack_rows`` and ``expert_layout``: two passes over the data, not one in
which every program counts every token.

Legend: see ``moe_sbo/__init__.py``; here X a chunk of (slot, k) pairs, Y = L + 1 sort keys, NB the
token blocks of the count pass, NX the pair chunks of the layout's count pass.

``ll_kernels.pack_rows`` gives each of C programs the count of earlier tokens going to each rank by
reading all T x K ids: T^2 K work, free at decode (T = 128) and milliseconds at prefill (T = 4096).
The same holds for ``ll_kernels.expert_layout`` over S x K pairs. Here each has a count pass (one
program per block of tokens or pairs writes that block's counts), a prefix sum over the blocks
(``torch.cumsum`` along the contiguous dimension, one launch) and a place pass that adds a block's
prefix to the ranks inside the block. Same output bytes and indices as the one-pass kernels (the
tests hold both to the torch reference), with work linear in T and S x K. The rows themselves are
then copied by one program per (token, slice of H), writing 16 bytes at a time.

The hard part is keeping it free of host reads: every count stays on the device, the block counts
are fixed by T, C and the chunk sizes, and the prefix sums are device tensors, so the whole phase
stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lanes import lanes
from ..quant.kernels import quantize_slice
from .layout import ExpertLayout
from .ll_kernels import Destinations, KernelLayout, block_h_for_row, pair_keys, pow2, store_fp8_slice
from .ll_wire import RowFormat

PACK_BLOCK_T = 128  # tokens per program of the send plan's passes
LAYOUT_BLOCK_X = 256  # (slot, k) pairs per program of the receiver layout's passes


# ---- dispatch: send plan, then rows ------------------------------------------------------------------


@triton.jit
def _load_ids(ids_ptr, t, num_tokens, TOP_K: tl.constexpr, K_P2: tl.constexpr):
    """[BLOCK_T, K_P2] expert ids of tokens t; -1 past the last token and past K."""
    offs_k = tl.arange(0, K_P2)
    return tl.load(
        ids_ptr + t[:, None].to(tl.int64) * TOP_K + offs_k[None, :],
        mask=(t[:, None] < num_tokens) & (offs_k[None, :] < TOP_K),
        other=-1,
    )


@triton.jit
def _sent_TP(ids_TK, num_local_experts, P_P2: tl.constexpr):
    """int32 [BLOCK_T, P_P2]: 1 where the token of row t has an expert on rank p."""
    offs_p = tl.arange(0, P_P2)
    owner_TK = tl.where(ids_TK >= 0, ids_TK // num_local_experts, -1)
    return tl.max((owner_TK[:, :, None] == offs_p[None, None, :]).to(tl.int32), axis=1)


@triton.jit
def _count_sends_kernel(
    ids_ptr,
    counts_ptr,
    ids_ok_ptr,
    num_tokens,
    num_local_experts,
    num_experts,
    stride_p,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    P_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # counts_ptr: int32 [P_P2, NB] with row stride stride_p, rank-major so the prefix sum runs along the
    # contiguous dimension.
    b = tl.program_id(0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_p = tl.arange(0, P_P2)
    ids_TK = _load_ids(ids_ptr, t, num_tokens, TOP_K, K_P2)
    sent_TP = _sent_TP(ids_TK, num_local_experts, P_P2)
    tl.store(counts_ptr + offs_p * stride_p + b, tl.sum(sent_TP, axis=0))
    bad_T = tl.max(((ids_TK < -1) | (ids_TK >= num_experts)).to(tl.int32), axis=1)
    tl.store(ids_ok_ptr + t, 1 - bad_T, mask=t < num_tokens)


@triton.jit
def _place_sends_kernel(
    ids_ptr,
    w_ptr,
    prefix_ptr,
    anchor_ptr,
    dst_ptr,
    slot_ptr,
    num_tokens,
    num_local_experts,
    num_ranks,
    capacity,
    num_blocks,
    TOP_K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IDS_OFFSET: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    K_P2: tl.constexpr,
    P_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # prefix_ptr: int32 [P_P2, NB + 1], inclusive prefix sums of the block counts after a zero column:
    # column b is what blocks before b send to each rank, column NB the rank's total.
    b = tl.program_id(0)
    t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, K_P2)
    offs_p = tl.arange(0, P_P2)
    num_slots = num_ranks * capacity
    block_b = tl.minimum(b, num_blocks)
    before_P = tl.load(prefix_ptr + offs_p * (num_blocks + 1) + block_b, mask=offs_p < num_ranks, other=0)
    total_P = tl.load(prefix_ptr + offs_p * (num_blocks + 1) + num_blocks, mask=offs_p < num_ranks, other=0)
    ids_TK = _load_ids(ids_ptr, t, num_tokens, TOP_K, K_P2)
    sent_TP = _sent_TP(ids_TK, num_local_experts, P_P2)
    row_TP = before_P[None, :] + tl.cumsum(sent_TP, axis=0) - 1
    slot_TP = tl.where(sent_TP > 0, offs_p[None, :] * capacity + row_TP, num_slots)
    is_token = t < num_tokens
    tl.store(
        slot_ptr + t[:, None].to(tl.int64) * num_ranks + offs_p[None, :],
        slot_TP.to(tl.int64),
        mask=is_token[:, None] & (offs_p[None, :] < num_ranks),
    )
    w_TK = tl.load(
        w_ptr + t[:, None].to(tl.int64) * TOP_K + offs_k[None, :],
        mask=is_token[:, None] & (offs_k[None, :] < TOP_K),
        other=0.0,
    )
    for p in range(0, num_ranks):
        is_p = offs_p == p
        block = anchor_ptr + tl.load(dst_ptr + p) * 16
        sent_T = tl.sum(tl.where(is_p[None, :], sent_TP, 0), axis=1) > 0
        row_T = tl.sum(tl.where(is_p[None, :], row_TP, 0), axis=1).to(tl.int64)
        meta_TK = block + row_T[:, None] * ROW_BYTES + offs_k[None, :] * 4
        mask_TK = (sent_T & is_token)[:, None] & (offs_k[None, :] < TOP_K)
        tl.store((meta_TK + IDS_OFFSET).to(tl.pointer_type(tl.int32)), ids_TK.to(tl.int32), mask=mask_TK)
        tl.store((meta_TK + WEIGHTS_OFFSET).to(tl.pointer_type(tl.float32)), w_TK.to(tl.float32), mask=mask_TK)
        # Rows of block p past its fill are padding: ids -1 (the receiver counts them nowhere).
        total = tl.sum(tl.where(is_p, total_P, 0))
        pad_TK = block + t[:, None].to(tl.int64) * ROW_BYTES + IDS_OFFSET + offs_k[None, :] * 4
        tl.store(
            pad_TK.to(tl.pointer_type(tl.int32)),
            tl.full([BLOCK_T, K_P2], -1, tl.int32),
            mask=((t >= total) & (t < capacity))[:, None] & (offs_k[None, :] < TOP_K),
        )


@triton.jit
def _copy_rows_kernel(
    x_ptr,
    slot_ptr,
    anchor_ptr,
    dst_ptr,
    num_ranks,
    capacity,
    HIDDEN: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    SCALES_OFFSET: tl.constexpr,
    FP8: tl.constexpr,
    P_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    offs_p = tl.arange(0, P_P2)
    slot_P = tl.load(
        slot_ptr + t.to(tl.int64) * num_ranks + offs_p, mask=offs_p < num_ranks, other=num_ranks * capacity
    )
    x_row = x_ptr + t.to(tl.int64) * HIDDEN
    if FP8:
        q_QV, scale_Q = quantize_slice(x_row, h0, HIDDEN, BLOCK_H)
    else:
        h = h0 + tl.arange(0, BLOCK_H)
        x_H = tl.load(x_row + h, mask=h < HIDDEN)
    for p in range(0, num_ranks):
        slot = tl.sum(tl.where(offs_p == p, slot_P, 0))
        if slot < num_ranks * capacity:
            dst_row = anchor_ptr + tl.load(dst_ptr + p) * 16 + (slot - p * capacity).to(tl.int64) * ROW_BYTES
            if FP8:
                store_fp8_slice(dst_row, h0, q_QV, scale_Q, HIDDEN, SCALES_OFFSET, BLOCK_H)
            else:
                tl.store(dst_row.to(x_ptr.dtype) + h, x_H, mask=h < HIDDEN)


def pack_rows(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    dst: Destinations,
    slot_TP: torch.Tensor,
    fmt: RowFormat,
    num_local_experts: int,
    capacity: int,
) -> torch.Tensor:
    """``ll_kernels.pack_rows`` in work linear in T: the same rows, ``slot_TP`` and ``ids_ok_C``."""
    device = x_TH.device
    num_tokens, top_k = ids_TK.shape
    num_ranks = dst.offsets_P.shape[0]
    p_p2, k_p2 = lanes(num_ranks), lanes(top_k)
    num_blocks = max(triton.cdiv(num_tokens, PACK_BLOCK_T), 1)
    ids_ok_C = torch.ones(capacity, dtype=torch.int32, device=device)
    counts_PB = torch.zeros(p_p2, num_blocks + 1, dtype=torch.int32, device=device)
    _count_sends_kernel[(num_blocks,)](
        ids_TK,
        counts_PB[:, 1:],
        ids_ok_C,
        num_tokens,
        num_local_experts,
        num_local_experts * num_ranks,
        num_blocks + 1,
        TOP_K=top_k,
        K_P2=k_p2,
        P_P2=p_p2,
        BLOCK_T=PACK_BLOCK_T,
    )
    prefix_PB = counts_PB.cumsum(dim=1, dtype=torch.int32)
    _place_sends_kernel[(triton.cdiv(capacity, PACK_BLOCK_T),)](
        ids_TK,
        weights_TK,
        prefix_PB,
        dst.anchor,
        dst.offsets_P,
        slot_TP,
        num_tokens,
        num_local_experts,
        num_ranks,
        capacity,
        num_blocks,
        TOP_K=top_k,
        ROW_BYTES=fmt.row_bytes,
        IDS_OFFSET=fmt.ids_offset,
        WEIGHTS_OFFSET=fmt.weights_offset,
        K_P2=k_p2,
        P_P2=p_p2,
        BLOCK_T=PACK_BLOCK_T,
    )
    if num_tokens:
        block_h = block_h_for_row(fmt.hidden, fmt.fp8)
        _copy_rows_kernel[(num_tokens, triton.cdiv(fmt.hidden, block_h))](
            x_TH,
            slot_TP,
            dst.anchor,
            dst.offsets_P,
            num_ranks,
            capacity,
            HIDDEN=fmt.hidden,
            ROW_BYTES=fmt.row_bytes,
            SCALES_OFFSET=fmt.scales_offset,
            FP8=fmt.fp8,
            P_P2=p_p2,
            BLOCK_H=block_h,
        )
    return ids_ok_C


# ---- dispatch: receiver layout -----------------------------------------------------------------------


@triton.jit
def _count_keys_kernel(
    recv_ptr,
    counts_ptr,
    first_expert,
    num_local_experts,
    num_pairs,
    stride_y,
    TOP_K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IDS_OFFSET: tl.constexpr,
    Y_P2: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    # counts_ptr: int32 [Y_P2, NX] with row stride stride_y, key-major (prefix sums along contiguous memory).
    x = tl.program_id(0)
    n = x * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_y = tl.arange(0, Y_P2)
    key = pair_keys(recv_ptr, n, num_pairs, first_expert, num_local_experts, TOP_K, ROW_BYTES, IDS_OFFSET, Y_P2)
    tl.store(counts_ptr + offs_y * stride_y + x, tl.sum((key[:, None] == offs_y[None, :]).to(tl.int32), axis=0))


@triton.jit
def _place_keys_kernel(
    recv_ptr,
    prefix_ptr,
    row_ptr,
    weight_ptr,
    pair_row_ptr,
    counts_ptr,
    num_real_ptr,
    first_expert,
    num_local_experts,
    num_slots,
    num_chunks,
    TOP_K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IDS_OFFSET: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    Y_P2: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    # prefix_ptr: int32 [Y_P2, NX + 1] as in _place_sends_kernel: column x is the pairs of each key in
    # chunks before x, column NX each key's total.
    x = tl.program_id(0)
    num_pairs = num_slots * TOP_K
    offs_y = tl.arange(0, Y_P2)
    before_Y = tl.load(prefix_ptr + offs_y * (num_chunks + 1) + x)
    counts_Y = tl.load(prefix_ptr + offs_y * (num_chunks + 1) + num_chunks)
    start_Y = tl.cumsum(counts_Y, axis=0) - counts_Y
    if x == 0:
        tl.store(counts_ptr + offs_y, counts_Y.to(tl.int64), mask=offs_y < num_local_experts)
        tl.store(num_real_ptr, tl.sum(tl.where(offs_y == num_local_experts, start_Y, 0)))
    # A pair's row: its key's start + that key's pairs before it (stable: slot order).
    n = x * BLOCK_X + tl.arange(0, BLOCK_X)
    key = pair_keys(recv_ptr, n, num_pairs, first_expert, num_local_experts, TOP_K, ROW_BYTES, IDS_OFFSET, Y_P2)
    hot_XY = (key[:, None] == offs_y[None, :]).to(tl.int32)
    row_X = tl.sum((tl.cumsum(hot_XY, axis=0) - 1 + (start_Y + before_Y)[None, :]) * hot_XY, axis=1)
    valid = n < num_pairs
    is_local = key < num_local_experts
    w_ptr = (recv_ptr + (n // TOP_K).to(tl.int64) * ROW_BYTES + WEIGHTS_OFFSET).to(tl.pointer_type(tl.float32))
    w_X = tl.load(w_ptr + n % TOP_K, mask=valid & is_local, other=0.0)
    tl.store(pair_row_ptr + n, row_X.to(tl.int64), mask=valid)
    tl.store(row_ptr + row_X, tl.where(is_local, n // TOP_K, num_slots).to(tl.int64), mask=valid)
    tl.store(weight_ptr + row_X, w_X, mask=valid)


def expert_layout(recv_SB: torch.Tensor, fmt: RowFormat, rank: int, num_local_experts: int) -> KernelLayout:
    """``ll_kernels.expert_layout`` in work linear in S x K: the same layout."""
    num_slots = recv_SB.shape[0]
    top_k = fmt.top_k
    device = recv_SB.device
    num_pairs = num_slots * top_k
    row_R = torch.empty(num_pairs, dtype=torch.int64, device=device)
    weight_R = torch.empty(num_pairs, dtype=torch.float32, device=device)
    pair_row_SK = torch.empty(num_slots, top_k, dtype=torch.int64, device=device)
    counts_L = torch.empty(num_local_experts, dtype=torch.int64, device=device)
    num_real_1 = torch.empty(1, dtype=torch.int32, device=device)
    y_p2 = pow2(num_local_experts + 1)
    num_chunks = max(triton.cdiv(num_pairs, LAYOUT_BLOCK_X), 1)
    counts_YX = torch.zeros(y_p2, num_chunks + 1, dtype=torch.int32, device=device)
    common = dict(TOP_K=top_k, ROW_BYTES=fmt.row_bytes, IDS_OFFSET=fmt.ids_offset, Y_P2=y_p2, BLOCK_X=LAYOUT_BLOCK_X)
    _count_keys_kernel[(num_chunks,)](
        recv_SB, counts_YX[:, 1:], rank * num_local_experts, num_local_experts, num_pairs, num_chunks + 1, **common
    )
    prefix_YX = counts_YX.cumsum(dim=1, dtype=torch.int32)
    _place_keys_kernel[(num_chunks,)](
        recv_SB,
        prefix_YX,
        row_R,
        weight_R,
        pair_row_SK,
        counts_L,
        num_real_1,
        rank * num_local_experts,
        num_local_experts,
        num_slots,
        num_chunks,
        WEIGHTS_OFFSET=fmt.weights_offset,
        **common,
    )
    return KernelLayout(
        ExpertLayout(row_R=row_R, weight_R=weight_R, num_rows_per_expert_L=counts_L), pair_row_SK, num_real_1
    )

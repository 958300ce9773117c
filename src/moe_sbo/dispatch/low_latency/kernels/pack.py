"""The send plan and the row copy of ``low_latency``'s dispatch: ``pack_rows`` writes every token's
packed row (``wire.RowFormat``) into the block of each rank it goes to, rank-deduplicated and in
token order, and fills ``slot_TP``; one kernel at decode sizes, two passes and a copy at prefill sizes.

Legend: see ``moe_sbo/__init__.py``; here NB the token blocks of the two-pass count pass.

The hard part is a token's row inside each block: the number of earlier tokens going to that rank.
One pass (``TWO_PASS_MIN_CAPACITY`` in ``kernels/__init__.py`` says when) gives each of C programs
that count by reading all T x K ids: T^2 K work, free at decode and slow at prefill sizes. Two passes
count per block of tokens, take a prefix sum over the blocks (``torch.cumsum`` along the contiguous
dimension, one launch), then place each block's tokens from its prefix: work linear in T, the same
bytes, ``slot_TP`` and id flags (the tests hold both to the torch reference). Every count stays on
the device and every grid is fixed by T and C, so both stay capturable in a CUDA graph.

Destinations are ``transport.Destinations``: 16-byte offsets from a tensor argument rather than raw
addresses, so Triton knows every row is 16-byte aligned and stores 16 bytes at a time (from a raw
address it must assume 2, which over NVLink is far slower).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....kernel_choice import lanes
from ....quant.fp8 import FP8_GROUP
from ....quant.kernels import GROUP_V, quantize_slice
from ..transport import Destinations
from ..wire import RowFormat

PACK_BLOCK_T = 128  # tokens per program of the two-pass send plan


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def block_h_for_row(hidden: int, fp8: bool) -> int:
    # 1024 values per step: 7 steps for DeepSeek-V3's 7168; fp8 steps whole 128-value groups.
    return min(1024, max(pow2(hidden), FP8_GROUP if fp8 else 16))


@triton.jit
def store_fp8_slice(
    dst_row, h0, q_QV, scale_Q, HIDDEN: tl.constexpr, SCALES_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr
):
    """``quant.kernels.quantize_slice``'s values and scales into their places in the packed row at ``dst_row``."""
    offs_q = tl.arange(0, BLOCK_H // GROUP_V)
    q_mask = h0 + offs_q * GROUP_V < HIDDEN
    h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
    tl.store(dst_row.to(tl.pointer_type(tl.float8e4nv)) + h_QV, q_QV, mask=q_mask[:, None])
    tl.store((dst_row + SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + h0 // GROUP_V + offs_q, scale_Q, mask=q_mask)


@triton.jit
def sent_to_ranks(ids_TK, num_local_experts, P_P2: tl.constexpr):
    """int32 [BLOCK_T, P_P2]: 1 where the token of row t has an expert on rank p."""
    offs_p = tl.arange(0, P_P2)
    owner_TK = tl.where(ids_TK >= 0, ids_TK // num_local_experts, -1)
    return tl.max((owner_TK[:, :, None] == offs_p[None, None, :]).to(tl.int32), axis=1)


# ---- one pass: every program counts every token ------------------------------------------------------


@triton.jit
def _pack_rows_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    anchor_ptr,
    dst_ptr,
    slot_ptr,
    ids_ok_ptr,
    num_tokens,
    num_local_experts,
    num_ranks,
    capacity,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    SCALES_OFFSET: tl.constexpr,
    IDS_OFFSET: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
    K_P2: tl.constexpr,
    P_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    c = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H  # this program's slice of the row; the first also writes the rest
    offs_k = tl.arange(0, K_P2)
    offs_p = tl.arange(0, P_P2)
    # Per rank: tokens before c that go there (token c's row in that block), all tokens that go
    # there (the block's fill), and whether token c goes there.
    before_P = tl.zeros([P_P2], dtype=tl.int32)
    total_P = tl.zeros([P_P2], dtype=tl.int32)
    mine_P = tl.zeros([P_P2], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ids_TK = tl.load(
            ids_ptr + t[:, None] * TOP_K + offs_k[None, :],
            mask=(t[:, None] < num_tokens) & (offs_k[None, :] < TOP_K),
            other=-1,
        )
        sent_TP = sent_to_ranks(ids_TK, num_local_experts, P_P2)
        total_P += tl.sum(sent_TP, axis=0)
        before_P += tl.sum(tl.where((t < c)[:, None], sent_TP, 0), axis=0)
        mine_P += tl.sum(tl.where((t == c)[:, None], sent_TP, 0), axis=0)

    num_slots = num_ranks * capacity
    if h0 == 0:
        # Token c's ids in [-1, E): the caller asserts on these flags (no host read, one kernel less
        # than checking the ids with torch ops).
        num_ids = tl.where(c < num_tokens, TOP_K, 0)  # a bound, not a scalar in the mask: one dtype
        ids_c = tl.load(ids_ptr + c * TOP_K + offs_k, mask=offs_k < num_ids, other=-1)
        bad = (ids_c < -1) | (ids_c >= num_local_experts * num_ranks)
        tl.store(ids_ok_ptr + c, 1 - tl.max(bad.to(tl.int32), axis=0))
        for p in range(0, num_ranks):
            is_p = offs_p == p
            row = tl.sum(tl.where(is_p, before_P, 0))
            sent = tl.sum(tl.where(is_p, mine_P, 0)) > 0
            block = anchor_ptr + tl.load(dst_ptr + p) * 16
            if c < num_tokens:
                tl.store(slot_ptr + c * num_ranks + p, tl.where(sent, p * capacity + row, num_slots).to(tl.int64))
                if sent:
                    dst_row = block + row.to(tl.int64) * ROW_BYTES
                    ids_K = tl.load(ids_ptr + c * TOP_K + offs_k, mask=offs_k < TOP_K)
                    w_K = tl.load(w_ptr + c * TOP_K + offs_k, mask=offs_k < TOP_K)
                    tl.store(
                        (dst_row + IDS_OFFSET).to(tl.pointer_type(tl.int32)) + offs_k,
                        ids_K.to(tl.int32),
                        mask=offs_k < TOP_K,
                    )
                    tl.store(
                        (dst_row + WEIGHTS_OFFSET).to(tl.pointer_type(tl.float32)) + offs_k,
                        w_K.to(tl.float32),
                        mask=offs_k < TOP_K,
                    )
            if c >= tl.sum(tl.where(is_p, total_P, 0)):
                pad_ids = (block + c.to(tl.int64) * ROW_BYTES + IDS_OFFSET).to(tl.pointer_type(tl.int32))
                tl.store(pad_ids + offs_k, tl.full([K_P2], -1, tl.int32), mask=offs_k < TOP_K)

    if c < num_tokens:
        x_row = x_ptr + c.to(tl.int64) * HIDDEN
        if FP8:
            q_QV, scale_Q = quantize_slice(x_row, h0, HIDDEN, BLOCK_H)
        else:
            h = h0 + tl.arange(0, BLOCK_H)
            x_H = tl.load(x_row + h, mask=h < HIDDEN)
        for p in range(0, num_ranks):
            is_p = offs_p == p
            if tl.sum(tl.where(is_p, mine_P, 0)) > 0:
                block = anchor_ptr + tl.load(dst_ptr + p) * 16
                dst_row = block + tl.sum(tl.where(is_p, before_P, 0)).to(tl.int64) * ROW_BYTES
                if FP8:
                    store_fp8_slice(dst_row, h0, q_QV, scale_Q, HIDDEN, SCALES_OFFSET, BLOCK_H)
                else:
                    tl.store(dst_row.to(x_ptr.dtype) + h, x_H, mask=h < HIDDEN)


# ---- two passes: count per token block, prefix sum, place --------------------------------------------


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
    sent_TP = sent_to_ranks(ids_TK, num_local_experts, P_P2)
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
    sent_TP = sent_to_ranks(ids_TK, num_local_experts, P_P2)
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
    two_pass: bool = False,
) -> torch.Tensor:
    """Write every token's packed row into the blocks of ``dst`` (rank-deduplicated, token order)
    and fill ``slot_TP`` [T, P] (slot ``p * C + row``, or S where the token sends nothing to p).
    ``two_pass``: the prefill-size kernels (work linear in T), else the one-pass decode kernel.

    Returns ``ids_ok_C`` int32 [C]: 0 where token c has an id outside [-1, E) (1 elsewhere); such a
    token's rows go nowhere, so the caller must fail on it (``pack_rows_checked``)."""
    pack = _pack_two_pass if two_pass else _pack_one_pass
    return pack(x_TH, ids_TK, weights_TK, dst, slot_TP, fmt, num_local_experts, capacity)


def pack_rows_checked(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    dst: Destinations,
    slot_TP: torch.Tensor,
    fmt: RowFormat,
    num_local_experts: int,
    capacity: int,
    num_experts: int,
    two_pass: bool,
) -> None:
    """``pack_rows``, then a device-side assert that every id was in range (CUDA)."""
    ids_ok_C = pack_rows(x_TH, ids_TK, weights_TK, dst, slot_TP, fmt, num_local_experts, capacity, two_pass)
    if x_TH.device.type == "cuda":
        torch._assert_async(ids_ok_C.amin(), f"topk_ids must lie in [-1, {num_experts})")


def _pack_one_pass(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    dst: Destinations,
    slot_TP: torch.Tensor,
    fmt: RowFormat,
    num_local_experts: int,
    capacity: int,
) -> torch.Tensor:
    """``pack_rows`` in one kernel: each of C programs counts every token (decode sizes)."""
    ids_ok_C = torch.empty(capacity, dtype=torch.int32, device=x_TH.device)
    num_tokens, top_k = ids_TK.shape
    num_ranks = dst.offsets_P.shape[0]
    block_h = block_h_for_row(fmt.hidden, fmt.fp8)
    _pack_rows_kernel[(capacity, triton.cdiv(fmt.hidden, block_h))](
        x_TH,
        ids_TK,
        weights_TK,
        dst.anchor,
        dst.offsets_P,
        slot_TP,
        ids_ok_C,
        num_tokens,
        num_local_experts,
        num_ranks,
        capacity,
        HIDDEN=fmt.hidden,
        TOP_K=top_k,
        ROW_BYTES=fmt.row_bytes,
        SCALES_OFFSET=fmt.scales_offset,
        IDS_OFFSET=fmt.ids_offset,
        WEIGHTS_OFFSET=fmt.weights_offset,
        FP8=fmt.fp8,
        BLOCK_T=max(16, min(128, pow2(num_tokens))),
        K_P2=lanes(top_k),
        P_P2=lanes(num_ranks),
        BLOCK_H=block_h,
    )
    return ids_ok_C


def _pack_two_pass(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    dst: Destinations,
    slot_TP: torch.Tensor,
    fmt: RowFormat,
    num_local_experts: int,
    capacity: int,
) -> torch.Tensor:
    """``pack_rows`` in two passes and a copy: work linear in T."""
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

"""The receiver's side of ``low_latency``'s dispatch: ``expert_layout`` sorts the S x K received
(slot, k) pairs by local expert on the device, and ``gather_rows`` copies the real rows into that
order (dequantising fp8, or keeping e4m3 for FP8 experts).

Legend: see ``moe_sbo/__init__.py``; here R = S * K expert rows (padding included), X a chunk of the
(slot, k) pairs, Y the L + 1 sort keys (each local expert, then "not local"), NX the pair chunks of
the two-pass count pass.

The hard part is a stable counting sort with no host read: a pair's row is its expert's start plus
the pairs of that expert before it, and both need counts over every pair. One pass has each program
count all S x K pairs (quadratic, fewer launches: decode sizes); two passes count per chunk, take a
prefix sum over the chunks and then place (linear: prefill sizes). One kernel places the pairs for
both (``_place_pairs_kernel``: its counts from its own scan, or from the count pass's prefix sums),
so the tail that writes the layout exists once; the torch reference
(``reference.group_slots_by_expert``) gives the same indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ....quant.fp8 import FP8_DTYPE, FP8_GROUP
from ....quant.kernels import GROUP_V
from ...layout import ExpertLayout
from ..addresses import CallerAddresses
from ..wire import RowFormat
from .pack import block_h_for_row, pow2

LAYOUT_BLOCK_X = 128  # (slot, k) pairs per program of the one-pass layout
TWO_PASS_BLOCK_X = 256  # (slot, k) pairs per program of the two-pass layout


@dataclass(frozen=True)
class KernelLayout:
    """The receiver's layout as ``expert_layout`` leaves it: ``layout`` (as the torch path's),
    ``pair_row_SK`` int64 expert row of each (slot, k) pair (rows >= the real count belong to pairs
    with no local expert), ``num_real_1`` int32 [1] the number of real expert rows, on the device."""

    layout: ExpertLayout
    pair_row_SK: torch.Tensor
    num_real_1: torch.Tensor


@triton.jit
def pair_keys(
    recv_ptr,
    n,
    num_pairs,
    first_expert,
    num_local_experts,
    TOP_K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IDS_OFFSET: tl.constexpr,
    Y_P2: tl.constexpr,
):
    """Local expert of pairs ``n`` (L for another rank's expert or "no expert"; Y_P2, counted
    nowhere, past the last pair)."""
    slot = n // TOP_K
    ids_ptr = (recv_ptr + slot.to(tl.int64) * ROW_BYTES + IDS_OFFSET).to(tl.pointer_type(tl.int32))
    ids = tl.load(ids_ptr + n % TOP_K, mask=n < num_pairs, other=-1)
    local = ids - first_expert
    key = tl.where((ids >= 0) & (local >= 0) & (local < num_local_experts), local, num_local_experts)
    return tl.where(n < num_pairs, key, Y_P2)


@triton.jit
def _place_pairs_kernel(
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
    SCAN_X: tl.constexpr,
    COUNTED: tl.constexpr,
):
    # Program x places pairs [x * BLOCK_X, (x + 1) * BLOCK_X): it needs every key's count (the
    # experts' starts) and each key's pairs before its chunk (its offset inside each expert).
    x = tl.program_id(0)
    chunk_start = x * BLOCK_X
    num_pairs = num_slots * TOP_K
    offs_y = tl.arange(0, Y_P2)
    if COUNTED:
        # Two passes: prefix_ptr is int32 [Y_P2, NX + 1] as in ``pack._place_sends_kernel``: column x
        # the pairs of each key in chunks before x, column NX each key's total.
        before_Y = tl.load(prefix_ptr + offs_y * (num_chunks + 1) + x)
        counts_Y = tl.load(prefix_ptr + offs_y * (num_chunks + 1) + num_chunks)
    else:
        # One pass: every program counts all pairs itself. The keys are a few KB, read from L2 by every
        # program, which beats a serial scan in one program.
        counts_Y = tl.zeros([Y_P2], dtype=tl.int32)
        before_Y = tl.zeros([Y_P2], dtype=tl.int32)
        for n0 in range(0, num_pairs, SCAN_X):
            n = n0 + tl.arange(0, SCAN_X)
            key = pair_keys(recv_ptr, n, num_pairs, first_expert, num_local_experts, TOP_K, ROW_BYTES, IDS_OFFSET, Y_P2)
            hot_XY = (key[:, None] == offs_y[None, :]).to(tl.int32)
            counts_Y += tl.sum(hot_XY, axis=0)
            before_Y += tl.sum(tl.where((n < chunk_start)[:, None], hot_XY, 0), axis=0)
    # The shared tail: a pair's row is its expert's start + the pairs of that expert before it
    # (stable: slot order); the first chunk also writes the per-expert counts and the real row count.
    start_Y = tl.cumsum(counts_Y, axis=0) - counts_Y
    if chunk_start == 0:
        tl.store(counts_ptr + offs_y, counts_Y.to(tl.int64), mask=offs_y < num_local_experts)
        tl.store(num_real_ptr, tl.sum(tl.where(offs_y == num_local_experts, start_Y, 0)))
    n = chunk_start + tl.arange(0, BLOCK_X)
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


# ---- two passes: the count pass before ``_place_pairs_kernel`` -----------------------------------------


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


def expert_layout(
    recv_SB: torch.Tensor, fmt: RowFormat, rank: int, num_local_experts: int, two_pass: bool = False
) -> KernelLayout:
    """The expert-major layout of the S x K pairs in the received rows ``recv_SB`` (uint8 [S, B]).
    ``two_pass``: the prefill-size kernels (work linear in S x K), else the one-pass decode kernel."""
    num_slots = recv_SB.shape[0]
    top_k = fmt.top_k
    device = recv_SB.device
    num_pairs = num_slots * top_k
    row_R = torch.empty(num_pairs, dtype=torch.int64, device=device)
    weight_R = torch.empty(num_pairs, dtype=torch.float32, device=device)
    pair_row_SK = torch.empty(num_slots, top_k, dtype=torch.int64, device=device)
    counts_L = torch.empty(num_local_experts, dtype=torch.int64, device=device)
    num_real_1 = torch.empty(1, dtype=torch.int32, device=device)
    fixed = KernelLayout(
        ExpertLayout(row_R=row_R, weight_R=weight_R, num_rows_per_expert_L=counts_L), pair_row_SK, num_real_1
    )
    y_p2 = pow2(num_local_experts + 1)
    first_expert = rank * num_local_experts
    if two_pass:
        block_x, scan_x = TWO_PASS_BLOCK_X, 16  # scan_x: unused with COUNTED
        num_chunks = max(triton.cdiv(num_pairs, block_x), 1)
        counts_YX = torch.zeros(y_p2, num_chunks + 1, dtype=torch.int32, device=device)
        _count_keys_kernel[(num_chunks,)](
            recv_SB,
            counts_YX[:, 1:],
            first_expert,
            num_local_experts,
            num_pairs,
            num_chunks + 1,
            TOP_K=top_k,
            ROW_BYTES=fmt.row_bytes,
            IDS_OFFSET=fmt.ids_offset,
            Y_P2=y_p2,
            BLOCK_X=block_x,
        )
        prefix_YX = counts_YX.cumsum(dim=1, dtype=torch.int32)
    else:
        block_x, scan_x = LAYOUT_BLOCK_X, max(16, min(1024, 8192 // y_p2))
        num_chunks = triton.cdiv(num_pairs, block_x)
        prefix_YX = counts_L  # unused without COUNTED: any int tensor
    _place_pairs_kernel[(num_chunks,)](
        recv_SB,
        prefix_YX,
        row_R,
        weight_R,
        pair_row_SK,
        counts_L,
        num_real_1,
        first_expert,
        num_local_experts,
        num_slots,
        num_chunks,
        TOP_K=top_k,
        ROW_BYTES=fmt.row_bytes,
        IDS_OFFSET=fmt.ids_offset,
        WEIGHTS_OFFSET=fmt.weights_offset,
        Y_P2=y_p2,
        BLOCK_X=block_x,
        SCAN_X=scan_x,
        COUNTED=two_pass,
    )
    return fixed


# ---- the rows in expert order ------------------------------------------------------------------------


@triton.jit
def _gather_rows_kernel(
    recv_ptr,
    row_ptr,
    num_real_ptr,
    out_ptr,
    scales_ptr,
    anchor_ptr,
    table_ptr,
    HIDDEN: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    SCALES_OFFSET: tl.constexpr,
    FP8: tl.constexpr,
    KEEP_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADDRESSED: tl.constexpr,
):
    i = tl.program_id(0)
    if ADDRESSED:  # a replayed graph: the outputs' addresses from the table (out_ptr, scales_ptr: dtypes)
        out_ptr = (anchor_ptr + tl.load(table_ptr) * 16).to(out_ptr.dtype)
        scales_ptr = (anchor_ptr + tl.load(table_ptr + 1) * 16).to(scales_ptr.dtype)
    if i < tl.load(num_real_ptr):
        src_row = recv_ptr + tl.load(row_ptr + i) * ROW_BYTES
        out_row = out_ptr + i.to(tl.int64) * HIDDEN
        for h0 in range(0, HIDDEN, BLOCK_H):
            if KEEP_FP8:  # e4m3 bytes and their scales as they arrived, for FP8 experts
                offs_q = tl.arange(0, BLOCK_H // GROUP_V)
                q_mask = h0 + offs_q * GROUP_V < HIDDEN
                h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
                q_QV = tl.load(src_row.to(tl.pointer_type(tl.float8e4nv)) + h_QV, mask=q_mask[:, None])
                tl.store(out_row + h_QV, q_QV, mask=q_mask[:, None])
                scale_Q = tl.load(
                    (src_row + SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + h0 // GROUP_V + offs_q, mask=q_mask
                )
                tl.store(
                    scales_ptr + i.to(tl.int64) * (HIDDEN // GROUP_V) + h0 // GROUP_V + offs_q, scale_Q, mask=q_mask
                )
            elif FP8:
                offs_q = tl.arange(0, BLOCK_H // GROUP_V)
                q_mask = h0 + offs_q * GROUP_V < HIDDEN
                h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
                q_QV = tl.load(src_row.to(tl.pointer_type(tl.float8e4nv)) + h_QV, mask=q_mask[:, None], other=0.0)
                scale_Q = tl.load(
                    (src_row + SCALES_OFFSET).to(tl.pointer_type(tl.float32)) + h0 // GROUP_V + offs_q,
                    mask=q_mask,
                    other=0.0,
                )
                x_QV = q_QV.to(tl.float32) * scale_Q[:, None]
                tl.store(out_row + h_QV, x_QV.to(out_ptr.dtype.element_ty), mask=q_mask[:, None])
            else:
                h = h0 + tl.arange(0, BLOCK_H)
                tl.store(out_row + h, tl.load(src_row.to(out_ptr.dtype) + h, mask=h < HIDDEN), mask=h < HIDDEN)


def expert_rows(num_rows: int, fmt: RowFormat, keep_fp8: bool, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Uninitialised outputs of ``gather_rows``: ``[R, H]`` rows in the activation dtype, or e4m3 rows
    and their float32 ``[R, H/128]`` scales (``keep_fp8`` and fp8 rows)."""
    keep_fp8 = keep_fp8 and fmt.fp8
    out_RH = torch.empty(num_rows, fmt.hidden, dtype=FP8_DTYPE if keep_fp8 else fmt.dtype, device=device)
    scales_RQ = torch.empty(num_rows, fmt.hidden // FP8_GROUP, device=device) if keep_fp8 else None
    return out_RH, scales_RQ


def gather_rows(
    recv_SB: torch.Tensor,
    fixed: KernelLayout,
    fmt: RowFormat,
    keep_fp8: bool = False,
    addresses: CallerAddresses | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[R, H]`` expert inputs in expert order, and None; or, with ``keep_fp8`` and fp8 rows, the
    e4m3 ``[R, H]`` values and their float32 ``[R, H/128]`` scales. Rows past the real count are
    left unwritten.

    ``addresses`` (inside a graph): write instead into the rows and scales whose addresses the
    table holds (``expert_rows``' outputs, made per forward); the tensors returned then only stand
    for their dtypes."""
    num_rows = fixed.layout.row_R.shape[0]
    keep_fp8 = keep_fp8 and fmt.fp8
    if addresses is None:
        out_RH, scales_RQ = expert_rows(num_rows, fmt, keep_fp8, recv_SB.device)
    else:  # dtype witnesses: one element each
        out_RH, scales_RQ = expert_rows(1, fmt, keep_fp8, recv_SB.device)
    _gather_rows_kernel[(num_rows,)](
        recv_SB,
        fixed.layout.row_R,
        fixed.num_real_1,
        out_RH,
        out_RH if scales_RQ is None else scales_RQ,
        recv_SB if addresses is None else addresses.anchor,
        recv_SB if addresses is None else addresses.table,
        HIDDEN=fmt.hidden,
        ROW_BYTES=fmt.row_bytes,
        SCALES_OFFSET=fmt.scales_offset,
        FP8=fmt.fp8,
        KEEP_FP8=keep_fp8,
        BLOCK_H=block_h_for_row(fmt.hidden, fmt.fp8),
        ADDRESSED=addresses is not None,
    )
    return out_RH, scales_RQ

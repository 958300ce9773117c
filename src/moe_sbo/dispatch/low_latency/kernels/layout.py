"""Fused Triton kernels of the ``low_latency`` dispatcher: five kernels per forward, not ~35 torch ops
(plus the two small ones of the id assert); four live here, the last (``gather_sum``) in ``reduce.py``,
which the other dispatchers share.

Legend: see ``moe_sbo/__init__.py``; here R = S * K expert rows (padding included), and in
``expert_layout`` X is a chunk of the S * K (slot, k) pairs and Y the L + 1 sort keys (each local
expert, then "not local"). The wire format is ``ll_wire.py``'s. Each kernel replaces a chain of small
torch ops of the reference path there, and produces the same bytes and indices::

    dispatch  pack_rows      grid C x H/1024: program (c, j) counts, from all T x K ids, the
                             earlier tokens going to each rank (token c's row in that block) and
                             writes slice j of token c's packed row (x, or fp8 x and its scales)
                             into every block it goes to; j = 0 also writes the ids and weights,
                             flags ids out of range, and marks row c of every block holding <= c
                             tokens as padding (ids -1).
              [transport]    NCCL all_to_all_single of the blocks, or nothing: with symmetric
                             memory the blocks were written straight into the peers' buffers.
              expert_layout  grid S x K/128: stable counting sort of the S x K received (slot, k)
                             pairs by local expert (real pairs first), per-expert counts, on the
                             device.
              gather_rows    grid R: copies (dequantises, or keeps e4m3 for FP8 experts) real
                             expert row i; rows past the real count return at once, so the
                             padding tail costs a launch, not a copy.
    combine   reduce_pairs   grid S x H/1024: each slot's weighted sum over its local experts'
                             outputs, written into its destination block (a slot with no local
                             pair returns at once: its sender never reads it).
              gather_sum     (``reduce.py``, shared with the other dispatchers) grid T x H/1024:
                             each token's P returned rows, summed in float32.

Destinations are ``Destinations``: where row 0 of the block for rank p lies, so one kernel serves
every transport: the local send buffer's blocks (NCCL), the receive buffer itself (one rank, no
collective), or the peers' symmetric receive buffers (NVLink writes). They are 16-byte offsets from
a tensor argument rather than raw addresses: Triton then knows every row is 16-byte aligned and
stores 16 bytes at a time (from a raw address it must assume 2, which over NVLink is ~10x slower).

The kernels run under ``TRITON_INTERPRET=1`` on CPU tensors too; the tests use that to hold them to
the torch reference without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..lanes import lanes
from ..quant.fp8 import FP8_DTYPE, FP8_GROUP, FP8_MAX
from ..quant.kernels import quantize_slice
from .layout import ExpertLayout
from .ll_addresses import CallerAddresses
from .ll_wire import RowFormat
from .reduce import block_h_for, launch_gather_sum

# The wire format's constants, as compile-time constants of the kernels.
GROUP_V = tl.constexpr(FP8_GROUP)
E4M3_MAX = tl.constexpr(FP8_MAX)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def block_h_for_row(hidden: int, fp8: bool) -> int:
    # 1024 values per step: 7 steps for DeepSeek-V3's 7168; fp8 steps whole 128-value groups.
    return min(1024, max(pow2(hidden), FP8_GROUP if fp8 else 16))


@dataclass(frozen=True)
class Destinations:
    """P block addresses as ``anchor`` (a uint8 tensor, 16-byte aligned) plus ``offsets_P`` (int64,
    device) in 16-byte units; all addresses must be 16-byte aligned."""

    anchor: torch.Tensor
    offsets_P: torch.Tensor

    @classmethod
    def make(cls, anchor: torch.Tensor, addresses: list[int]) -> Destinations:
        base = anchor.data_ptr()
        if base % 16 or any(a % 16 for a in addresses):
            raise ValueError(
                f"block addresses must be 16-byte aligned, got {[hex(a) for a in [base, *addresses]]}; "
                "rows are padded to 16 bytes, so check the hidden size and dtype"
            )
        offsets = [(a - base) // 16 for a in addresses]
        return cls(anchor.view(torch.uint8), torch.tensor(offsets, dtype=torch.int64, device=anchor.device))


@dataclass(frozen=True)
class KernelLayout:
    """The receiver's layout as ``expert_layout`` leaves it: ``layout`` (as the torch path's),
    ``pair_row_SK`` int64 expert row of each (slot, k) pair (rows >= the real count belong to pairs
    with no local expert), ``num_real_1`` int32 [1] the number of real expert rows, on the device."""

    layout: ExpertLayout
    pair_row_SK: torch.Tensor
    num_real_1: torch.Tensor


# ---- dispatch: pack ----------------------------------------------------------------------------------


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
        owner_TK = tl.where(ids_TK >= 0, ids_TK // num_local_experts, -1)
        sent_TP = tl.max((owner_TK[:, :, None] == offs_p[None, None, :]).to(tl.int32), axis=1)
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
    """Write every token's packed row into the blocks of ``dst`` (rank-deduplicated, token order)
    and fill ``slot_TP`` [T, P] (slot ``p * C + row``, or S where the token sends nothing to p).

    Returns ``ids_ok_C`` int32 [C]: 0 where token c has an id outside [-1, E) (1 elsewhere); such a
    token's rows go nowhere, so the caller must fail on it (a device-side assert)."""
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


# ---- dispatch: receiver layout -----------------------------------------------------------------------


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
def _expert_layout_kernel(
    recv_ptr,
    row_ptr,
    weight_ptr,
    pair_row_ptr,
    counts_ptr,
    num_real_ptr,
    first_expert,
    num_local_experts,
    num_slots,
    TOP_K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    IDS_OFFSET: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    Y_P2: tl.constexpr,
    BLOCK_X: tl.constexpr,
    SCAN_X: tl.constexpr,
):
    # Program i places pairs [i * BLOCK_X, (i + 1) * BLOCK_X). Every program first counts all pairs per
    # expert (the experts' starts) and those before its chunk (its offset inside each expert): the
    # keys are a few KB, read from L2 by every program, which beats a serial scan in one program.
    chunk_start = tl.program_id(0) * BLOCK_X
    num_pairs = num_slots * TOP_K
    offs_y = tl.arange(0, Y_P2)
    counts_Y = tl.zeros([Y_P2], dtype=tl.int32)
    before_Y = tl.zeros([Y_P2], dtype=tl.int32)
    for n0 in range(0, num_pairs, SCAN_X):
        n = n0 + tl.arange(0, SCAN_X)
        key = pair_keys(recv_ptr, n, num_pairs, first_expert, num_local_experts, TOP_K, ROW_BYTES, IDS_OFFSET, Y_P2)
        hot_XY = (key[:, None] == offs_y[None, :]).to(tl.int32)
        counts_Y += tl.sum(hot_XY, axis=0)
        before_Y += tl.sum(tl.where((n < chunk_start)[:, None], hot_XY, 0), axis=0)
    start_Y = tl.cumsum(counts_Y, axis=0) - counts_Y
    if chunk_start == 0:
        tl.store(counts_ptr + offs_y, counts_Y.to(tl.int64), mask=offs_y < num_local_experts)
        tl.store(num_real_ptr, tl.sum(tl.where(offs_y == num_local_experts, start_Y, 0)))
    # A pair's row: its expert's start + the pairs of that expert before it (stable: slot order).
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


def expert_layout(recv_SB: torch.Tensor, fmt: RowFormat, rank: int, num_local_experts: int) -> KernelLayout:
    """The expert-major layout of the S x K pairs in the received rows ``recv_SB`` (uint8 [S, B])."""
    num_slots = recv_SB.shape[0]
    top_k = fmt.top_k
    device = recv_SB.device
    row_R = torch.empty(num_slots * top_k, dtype=torch.int64, device=device)
    weight_R = torch.empty(num_slots * top_k, dtype=torch.float32, device=device)
    pair_row_SK = torch.empty(num_slots, top_k, dtype=torch.int64, device=device)
    counts_L = torch.empty(num_local_experts, dtype=torch.int64, device=device)
    num_real_1 = torch.empty(1, dtype=torch.int32, device=device)
    y_p2 = pow2(num_local_experts + 1)
    block_x = 128
    _expert_layout_kernel[(triton.cdiv(num_slots * top_k, block_x),)](
        recv_SB,
        row_R,
        weight_R,
        pair_row_SK,
        counts_L,
        num_real_1,
        rank * num_local_experts,
        num_local_experts,
        num_slots,
        TOP_K=top_k,
        ROW_BYTES=fmt.row_bytes,
        IDS_OFFSET=fmt.ids_offset,
        WEIGHTS_OFFSET=fmt.weights_offset,
        Y_P2=y_p2,
        BLOCK_X=block_x,
        SCAN_X=max(16, min(1024, 8192 // y_p2)),
    )
    return KernelLayout(
        ExpertLayout(row_R=row_R, weight_R=weight_R, num_rows_per_expert_L=counts_L), pair_row_SK, num_real_1
    )


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


# ---- combine -----------------------------------------------------------------------------------------


@triton.jit
def _reduce_pairs_kernel(
    y_ptr,
    pair_row_ptr,
    num_real_ptr,
    recv_ptr,
    anchor_ptr,
    dst_ptr,
    capacity,
    table_ptr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADDRESSED: tl.constexpr,
):
    s = tl.program_id(0)
    if ADDRESSED:  # a replayed graph: the experts' output from the table (y_ptr: its dtype)
        y_ptr = (anchor_ptr + tl.load(table_ptr) * 16).to(y_ptr.dtype)
    h0 = tl.program_id(1) * BLOCK_H
    offs_k = tl.arange(0, K_P2)
    num_real = tl.load(num_real_ptr)
    row_K = tl.load(pair_row_ptr + s * TOP_K + offs_k, mask=offs_k < TOP_K, other=num_real)
    is_local_K = row_K < num_real  # pairs with no local expert sort after every real row
    if tl.sum(is_local_K.to(tl.int32)) > 0:
        w_ptr = (recv_ptr + s.to(tl.int64) * ROW_BYTES + WEIGHTS_OFFSET).to(tl.pointer_type(tl.float32))
        # As the torch path: the weights rounded to the activation dtype, the sum in float32.
        w_K = tl.load(w_ptr + offs_k, mask=is_local_K, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
        block = (anchor_ptr + tl.load(dst_ptr + s // capacity) * 16).to(y_ptr.dtype)
        dst_row = block + (s % capacity).to(tl.int64) * HIDDEN
        h = h0 + tl.arange(0, BLOCK_H)
        y_KH = tl.load(
            y_ptr + row_K[:, None] * HIDDEN + h[None, :], mask=is_local_K[:, None] & (h[None, :] < HIDDEN), other=0.0
        ).to(tl.float32)
        tl.store(dst_row + h, tl.sum(y_KH * w_K[:, None], axis=0).to(y_ptr.dtype.element_ty), mask=h < HIDDEN)


def reduce_pairs(
    expert_y_RH: torch.Tensor,
    fixed: KernelLayout,
    recv_SB: torch.Tensor,
    fmt: RowFormat,
    dst: Destinations,
    capacity: int,
    addresses: CallerAddresses | None = None,
) -> None:
    """Each slot's weighted sum of its local experts' outputs, into row ``s % C`` of block
    ``s // C`` of ``dst``. Slots with no local pair are not written (their sender never reads them).

    ``addresses`` (inside a graph): read the experts' output at the address the table holds, of
    ``expert_y_RH``'s dtype and shape (``expert_y_RH`` itself is not read)."""
    num_slots, top_k = fixed.pair_row_SK.shape
    hidden = expert_y_RH.shape[1]
    block_h = block_h_for(hidden, lanes(top_k))
    if addresses is not None and addresses.anchor.data_ptr() != dst.anchor.data_ptr():
        raise ValueError("reduce_pairs reads the table's offsets from the destinations' anchor; build them alike")
    _reduce_pairs_kernel[(num_slots, triton.cdiv(hidden, block_h))](
        expert_y_RH,
        fixed.pair_row_SK,
        fixed.num_real_1,
        recv_SB,
        dst.anchor,
        dst.offsets_P,
        capacity,
        dst.offsets_P if addresses is None else addresses.table,
        HIDDEN=hidden,
        TOP_K=top_k,
        K_P2=lanes(top_k),
        ROW_BYTES=fmt.row_bytes,
        WEIGHTS_OFFSET=fmt.weights_offset,
        BLOCK_H=block_h,
        ADDRESSED=addresses is not None,
    )


def sum_returned(
    recv_SH: torch.Tensor, slot_CP: torch.Tensor, out_like: torch.Tensor, addresses: CallerAddresses
) -> None:
    """Inside a graph: ``reduce.gather_sum(recv_SH, slot_CP[:T])`` (each token's P returned rows summed
    in float32, the same kernel and so the same bits) into the [T, H] output of ``out_like``'s dtype
    whose address and T the table holds; rows T..C-1 are not written."""
    launch_gather_sum(recv_SH, slot_CP, None, out_like, addresses)

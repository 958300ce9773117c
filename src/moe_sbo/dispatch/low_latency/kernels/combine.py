"""Combine's kernels of ``low_latency``: each received slot's weighted sum of its local experts'
outputs, written into the block that returns it to the token's rank (a peer's buffer with symmetric
memory), and, inside the ``combine_end`` graph, each token's sum of its P returned rows; and
``restamp_weights``, which replaces the weights the dispatched rows carry (weights known only at
combine).

Legend: see ``moe_sbo/__init__.py``; here R = S * K expert rows (padding included).

The hard part is the padding rows: their expert outputs are undefined (grouped GEMM leaves them
unwritten), so a pair with no local expert is masked, never multiplied by a zero weight (0 * NaN is
NaN), and a slot with no local pair is not written at all (its sender never reads it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....kernel_choice import lanes
from ...reduce import block_h_for, launch_gather_sum
from ..addresses import CallerAddresses
from ..transport import Destinations
from ..wire import RowFormat
from .layout import KernelLayout


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


@triton.jit
def _restamp_weights_kernel(
    weights_ptr,
    slot_ptr,
    anchor_ptr,
    dst_ptr,
    num_ranks,
    capacity,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    WEIGHTS_OFFSET: tl.constexpr,
):
    t = tl.program_id(0)
    offs_k = tl.arange(0, K_P2)
    w_K = tl.load(weights_ptr + t * TOP_K + offs_k, mask=offs_k < TOP_K)
    for p in range(0, num_ranks):
        slot = tl.load(slot_ptr + t * num_ranks + p)
        if slot < num_ranks * capacity:  # S: token t sent nothing to rank p
            block = anchor_ptr + tl.load(dst_ptr + p) * 16
            row = block + (slot - p * capacity) * ROW_BYTES
            tl.store((row + WEIGHTS_OFFSET).to(tl.pointer_type(tl.float32)) + offs_k, w_K, mask=offs_k < TOP_K)


def restamp_weights(
    weights_TK: torch.Tensor, slot_TP: torch.Tensor, fmt: RowFormat, dst: Destinations, capacity: int
) -> None:
    """Write each token's top-k ``weights_TK`` (float32 [T, K]) over the weights of the rows it was
    dispatched as, where ``dst`` says those rows lie (the dispatch's destinations: the peers'
    receive buffers with symmetric memory, this rank's without a collective); ``slot_TP`` is the
    dispatch's ``p * C + row`` of token t in block p (S: not sent). Only the weight bytes are written.

    Sync: one launch, no host read; CUDA-graph safe."""
    num_tokens, num_ranks = slot_TP.shape
    if num_tokens == 0:
        return
    _restamp_weights_kernel[(num_tokens,)](
        weights_TK,
        slot_TP,
        dst.anchor,
        dst.offsets_P,
        num_ranks,
        capacity,
        TOP_K=fmt.top_k,
        K_P2=lanes(fmt.top_k),
        ROW_BYTES=fmt.row_bytes,
        WEIGHTS_OFFSET=fmt.weights_offset,
    )

"""What each of ``low_latency``'s four index graphs runs, as a named function per piece: the kernels a
replay queues, in order, from the table fetch to the write into the peer's buffer.

Legend: see ``moe_sbo/__init__.py``.

The hard part is what a piece may hold. A captured graph keeps its piece's function for as long as the
buffer set lives, so a piece holds the set's tensors and fixed numbers, never the dispatcher (a
reference cycle would keep a deleted layer's buffers alive until the next garbage collection), and
reads everything that changes per forward (the caller's tensors, T) through its ``CallerAddresses``
table. The host side of each phase (staging, table values, replay, the works) is ``fused.ReplayedPath``'s.
"""

from __future__ import annotations

import torch

from .addresses import CallerAddresses, stage_inputs
from .graphs import PieceGraph, Staging
from .kernels import KernelLayout, expert_layout, gather_rows, pack_rows_checked, reduce_pairs, sum_returned
from .transport import Buffers, Destinations
from .wire import RowFormat


def _destinations(dst: Destinations | None) -> Destinations:
    assert dst is not None, "the index graphs run the fused kernels, whose buffers always have destinations"
    return dst


def pack_graph(
    bufs: Buffers,
    staging: Staging,
    fmt: RowFormat,
    *,
    num_local_experts: int,
    num_experts: int,
    capacity: int,
    two_pass: bool,
) -> PieceGraph:
    """The ``pack`` piece: stage the caller's x, ids and weights (table: T, then their offsets),
    ``kernels.pack_rows_checked`` into the set's blocks (the peers' receive buffers for ``symm_mem``),
    and with symmetric memory the transfer's start (``copy_engine``'s peer copies; its one work, the
    set's barrier, is what ``layout`` waits on). An NCCL transfer stays outside the graph."""
    addresses = CallerAddresses(bufs.dispatch_recv_SB, 4)  # T, then x, ids and weights
    dst, exchange = _destinations(bufs.dispatch_dst), bufs.dispatch_exchange
    in_graph = bufs.dispatch_barrier is not None
    x_CH, ids_CK, weights_CK, slot_CP = staging.x_CH, staging.ids_CK, staging.weights_CK, staging.slot_CP

    def pack() -> None:
        stage_inputs(addresses, x_CH, ids_CK, weights_CK)
        pack_rows_checked(
            x_CH, ids_CK, weights_CK, dst, slot_CP, fmt, num_local_experts, capacity, num_experts, two_pass
        )
        if in_graph:
            exchange.start()

    return PieceGraph(pack, capture=x_CH.device.type == "cuda", addresses=addresses)


def layout_graph(
    bufs: Buffers,
    fmt: RowFormat,
    *,
    rank: int,
    num_local_experts: int,
    num_slots: int,
    two_pass: bool,
    keep_fp8: bool,
    in_place: bool,
) -> PieceGraph:
    """The ``layout`` piece: with symmetric memory the transfer's end (the barrier), then
    ``kernels.expert_layout`` of the set's receive buffer and (unless ``in_place``)
    ``kernels.gather_rows`` into the rows and scales whose offsets the table holds. Returns the
    layout (``KernelLayout``), the same tensors every replay on CUDA."""
    recv_SB, barrier = bufs.dispatch_recv_SB, bufs.dispatch_barrier
    received_SB = recv_SB[:num_slots]
    addresses = None if in_place else CallerAddresses(recv_SB, 2)  # the rows, then their scales

    def end_and_layout() -> KernelLayout:
        if barrier is not None:  # the pack graph started a symmetric-memory transfer
            barrier.wait()
        fixed = expert_layout(received_SB, fmt, rank, num_local_experts, two_pass)
        if not in_place:
            gather_rows(recv_SB, fixed, fmt, keep_fp8=keep_fp8, addresses=addresses)
        return fixed

    return PieceGraph(end_and_layout, capture=recv_SB.device.type == "cuda", addresses=addresses)


def combine_graph(bufs: Buffers, layout: PieceGraph, fmt: RowFormat, *, capacity: int) -> PieceGraph:
    """The ``combine`` piece: ``kernels.reduce_pairs`` of the experts' output (its offset in the
    table) over the ``layout`` piece's last outputs (this round's: its captured tensors on CUDA) into
    the blocks, and with symmetric memory the transfer's start (``symm_mem``'s kernel already wrote
    the peers' buffers; ``copy_engine`` copies)."""
    dst, exchange = _destinations(bufs.combine_dst), bufs.combine_exchange
    in_graph = bufs.combine_barrier is not None
    addresses = CallerAddresses(dst.anchor, 1)  # the experts' output
    recv_SB = bufs.dispatch_recv_SB
    y_like = torch.empty(1, fmt.hidden, dtype=fmt.dtype, device=recv_SB.device)  # its dtype and H

    def reduce_and_send() -> None:
        reduce_pairs(y_like, layout.outputs, recv_SB, fmt, dst, capacity, addresses=addresses)
        if in_graph:
            exchange.start()

    return PieceGraph(reduce_and_send, capture=recv_SB.device.type == "cuda", addresses=addresses)


def combine_end_graph(bufs: Buffers, staging: Staging, dtype: torch.dtype) -> PieceGraph:
    """The ``combine_end`` piece: with symmetric memory the transfer's end (the barrier), then
    ``kernels.sum_returned`` of each token's P returned rows into the y whose T and offset the table
    holds."""
    addresses = CallerAddresses(bufs.dispatch_recv_SB, 2)  # T, then y
    recv_SH, slot_CP, barrier = bufs.combine_slots_SH, staging.slot_CP, bufs.combine_barrier
    y_like = torch.empty(1, dtype=dtype, device=recv_SH.device)

    def end_and_sum() -> None:
        if barrier is not None:  # the combine graph's kernel wrote into the peers' buffers
            barrier.wait()
        sum_returned(recv_SH, slot_CP, y_like, addresses)

    return PieceGraph(end_and_sum, capture=recv_SH.device.type == "cuda", addresses=addresses)

"""Expert load balancing's per-forward device work in one Triton launch: count the router's choices
into the load window, pick each choice's replica (one program per block of (token, slot) pairs), and
advance the window (the last program to finish).

In torch the same work is about fifteen small ops (``LoadWindow.record``, ``ReplicaTable.to_physical``,
``LoadWindow.advance``), each a launch of a few microseconds: at decode sizes they cost the layer
several percent (docs/BENCHMARKS.md, "Expert load balancing"). Counts are int32 atomics, which add
exactly in any order, so the window holds the same numbers as the torch path. Runs under
``TRITON_INTERPRET=1`` on CPU tensors (the tests hold it to the torch path).

Why one launch and a ticket: the window may advance only once every program has read this forward's
row, so the advance was a second launch. Instead each program takes a ticket (an atomic add, which
orders its own reads and counts before it) and the program that takes the last one advances the
window and puts the ticket back to zero for the next forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAIRS_PER_PROGRAM = 256


@triton.jit
def _route_and_count_kernel(
    ids_ptr,  # [T * K] logical ids (int32 or int64), < 0: no expert
    out_ptr,  # [T * K] physical slot ids, the dtype of ids
    window_ptr,  # [ROWS, E] int32 counts; row ``position`` is this forward's
    position_ptr,  # [1] int64
    ticket_ptr,  # [1] int32 programs finished in this launch, 0 between launches
    choices_ptr,  # [E, W] int64 each expert's nearest replicas, physical ids (padded)
    count_ptr,  # [E] int64 how many
    num_pairs,
    num_experts,
    rank,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (ids >= 0)
    expert = tl.where(valid, ids, 0)
    position = tl.load(position_ptr)
    tl.atomic_add(window_ptr + position * num_experts + expert, tl.full([BLOCK], 1, tl.int32), mask=valid)
    # Choice (t + k + rank) mod choices(e) among the expert's nearest replicas.
    choices = tl.load(count_ptr + expert, mask=valid, other=1)
    pick = (offs // K + offs % K + rank) % choices
    physical = tl.load(choices_ptr + expert * W + pick, mask=valid, other=0)
    out = tl.where(valid, physical, ids)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=in_range)
    # The last program advances the window: the next row becomes the one to fill, zeroed.
    if tl.atomic_add(ticket_ptr, 1) == tl.num_programs(0) - 1:
        tl.store(ticket_ptr, 0)
        position = (position + 1) % ROWS
        tl.store(position_ptr, position)
        for start in range(0, num_experts, ZERO_BLOCK):
            cols = start + tl.arange(0, ZERO_BLOCK)
            zeros = tl.zeros([ZERO_BLOCK], tl.int32)
            tl.store(window_ptr + position * num_experts + cols, zeros, mask=cols < num_experts)


def route_and_count(
    ids_TK: torch.Tensor,
    window_RE: torch.Tensor,
    position: torch.Tensor,
    ticket: torch.Tensor,
    choices_EW: torch.Tensor,
    count_E: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """Count ``ids_TK`` [T, K] into row ``position`` of ``window_RE``, advance the window, and return
    the physical slot ids [T, K] (the dtype of ids; < 0 kept). ``ticket``: int32 [1], zero (and left
    zero)."""
    ids = ids_TK.contiguous()
    out_TK = torch.empty_like(ids)
    num_pairs = ids.numel()
    rows, num_experts = window_RE.shape
    grid = (max(triton.cdiv(num_pairs, PAIRS_PER_PROGRAM), 1),)  # an empty forward still advances
    _route_and_count_kernel[grid](
        ids,
        out_TK,
        window_RE,
        position,
        ticket,
        choices_EW,
        count_E,
        num_pairs,
        num_experts,
        rank,
        ROWS=rows,
        K=max(ids.shape[1], 1),
        W=choices_EW.shape[1],
        BLOCK=PAIRS_PER_PROGRAM,
        ZERO_BLOCK=min(triton.next_power_of_2(max(num_experts, 1)), 1024),
    )
    return out_TK

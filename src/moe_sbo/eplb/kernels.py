"""Expert load balancing's per-forward device work in two Triton launches: count the router's choices
into the load window and pick each choice's replica (one program per block of (token, slot) pairs),
then advance the window (one program).

In torch the same work is about fifteen small ops (``LoadWindow.record``, ``ReplicaTable.to_physical``,
``LoadWindow.advance``), each a launch of a few microseconds: at decode sizes they cost the layer
several percent (docs/BENCHMARKS.md, "Expert load balancing"). Counts are int32 atomics, which add
exactly in any order, so the window holds the same numbers as the torch path. Runs under
``TRITON_INTERPRET=1`` on CPU tensors (the tests hold it to the torch path).
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
    choices_ptr,  # [E, W] int64 each expert's nearest replicas, physical ids (padded)
    count_ptr,  # [E] int64 how many
    num_pairs,
    num_experts,
    rank,
    K: tl.constexpr,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
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


@triton.jit
def _advance_kernel(window_ptr, position_ptr, num_experts, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The next row becomes this forward's: position + 1 (mod ROWS), that row zeroed."""
    position = (tl.load(position_ptr) + 1) % ROWS
    tl.store(position_ptr, position)
    for start in range(0, num_experts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(window_ptr + position * num_experts + offs, tl.zeros([BLOCK], tl.int32), mask=offs < num_experts)


def route_and_count(
    ids_TK: torch.Tensor,
    window_RE: torch.Tensor,
    position: torch.Tensor,
    choices_EW: torch.Tensor,
    count_E: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """Count ``ids_TK`` [T, K] into row ``position`` of ``window_RE``, advance the window, and return
    the physical slot ids [T, K] (the dtype of ids; < 0 kept)."""
    ids = ids_TK.contiguous()
    out_TK = torch.empty_like(ids)
    num_pairs = ids.numel()
    rows, num_experts = window_RE.shape
    if num_pairs:
        grid = (triton.cdiv(num_pairs, PAIRS_PER_PROGRAM),)
        _route_and_count_kernel[grid](
            ids,
            out_TK,
            window_RE,
            position,
            choices_EW,
            count_E,
            num_pairs,
            num_experts,
            rank,
            K=ids.shape[1],
            W=choices_EW.shape[1],
            BLOCK=PAIRS_PER_PROGRAM,
        )
    block = min(triton.next_power_of_2(max(num_experts, 1)), 1024)
    _advance_kernel[(1,)](window_RE, position, num_experts, ROWS=rows, BLOCK=block)
    return out_TK

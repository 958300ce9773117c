"""Moving expert weights between ranks for a new placement: only the slots whose expert changes rank
travel, rank to rank in one all-to-all; slots whose expert the rank already holds are copied locally.

The hard part is all-or-nothing: a failure anywhere must leave every rank serving the old placement.
So every check runs before any transfer (the placement's sizes here, and that every rank was given the
same placement: one small all-gather), the weights a rank will receive and the local rows it will
reuse are staged first, the ranks agree that every exchange finished (an all-reduce) and only then
does each write its slots, in place, so that CUDA graphs captured over the old weights read the new.
Rows travel as bytes, so FP8 weights and their float32 block scales go in the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .placement import Placement, local_copies, moved_experts


@dataclass(frozen=True)
class MoveReport:
    """What a rebalance moved: slots that changed rank (all ranks), bytes between ranks (all ranks and
    this rank's sends), slots copied inside a rank."""

    moved_slots: int
    moved_bytes: int
    sent_bytes: int
    local_copies: int


def slot_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes one physical slot holds across ``tensors`` (each [S, ...])."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def _rows_as_bytes(tensors: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    """``[len(slots), slot_bytes]`` uint8: the rows ``slots`` of every tensor, side by side (a copy)."""
    if not slots:
        return torch.empty(0, slot_bytes(tensors), dtype=torch.uint8, device=tensors[0].device)
    index = torch.tensor(slots, device=tensors[0].device)
    return torch.cat([t.index_select(0, index).reshape(len(slots), -1).view(torch.uint8) for t in tensors], dim=1)


def _write_rows(tensors: list[torch.Tensor], slots: list[int], rows_XB: torch.Tensor) -> None:
    """Write ``rows_XB`` (``_rows_as_bytes`` layout) into rows ``slots`` of ``tensors``, in place."""
    offset = 0
    for t in tensors:
        width = t[0].numel() * t.element_size()
        for row, slot in enumerate(slots):
            t[slot].view(-1).view(torch.uint8).copy_(rows_XB[row, offset : offset + width])
        offset += width


def _collective_device(group, device: torch.device) -> torch.device:
    """Where a small tensor for a collective of ``group`` must live: NCCL takes only GPU tensors."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_reduce_load(load_E: torch.Tensor, group=None) -> torch.Tensor:
    """``load_E`` summed over the ranks of ``group`` (a copy; the input is left as it is)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return load_E.clone()
    total = load_E.to(_collective_device(group, load_E.device), copy=True)
    dist.all_reduce(total, group=group)
    return total.to(load_E.device)


def check_fits(old: Placement, new: Placement, redundant_per_rank: int) -> None:
    """``ValueError`` unless ``new`` keeps ``old``'s experts, ranks and slots per rank (a layer's
    buffers and graphs are sized for them)."""
    sizes = (new.num_logical, new.num_ranks, new.slots_per_rank)
    if sizes != (old.num_logical, old.num_ranks, old.slots_per_rank):
        raise ValueError(
            f"the placement must keep this layer's {old.num_logical} experts on {old.num_ranks} ranks in "
            f"{old.slots_per_rank} slots each, got {sizes[0]} experts, {sizes[1]} ranks, {sizes[2]} slots; "
            f"use redundant_per_rank={redundant_per_rank}"
        )


def check_same_placement(placement: Placement, group, device: torch.device) -> None:
    """``ValueError`` on every rank unless every rank of ``group`` was given the same placement (one
    all-gather of a digest; every rank sees the same answer, so none goes on to the transfer alone)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    p2l = placement.physical_to_logical
    weights = torch.arange(1, p2l.numel() + 1, dtype=torch.float64)
    digest = torch.tensor([float(p2l.numel()), float((p2l.double() * weights).sum()), float(placement.num_logical)])
    digest = digest.to(_collective_device(group, device))
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, digest, group=group)
    differing = [r for r, d in enumerate(gathered) if not torch.equal(d, gathered[0])]
    if differing:
        raise ValueError(
            f"every rank must rebalance to the same placement, but ranks {differing} were given another than "
            "rank 0; compute it from the all-reduced load (MoELayer.expert_load(all_ranks=True)) or broadcast it"
        )


@torch.no_grad()
def move_expert_slots(tensors: list[torch.Tensor], old: Placement, new: Placement, rank: int, group=None) -> MoveReport:
    """Rewrite this rank's slots of ``tensors`` (each ``[S, ...]``: the routed experts' weights and
    scales) from ``old``'s layout to ``new``'s, receiving the experts this rank did not hold.

    Every rank of ``group`` calls it with the same placements. On any failure nothing was written."""
    moves = moved_experts(old, new)
    copies = [(dst, src) for r, dst, src in local_copies(old, new) if r == rank and dst != src]
    world = new.num_ranks
    mine = old.rank_logical_ids(rank)
    sends = [(dst_rank, dst_slot) for dst_rank, dst_slot, src in moves if src == rank]
    send_slots = [mine.index(new.rank_logical_ids(dst_rank)[dst_slot]) for dst_rank, dst_slot in sends]
    in_splits = [sum(1 for d, _ in sends if d == r) for r in range(world)]
    # Rows arrive grouped by sender (rank order), each sender's in its send order (by slot here).
    arriving = sorted((src, dst_slot) for dst_rank, dst_slot, src in moves if dst_rank == rank)
    out_splits = [sum(1 for s, _ in arriving if s == r) for r in range(world)]

    send_XB = _rows_as_bytes(tensors, send_slots)
    kept_XB = _rows_as_bytes(tensors, [src for _, src in copies])  # staged: a copy may overwrite its source
    recv_XB = torch.empty(len(arriving), slot_bytes(tensors), dtype=torch.uint8, device=send_XB.device)
    if world > 1:
        dist.all_to_all_single(recv_XB, send_XB, out_splits, in_splits, group=group)
        done = torch.ones(1, device=_collective_device(group, send_XB.device))
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=group)  # every rank got its rows, or none writes
        if done.item() != 1:
            raise RuntimeError("a rank failed to receive its experts; the old placement stays")
    _write_rows(tensors, [dst for dst, _ in copies], kept_XB)
    _write_rows(tensors, [dst_slot for _, dst_slot in arriving], recv_XB)
    per_slot = slot_bytes(tensors)
    return MoveReport(len(moves), len(moves) * per_slot, len(send_slots) * per_slot, len(copies))


@dataclass(frozen=True)
class FillReport:
    """What ``fill_slots`` did: slots received from another rank (all ranks) and their bytes, slots
    copied inside this rank, and this rank's slots whose expert no rank held (``to_load``:
    ``(slot, expert)`` pairs the caller fills from elsewhere, e.g. a checkpoint)."""

    moved_slots: int
    moved_bytes: int
    local_copies: int
    to_load: tuple[tuple[int, int], ...]


@torch.no_grad()
def fill_slots(
    tensors: list[torch.Tensor], held: list[list[int]], wanted: list[list[int]], rank: int, group=None
) -> FillReport:
    """Rewrite this rank's slots of ``tensors`` (each ``[S, ...]``) so that rank r's slot j holds
    logical expert ``wanted[r][j]``, given that it holds ``held[r][j]`` now (-1: nothing, e.g. a rank
    that just joined). ``move_expert_slots`` for membership changes: the ranks, their slot contents
    and the experts held may differ freely between ``held`` and ``wanted`` (both ``[P][S]`` over the
    ranks of ``group``).

    A wanted expert this rank holds is copied locally; one another rank holds is received from the
    holder with the fewest sends so far (ties: lowest rank); one no rank holds is left as it is and
    named in ``to_load``. Every rank of ``group`` calls it with the same tables. Nothing is written
    unless every rank received its rows (an all-reduce after the exchange)."""
    world = len(wanted)
    if len(held) != world or any(len(row) != tensors[0].shape[0] for row in (*held, *wanted)):
        raise ValueError(
            f"held and wanted must be [{world}][{tensors[0].shape[0]}] (ranks x this layer's slots), got "
            f"{len(held)} and {world} rows of {sorted({len(row) for row in (*held, *wanted)})} slots"
        )
    holders: dict[int, list[int]] = {}
    for r, row in enumerate(held):
        for expert in row:
            if expert >= 0:
                holders.setdefault(expert, []).append(r)
    sends = [0] * world
    moves: list[tuple[int, int, int]] = []  # (dst_rank, dst_slot, src_rank)
    copies: list[tuple[int, int]] = []  # this rank's (dst_slot, src_slot)
    to_load: list[tuple[int, int]] = []
    for dst_rank, row in enumerate(wanted):
        for dst_slot, expert in enumerate(row):
            if expert in held[dst_rank]:
                if dst_rank == rank:
                    copies.append((dst_slot, held[dst_rank].index(expert)))
            elif expert in holders:
                src_rank = min(holders[expert], key=lambda r: (sends[r], r))
                sends[src_rank] += 1
                moves.append((dst_rank, dst_slot, src_rank))
            elif dst_rank == rank:
                to_load.append((dst_slot, expert))
    copies = [(dst, src) for dst, src in copies if dst != src]
    sent = [(d, s) for d, s, src in moves if src == rank]  # ascending by (dst_rank, dst_slot)
    send_slots = [held[rank].index(wanted[d][s]) for d, s in sent]
    in_splits = [sum(1 for d, _ in sent if d == r) for r in range(world)]
    arriving = sorted((src, dst_slot) for dst_rank, dst_slot, src in moves if dst_rank == rank)
    out_splits = [sum(1 for s, _ in arriving if s == r) for r in range(world)]
    send_XB = _rows_as_bytes(tensors, send_slots)
    kept_XB = _rows_as_bytes(tensors, [src for _, src in copies])  # staged: a copy may overwrite its source
    recv_XB = torch.empty(len(arriving), slot_bytes(tensors), dtype=torch.uint8, device=send_XB.device)
    if world > 1 and moves:
        dist.all_to_all_single(recv_XB, send_XB, out_splits, in_splits, group=group)
        done = torch.ones(1, device=_collective_device(group, send_XB.device))
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=group)  # every rank got its rows, or none writes
        if done.item() != 1:
            raise RuntimeError("a rank failed to receive its experts; the slots keep what they held")
    _write_rows(tensors, [dst for dst, _ in copies], kept_XB)
    _write_rows(tensors, [dst_slot for _, dst_slot in arriving], recv_XB)
    per_slot = slot_bytes(tensors)
    return FillReport(len(moves), len(moves) * per_slot, len(copies), tuple(to_load))

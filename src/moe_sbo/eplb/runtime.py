"""What a layer with expert load balancing holds on its device: the load window every forward adds
its tokens-per-expert counts to, and the replica table that turns the router's logical expert ids
into physical slot ids before dispatch.

The hard part is CUDA graphs: a captured forward must keep working, with no host sync, after a
rebalance. So both hold fixed-shape device tensors that are only ever written in place (a new
placement is copied into the same tables), the window's write position is a device tensor, and the
table's width is the most replicas any placement of these sizes can give an expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernel_choice import HAS_TRITON, use_triton
from .placement import PLACEMENT_POLICIES, Placement, global_placement, placement_for, trivial_placement

if HAS_TRITON:
    from . import kernels as eplb_kernels


@dataclass(frozen=True)
class EPLBOptions:
    """Expert load balancing for one ``MoELayer``.

    ``redundant_per_rank``: extra physical expert slots per rank, for replicas of hot experts (0: the
    placement may still move experts between ranks). ``policy``: how placements are computed from the
    load (``placement.PLACEMENT_POLICIES``); ``num_nodes`` for ``hierarchical`` (the expert groups are
    the model's ``n_group``). ``window``: forwards the load statistics cover. ``rebalance_every``:
    rebalance automatically after this many forwards, from the window (None: only when asked,
    ``MoELayer.rebalance``); counted by eager forwards, so a caller that replays CUDA graphs
    rebalances by hand.
    """

    redundant_per_rank: int = 0
    policy: str = "global"
    window: int = 128
    rebalance_every: int | None = None
    num_nodes: int = 1

    def __post_init__(self) -> None:
        if self.redundant_per_rank < 0:
            raise ValueError(f"redundant_per_rank must be >= 0, got {self.redundant_per_rank}")
        if self.policy not in PLACEMENT_POLICIES:
            raise ValueError(f"policy must be one of {PLACEMENT_POLICIES}, got {self.policy!r}")
        if self.policy == "trivial" and self.redundant_per_rank:
            raise ValueError("policy 'trivial' has no replicas; use policy 'global' with redundant_per_rank > 0")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 forward, got {self.window}")
        if self.rebalance_every is not None and self.rebalance_every < 1:
            raise ValueError(f"rebalance_every must be >= 1 forward or None, got {self.rebalance_every}")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")

    def placement_for(self, load_E: torch.Tensor, num_ranks: int, num_groups: int = 1) -> Placement:
        """This policy's placement for ``load_E`` [E] (the model's ``num_groups`` expert groups, for
        ``hierarchical``)."""
        return placement_for(
            self.policy, load_E, num_ranks, self.redundant_per_rank, num_nodes=self.num_nodes, num_groups=num_groups
        )


def initial_placement(num_experts: int, num_ranks: int, eplb: EPLBOptions) -> Placement:
    """Before any load is known: contiguous experts, and the redundant slots (if any) replicating
    experts as for an even load."""
    if eplb.redundant_per_rank == 0:
        return trivial_placement(num_experts, num_ranks)
    return global_placement(torch.ones(num_experts, dtype=torch.float64), num_ranks, eplb.redundant_per_rank)


class LoadWindow:
    """Tokens per logical expert over the last ``window`` forwards, on the device.

    ``counts_RE`` [window + 1, E] int32: one row per forward, written round-robin at ``position`` (a
    device scalar); the row at ``position`` is the one the next forward fills, kept zero until then.
    Recording needs no host read, so a CUDA graph can capture it. ``ticket`` [1] int32: the fused
    kernel's count of finished programs (``eplb.kernels``), zero between forwards.
    """

    def __init__(self, num_experts: int, window: int, device: torch.device):
        self.counts_RE = torch.zeros(window + 1, num_experts, dtype=torch.int32, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)

    def record(self, ids_TK: torch.Tensor) -> None:
        """Add one forward's routing: ``ids_TK`` [T, K] logical ids (< 0: no expert, not counted)."""
        ids = ids_TK.reshape(-1).long()
        num_experts = self.counts_RE.shape[1]
        flat = self.position * num_experts + ids.clamp(min=0)
        self.counts_RE.view(-1).index_add_(0, flat, (ids >= 0).to(torch.int32))
        self.advance()

    def advance(self) -> None:
        """The next row becomes the one to fill: ``position`` + 1, that row zeroed (the oldest forward
        leaves the window)."""
        self.position.add_(1).remainder_(self.counts_RE.shape[0])
        self.counts_RE.index_fill_(0, self.position, 0)

    def total(self) -> torch.Tensor:
        """``[E]`` int64: tokens per expert over the window (this rank's tokens)."""
        return self.counts_RE.sum(0, dtype=torch.int64)


class ReplicaTable:
    """Logical -> physical expert ids for one rank's tokens, under a ``Placement``.

    Each (token t, slot k) of logical expert e goes to e's replica on this rank when there is one (no
    transfer), else to one of e's replicas on this rank's node (``ranks_per_node``; the fast link),
    else to one of all of them: choice ``(t + k + rank) % choices(e)``, deterministic and spread
    evenly (consecutive tokens take the next one). ``choices_EW`` [E, W] holds those physical ids
    (padded by repeating the first), ``count_E`` [E] how many; W is the most replicas any placement
    of these sizes may give one expert, so a new placement fits the same tensors.

    A ``partial`` placement's missing experts (elastic EP, degraded) are marked in ``masked_E`` [E]
    bool and sent to this rank's first slot: the layer zeroes their weights (``MoELayer.route``), so
    they add nothing to a token's sum. ``any_masked`` says so on the host, without a device read.
    """

    def __init__(self, placement: Placement, rank: int, device: torch.device, ranks_per_node: int | None = None):
        self.rank, self.num_ranks = rank, placement.num_ranks
        self.ranks_per_node = ranks_per_node or placement.num_ranks
        # One replica per rank at most; a partial placement (elastic EP, degraded) may give an expert
        # more than its spare slots would, and is restored into the same table: allow one per rank.
        width = placement.num_ranks if placement.partial else min(placement.num_ranks, 1 + placement.num_redundant)
        self.choices_EW = torch.zeros(placement.num_logical, width, dtype=torch.int64, device=device)
        self.count_E = torch.ones(placement.num_logical, dtype=torch.int64, device=device)
        self.masked_E = torch.zeros(placement.num_logical, dtype=torch.bool, device=device)
        self.any_masked = False
        self.update(placement)

    @torch.no_grad()
    def update(self, placement: Placement) -> None:
        """Take ``placement`` (same sizes), written into the same tensors."""
        table = placement.logical_to_physical()  # [E, most replicas], -1 padded
        width = self.choices_EW.shape[1]
        if table.shape[1] > width or placement.num_ranks != self.num_ranks:
            raise ValueError(
                f"the placement must have the sizes this layer was built for ({self.num_ranks} ranks, at most "
                f"{width} replicas per expert), got {placement.num_ranks} ranks and {table.shape[1]} replicas"
            )
        rank_of = torch.where(table >= 0, table // placement.slots_per_rank, -1)
        node = self.rank // self.ranks_per_node
        # The nearest replicas: on this rank, else on this node, else all of them.
        here, on_node, anywhere = (
            (rank_of == self.rank) & (table >= 0),
            (rank_of >= 0) & (rank_of // self.ranks_per_node == node),
            table >= 0,
        )
        nearest_node = torch.where(on_node.any(1, keepdim=True), on_node, anywhere)
        chosen = torch.where(here.any(1, keepdim=True), here, nearest_node)
        # Chosen replicas first (a stable sort keeps them in ascending physical order), padded with the first.
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices
        ordered = table.gather(1, order)
        count = chosen.sum(1)
        keep = torch.arange(table.shape[1])[None, :] < count[:, None]
        ordered = torch.where(keep, ordered, ordered[:, :1])
        missing = count == 0  # a partial placement's experts without a slot: masked, sent to a stand-in
        ordered = torch.where(missing[:, None], self.rank * placement.slots_per_rank, ordered)
        choices = ordered[:, :1].repeat(1, width)
        choices[:, : ordered.shape[1]] = ordered
        self.choices_EW.copy_(choices)
        self.count_E.copy_(count.clamp(min=1))
        self.masked_E.copy_(missing)
        self.any_masked = bool(missing.any())

    @torch.no_grad()
    def mask(self, experts: Sequence[int]) -> None:
        """Drop ``experts`` from every token's sum as a partial placement's missing experts are
        (until the next ``update``): a single-rank reference for elastic EP's degraded outputs."""
        self.masked_E[list(experts)] = True
        self.any_masked = bool(self.masked_E.any())

    def to_physical(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """``ids_TK`` [T, K] logical ids -> [T, K] physical slot ids, same dtype (< 0 kept)."""
        t, k = ids_TK.shape
        logical = ids_TK.clamp(min=0).long()
        arange = torch.arange(max(t, k), device=ids_TK.device)
        spread_TK = arange[:t, None] + arange[None, :k] + self.rank
        physical = self.choices_EW[logical, spread_TK % self.count_E[logical]]
        return torch.where(ids_TK >= 0, physical, ids_TK.long()).to(ids_TK.dtype)


def route_to_slots(
    ids_TK: torch.Tensor, window: LoadWindow, table: ReplicaTable, kernels: str = "auto"
) -> torch.Tensor:
    """One forward's routing counted into ``window``, and its logical ids [T, K] -> physical slot ids
    [T, K] under ``table``. ``kernels`` (``kernel_choice.use_triton``): ``"auto"`` one Triton launch
    on CUDA (``eplb.kernels``), ``"triton"`` that launch anywhere Triton runs (CPU: its interpreter),
    ``"torch"`` the torch ops."""
    if use_triton(kernels, ids_TK.device):
        return eplb_kernels.route_and_count(
            ids_TK, window.counts_RE, window.position, window.ticket, table.choices_EW, table.count_E, table.rank
        )
    physical_TK = table.to_physical(ids_TK)
    window.record(ids_TK)
    return physical_TK

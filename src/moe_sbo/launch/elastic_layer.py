"""The layer side of elastic expert parallelism (``elastic.py`` is the group side): ``ElasticMoE``
wraps an ``MoELayer`` and re-places its experts each time the group changes. After a loss
(``regroup``) the survivors keep their slots as they are, no weight moves, and the experts left
without a slot are masked; ``restore`` puts them into spare slots (``spare_slot_plan``), read from an
``ExpertSource``; after new ranks join (``grow``) their slots are filled from their peers.

The hard part is the dispatcher, which holds the old group. ``retire_dispatcher`` keeps what the next
one is made of (``_DispatcherSpec``: name, options, hooks) and drops every reference to the old group,
so that a gloo group closes its connections and peers blocked on this rank fail at once;
``_rebuild`` makes the dispatcher, placement and replica table over the new group.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..dispatch import EPGroup, make_dispatcher
from ..eplb.placement import Placement
from ..eplb.runtime import ReplicaTable, initial_placement
from ..eplb.transfer import fill_slots
from ..layer import MoELayer
from .elastic_options import ExpertsLost

log = logging.getLogger("moe_sbo.elastic")

if TYPE_CHECKING:
    from .elastic import ElasticGroup

# An expert's weights from outside the group: ``source(expert)`` -> the arguments of
# ``RoutedExperts.set_expert`` after the slot: (gate_up [2I, H], down [H, I]) and, for FP8 experts,
# their block scales. ``weights.seeded_expert`` and ``hf.checkpoint.LayerLoader.expert_source`` make them.
ExpertSource = Callable[[int], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class RestoreReport:
    """One restore: experts read from the source into this rank's slots (``loaded``, all ranks:
    ``loaded_total``), experts still missing (no spare slot), and how long it took."""

    loaded: tuple[int, ...]
    loaded_total: int
    still_missing: tuple[int, ...]
    t_restore_ms: float


# Transports whose wait is a device-side barrier with the peers (symmetric memory): a lost peer makes
# it trap when its bound runs out, which ends the CUDA context of every rank waiting in it.
TRAPPING_TRANSPORTS = ("symm_mem", "copy_engine")


def check_transport(layer: MoELayer) -> None:
    """Refuse a layer whose dispatcher would wait for a lost peer in a device barrier: the survivors'
    CUDA contexts would end with it (PyTorch's symmetric-memory barrier traps at its bound), so there
    would be no survivors to recover. Waits that fail with an error (gloo, NCCL) are recoverable."""
    transport_for = getattr(layer.dispatcher, "transport_for", None)
    if transport_for is None:
        return
    transport = transport_for(layer.router.weight.device)
    if transport in TRAPPING_TRANSPORTS:
        raise ValueError(
            f"an elastic layer's dispatcher must not wait for its peers in a device barrier, and transport "
            f"{transport!r} does: a lost peer makes it trap, which ends every survivor's CUDA context; build the "
            "layer with dispatcher_options={'transport': 'nccl'} (the group's collective, which raises instead)"
        )


class ElasticMoE:
    """An ``MoELayer`` that survives the loss of a rank of its EP group (``ElasticGroup``).

    ``layer``: built with ``eplb=group.options.eplb()`` (its spare slots) and a dispatcher other
    than ``local``. ``source``: where experts without a live replica are read from when they are
    restored (``ExpertSource``; None: they stay masked). ``elastic(x)`` is the layer's forward,
    recovered and re-run on a loss; ``group.recoveries`` tells what happened.
    """

    def __init__(self, layer: MoELayer, group: ElasticGroup, source: ExpertSource | None = None):
        if layer.eplb is None or layer.placement is None:
            raise ValueError(
                "an elastic layer needs expert slots it can re-place: build the MoELayer with "
                "eplb=ElasticOptions(...).eplb()"
            )
        spare = group.options.spare_slots_per_rank
        if layer.eplb.redundant_per_rank != spare:
            raise ValueError(
                f"the layer's eplb redundant_per_rank must equal ElasticOptions.spare_slots_per_rank={spare}, got "
                f"{layer.eplb.redundant_per_rank}; build it with eplb=options.eplb()"
            )
        if layer.dispatcher.name == "local":
            raise ValueError("dispatcher 'local' has no group to lose a rank from; use allgather, alltoall, ...")
        check_transport(layer)
        self.layer, self.group, self.source = layer, group, source
        group.layers.append(self)

    def __call__(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.group.run(self, x_TH)

    forward = __call__

    @property
    def placement(self) -> Placement:
        """The layer's placement over the current group (an elastic layer always has one)."""
        placement = self.layer.placement
        assert placement is not None, "an elastic layer is built with eplb, so it has a placement"
        return placement

    @property
    def missing_experts(self) -> tuple[int, ...]:
        """Experts no slot of the group holds (masked) now."""
        return self.placement.missing_experts()

    def regroup(self, old_members: Sequence[int]) -> tuple[int, ...]:
        """After a loss: the survivors' slots as they are, over the new group (no weight moves); the
        experts left without a slot are masked. Returns them."""
        old = self.layer.placement
        assert old is not None, "an elastic layer has a placement"
        rows = old.rows()
        kept = [rows[old_members.index(m)] for m in self.group.members]
        flat = torch.tensor([e for row in kept for e in row], dtype=torch.int64)
        partial = bool((torch.bincount(flat, minlength=old.num_logical) == 0).any())
        placement = Placement(flat, old.num_logical, len(kept), partial=partial)
        self._rebuild(placement)
        return placement.missing_experts()

    def restore_or_raise(self) -> None:
        """``restore``, and ``ExpertsLost`` if experts are still missing (the policy forbids degraded)."""
        if self.missing_experts and self.restore().still_missing:
            raise ExpertsLost(
                f"experts {list(self.missing_experts)} have no live replica and no spare slot or source to restore "
                "them, and ElasticOptions.degraded is False; give the layer more spare slots "
                "(spare_slots_per_rank) or a source, or allow degraded serving"
            )

    @torch.no_grad()
    def restore(self) -> RestoreReport:
        """Put every missing expert into a spare slot (one whose expert has another replica), read
        from ``source`` by the rank that takes it. Every rank of the group calls it, between forwards.
        Afterwards the outputs are the full layer's. Experts that find no spare slot stay masked."""
        started = time.monotonic()
        placement = self.layer.placement
        assert placement is not None, "an elastic layer has a placement"
        missing = placement.missing_experts()
        if not missing:  # the same on every rank: the placement is the group's
            return RestoreReport((), 0, missing, 1e3 * (time.monotonic() - started))
        held = placement.rows()
        wanted, unplaced = spare_slot_plan(held, missing)
        # Every rank restores or none does: a rank that cannot read its share (no source, a failed
        # read) would keep the old placement while the others switch, and compute the wrong experts.
        # So each reads first, then the group agrees (an all-reduce), and only then are slots written.
        holders = {expert for row in held for expert in row if expert >= 0}
        mine = [(slot, e) for slot, e in enumerate(wanted[self.group.rank]) if e >= 0 and e not in holders]
        loaded: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        can = self.source is not None or not mine
        if can and mine:
            try:
                loaded = [(slot, tuple(self.source(expert))) for slot, expert in mine]  # type: ignore[misc]
            except Exception as err:  # noqa: BLE001 - any read error: this rank says no, the group keeps its placement
                log.warning("restoring experts %s failed on this rank: %s", [e for _, e in mine], err)
                can = False
        agreed = torch.tensor([1 if can else 0], dtype=torch.int32, device=self.layer.router.weight.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if not int(agreed.item()):
            return RestoreReport((), 0, missing, 1e3 * (time.monotonic() - started))
        fill_slots(self.layer.experts.slot_tensors(), held, wanted, self.group.rank, None)
        for slot, tensors in loaded:
            self.layer.experts.set_expert(slot, *tensors)
        flat = torch.tensor([e for row in wanted for e in row], dtype=torch.int64)
        restored = Placement(flat, placement.num_logical, placement.num_ranks, partial=bool(unplaced))
        self.layer.placement = restored
        self.layer.replicas.update(restored)
        loaded_total = len(missing) - len(unplaced)
        return RestoreReport(
            tuple(e for _, e in mine), loaded_total, tuple(unplaced), 1e3 * (time.monotonic() - started)
        )

    @torch.no_grad()
    def grow(self, old_members: Sequence[int], rows: list[list[int]]) -> None:
        """After new ranks joined: their slots filled from their peers, the placement the layer's
        initial one where the sizes allow; router and shared experts sent from rank 0."""
        layer, group = self.layer, self.group
        eplb = layer.eplb
        assert eplb is not None, "an elastic layer has eplb options"
        num_logical, slots = layer.cfg.num_experts, len(rows[0])
        held = [rows[old_members.index(m)] if m in old_members else [-1] * slots for m in group.members]
        if num_logical % group.size == 0 and num_logical // group.size + eplb.redundant_per_rank == slots:
            wanted = initial_placement(num_logical, group.size, eplb).rows()
        else:
            wanted = _fill_new_ranks(held, num_logical)
        for tensor in _replicated_tensors(layer):
            dist.broadcast(tensor, src=0)
        report = fill_slots(layer.experts.slot_tensors(), held, wanted, group.rank, None)
        for slot, expert in report.to_load:
            if self.source is None:
                raise ExpertsLost(f"expert {expert} has no replica in the group and this layer has no source")
            layer.experts.set_expert(slot, *self.source(expert))
        flat = torch.tensor([e for row in wanted for e in row], dtype=torch.int64)
        self._rebuild(Placement(flat, num_logical, group.size))

    def retire_dispatcher(self) -> None:
        """Keep what the next dispatcher needs (``_DispatcherSpec``) and let the old one go, with its
        references to the old group."""
        old = getattr(self.layer, "dispatcher", None)
        if old is not None:
            self._spec = _DispatcherSpec(old.name, dict(old.options), old.hooks, old.deliver_fp8, old.ep.ranks_per_node)
            del self.layer.dispatcher  # two-batch overlap's twin goes with it (a weak-keyed cache)
            del old

    def _rebuild(self, placement: Placement) -> None:
        """The layer's dispatcher, placement and replica table over the current group (the dispatcher's
        hooks carry over: the same registry)."""
        self.retire_dispatcher()
        layer, spec = self.layer, self._spec
        size, rank = dist.get_world_size(), dist.get_rank()
        per_node = spec.ranks_per_node
        ep = EPGroup(None, rank, size, per_node if per_node and size % per_node == 0 else None)
        options = dict(spec.options)
        if options.get("ranks_per_node") and size % options["ranks_per_node"]:
            options.pop("ranks_per_node")  # node_aware: the nodes no longer split evenly; one node
        new = make_dispatcher(spec.name, placement.num_physical, ep, **options)
        new.hooks = spec.hooks
        new.deliver_fp8 = spec.deliver_fp8
        layer.dispatcher = new
        layer.placement = placement
        device = layer.router.weight.device
        layer.replicas = ReplicaTable(placement, rank, device, ranks_per_node=new.ep.node_size)


@dataclass(frozen=True)
class _DispatcherSpec:
    """What a layer's dispatcher is made of, beyond its group: rebuilt from this over a new group."""

    name: str
    options: dict
    hooks: Any
    deliver_fp8: bool
    ranks_per_node: int | None


def spare_slot_plan(held: list[list[int]], missing: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """Where the ``missing`` experts go: each into a slot whose expert has the most replicas (at least
    two), on a rank that has taken the fewest so far and does not hold it. Returns the new slot table
    and the experts that found no slot."""
    wanted = [list(row) for row in held]
    counts = Counter(e for row in held for e in row)
    taken = [0] * len(held)
    unplaced = []
    for expert in missing:
        spots = [
            (-counts[e], taken[r], r, j)
            for r, row in enumerate(wanted)
            if expert not in row
            for j, e in enumerate(row)
            if counts[e] > 1
        ]
        if not spots:
            unplaced.append(expert)
            continue
        _, _, r, j = min(spots)
        counts[wanted[r][j]] -= 1
        wanted[r][j] = expert
        counts[expert] += 1
        taken[r] += 1
    return wanted, unplaced


def _fill_new_ranks(held: list[list[int]], num_logical: int) -> list[list[int]]:
    """Slots of new ranks (rows of -1) filled with the experts that have the fewest replicas (missing ones first)."""
    counts = Counter({e: 0 for e in range(num_logical)})
    counts.update(e for row in held for e in row if e >= 0)
    wanted = [list(row) for row in held]
    for row in wanted:
        for j, e in enumerate(row):
            if e < 0:
                expert = min((c, x) for x, c in counts.items() if x not in row)[1]
                row[j] = expert
                counts[expert] += 1
    return wanted


def _replicated_tensors(layer: MoELayer) -> list[torch.Tensor]:
    """The weights every rank holds alike: the router's and the shared experts'."""
    tensors = [layer.router.weight.data, layer.router.e_score_correction_bias.data]
    if layer.shared_experts is not None:
        tensors += [layer.shared_experts.gate_up_proj.data, layer.shared_experts.down_proj.data]
    return tensors

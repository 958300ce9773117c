"""Expert placement for expert-parallel load balancing (EPLB): which logical expert each physical
expert slot of each rank holds, chosen from a measured (or modelled) per-expert load.

Legend: see ``moe_sbo/__init__.py``. Here E is the logical (routed) experts and P the ranks, as there;
a *physical slot* holds one expert's weights on one rank. Every rank has ``slots_per_rank`` =
E / P + ``redundant_per_rank`` slots, and physical slot p lives on rank ``p // slots_per_rank``. Every
logical expert has at least one replica; hot experts get more (redundant experts, as DeepSeek's EPLB,
SGLang and vLLM place them). One replica's load is modelled as ``load[e] / replicas[e]``: an expert's
tokens are spread evenly over its replicas.

Policies: ``trivial`` (today's contiguous layout, no replicas), ``global`` (replicate the hottest
experts, then pack all replicas onto all ranks; DeepSeek's decode-time policy) and ``hierarchical``
(pack whole expert groups onto nodes first, so that a token's traffic stays within few nodes, then
``global`` inside each node; DeepSeek's prefill-time policy). ``moved_experts`` and ``local_copies``
say where each slot of a new placement takes its weights from.

The hard part is the two rules every placement keeps at once: every rank gets exactly
``slots_per_rank`` replicas, and no rank holds two replicas of one expert (a second copy on the same
rank adds weights and nothing else). ``Placement`` checks both when it is made; the policies keep them
by replicating within the caps (at most one replica of an expert per rank, ``_check_sizes``) and
packing with ``pack_items``, which places all copies of an item at once and never paints itself into
a corner where the last free slots sit on ranks that already hold the expert (``packing.py``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from .packing import pack_items

PLACEMENT_POLICIES: tuple[str, ...] = ("trivial", "global", "hierarchical")


@dataclass(frozen=True, eq=False)
class Placement:
    """Which logical expert each physical slot holds, on ``num_ranks`` ranks of equal slot count.

    ``physical_to_logical`` is ``[num_ranks * slots_per_rank]`` int64 on the CPU: slot p holds logical
    expert ``physical_to_logical[p]`` and lives on rank ``p // slots_per_rank``. The constructor stores
    its own int64 CPU copy (a caller's later in-place edit cannot break the checked invariants) and
    validates it.

    ``partial``: some logical experts may have no slot (``missing_experts``): the placement of ranks
    that survived the loss of a rank holding the only replica of an expert (elastic EP serves such a
    placement degraded, the missing experts masked, until it restores them).

    ``==`` is identity (``eq=False``: a dataclass's generated ``__eq__`` would compare tensors to a
    tensor, not a bool); ``equals`` compares contents. Instances hash by identity.
    """

    physical_to_logical: torch.Tensor
    num_logical: int
    num_ranks: int
    partial: bool = False

    def __post_init__(self) -> None:
        table = self.physical_to_logical
        if not isinstance(table, torch.Tensor):
            raise ValueError(
                f"physical_to_logical must be a torch.Tensor of logical expert ids, got {type(table).__name__}: "
                "pass torch.tensor(ids, dtype=torch.int64)"
            )
        if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
            raise ValueError(
                f"physical_to_logical must hold integer expert ids, got dtype {table.dtype}: pass an int64 tensor"
            )
        object.__setattr__(self, "physical_to_logical", table.detach().to("cpu", torch.int64).clone())
        self.validate()

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def num_redundant(self) -> int:
        """Physical slots beyond one per logical expert: the extra replicas of all experts."""
        return self.num_physical - self.num_logical

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first broken rule and its fix; return quietly otherwise."""
        num_ranks, num_logical, table = self.num_ranks, self.num_logical, self.physical_to_logical
        for name, value in (("num_ranks", num_ranks), ("num_logical", num_logical)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if table.dim() != 1:
            raise ValueError(
                f"physical_to_logical must be 1-D [num_ranks * slots_per_rank], got shape {tuple(table.shape)}: "
                "flatten it rank by rank"
            )
        length = table.numel()
        if length == 0 or length % num_ranks:
            raise ValueError(
                f"physical_to_logical has {length} slots, not a positive multiple of num_ranks={num_ranks}: "
                "every rank must have the same number of slots"
            )
        if length < num_logical and not self.partial:
            raise ValueError(
                f"physical_to_logical has {length} slots for num_logical={num_logical} experts: every expert "
                f"needs a slot, so give each rank at least {-(-num_logical // num_ranks)} slots"
            )
        slots = length // num_ranks
        if slots > num_logical:
            raise ValueError(
                f"{slots} slots per rank but only {num_logical} experts: a rank would hold some expert twice; "
                f"use at most {num_logical} slots per rank"
            )
        low, high = int(table.min()), int(table.max())
        if low < 0 or high >= num_logical:
            bad = low if low < 0 else high
            raise ValueError(
                f"physical_to_logical holds expert id {bad}, outside [0, num_logical={num_logical}): "
                "ids are logical expert indices"
            )
        counts = torch.bincount(table, minlength=num_logical)
        missing = (counts == 0).nonzero().flatten()
        if missing.numel() and not self.partial:
            raise ValueError(
                f"logical experts {missing[:8].tolist()}{'...' if missing.numel() > 8 else ''} have no replica: "
                "every logical expert needs at least one physical slot"
            )
        per_rank, _ = table.view(num_ranks, slots).sort(dim=1)
        twice = (per_rank[:, 1:] == per_rank[:, :-1]).nonzero()
        if twice.numel():
            rank, column = (int(v) for v in twice[0])
            raise ValueError(
                f"rank {rank} holds logical expert {int(per_rank[rank, column])} twice: a second replica on "
                "the same rank takes no load off the first; move it to another rank"
            )

    def equals(self, other: object) -> bool:
        """Same ranks, same expert count and the same expert in every slot."""
        return (
            isinstance(other, Placement)
            and other.num_ranks == self.num_ranks
            and other.num_logical == self.num_logical
            and torch.equal(other.physical_to_logical, self.physical_to_logical)
        )

    def replica_counts(self) -> torch.Tensor:
        """``[num_logical]`` int64: how many physical slots hold each logical expert (each >= 1 unless
        ``partial``)."""
        return torch.bincount(self.physical_to_logical, minlength=self.num_logical)

    def missing_experts(self) -> tuple[int, ...]:
        """The logical experts no slot holds (empty unless ``partial``)."""
        return tuple((self.replica_counts() == 0).nonzero().flatten().tolist())

    def rows(self) -> list[list[int]]:
        """Each rank's logical experts, in slot order: ``[num_ranks][slots_per_rank]``."""
        return self.physical_to_logical.view(self.num_ranks, self.slots_per_rank).tolist()

    def logical_to_physical(self) -> torch.Tensor:
        """``[num_logical, max_replicas]`` int64: each expert's physical slots, ascending, padded with -1."""
        table = self.physical_to_logical
        counts = self.replica_counts()
        # A stable sort groups the slots by expert and keeps each group in ascending slot order.
        physical_by_expert = torch.argsort(table, stable=True)
        experts = table[physical_by_expert]
        first_of_expert = torch.cumsum(counts, 0) - counts
        column = torch.arange(table.numel()) - first_of_expert[experts]
        result = torch.full((self.num_logical, max(int(counts.max()), 1)), -1, dtype=torch.int64)
        result[experts, column] = physical_by_expert
        return result

    def rank_of_physical(self, physical: int) -> int:
        if not 0 <= physical < self.num_physical:
            raise ValueError(f"physical slot {physical} outside [0, {self.num_physical})")
        return physical // self.slots_per_rank

    def rank_logical_ids(self, rank: int) -> tuple[int, ...]:
        """The logical experts of ``rank``'s slots, in slot order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside [0, num_ranks={self.num_ranks})")
        slots = self.slots_per_rank
        return tuple(self.physical_to_logical[rank * slots : (rank + 1) * slots].tolist())

    def rank_loads(self, load_E: torch.Tensor) -> torch.Tensor:
        """``[num_ranks]`` float64: each rank's sum of ``load_E[e] / replicas[e]`` over its slots."""
        load = _checked_load(load_E, self.num_logical)
        per_replica = load / self.replica_counts().to(torch.float64)
        return per_replica[self.physical_to_logical].view(self.num_ranks, self.slots_per_rank).sum(dim=1)

    def balance(self, load_E: torch.Tensor) -> float:
        """Max over mean of ``rank_loads``: 1.0 is perfect balance (and the answer for an all-zero load)."""
        loads = self.rank_loads(load_E)
        mean = float(loads.mean())
        return float(loads.max()) / mean if mean > 0 else 1.0


def trivial_placement(num_logical: int, num_ranks: int) -> Placement:
    """The contiguous layout, no replicas: rank r holds experts r*L .. r*L+L-1, L = num_logical / num_ranks."""
    _check_sizes(num_logical, num_ranks, 0)
    return Placement(torch.arange(num_logical, dtype=torch.int64), num_logical, num_ranks)


def global_placement(load_E: torch.Tensor, num_ranks: int, redundant_per_rank: int) -> Placement:
    """Replicate the hottest experts, then pack every replica onto every rank (DeepSeek's "global" policy).

    Replicate: starting from one replica each, the ``num_ranks * redundant_per_rank`` extra replicas go
    one at a time to the expert with the largest ``load / replicas`` (ties: lowest id), never beyond
    ``num_ranks`` replicas of one expert. Pack: heaviest replica first onto the least-loaded rank with a
    free slot that does not hold that expert yet (ties: lowest rank), then swaps between the heaviest
    rank and the others while a swap lowers the heaviest. Each rank's slots are sorted by expert id.
    """
    load = _checked_load(load_E)
    num_logical = load.numel()
    _check_sizes(num_logical, num_ranks, redundant_per_rank)
    slots = num_logical // num_ranks + redundant_per_rank
    ranks = _replicate_and_pack(load.tolist(), list(range(num_logical)), num_ranks, slots)
    return Placement(torch.tensor([e for rank in ranks for e in rank], dtype=torch.int64), num_logical, num_ranks)


def hierarchical_placement(
    load_E: torch.Tensor, num_ranks: int, redundant_per_rank: int, num_nodes: int, num_groups: int
) -> Placement:
    """Pack whole expert groups onto nodes, then ``global_placement`` inside each node (DeepSeek's
    "hierarchical" policy, for prefill).

    Experts form ``num_groups`` groups of consecutive ids (DeepSeek-V3: 256 experts in 8 groups, each
    token's experts in at most 4 groups); ranks form ``num_nodes`` nodes of ``num_ranks / num_nodes``
    consecutive ranks. Each node gets ``num_groups / num_nodes`` whole groups, heaviest group first onto
    the lightest node, so a token's experts sit on few nodes. Inside a node, the node's experts get the
    node's ``redundant_per_rank * ranks_per_node`` extra replicas (at most one per rank of the node)
    and are packed onto its ranks as ``global_placement`` does. With one node this is
    ``global_placement``.
    """
    load = _checked_load(load_E)
    num_logical = load.numel()
    _check_sizes(num_logical, num_ranks, redundant_per_rank)
    _check_positive_ints(num_nodes=num_nodes, num_groups=num_groups)
    if num_ranks % num_nodes:
        raise ValueError(
            f"num_ranks={num_ranks} is not a multiple of num_nodes={num_nodes}: every node must hold the same "
            "number of consecutive ranks"
        )
    if num_logical % num_groups:
        raise ValueError(
            f"num_logical={num_logical} experts do not split into num_groups={num_groups} equal groups: pass the "
            "model's group count (DeepSeek-V3: n_group=8), or use global_placement"
        )
    if num_groups % num_nodes:
        raise ValueError(
            f"num_groups={num_groups} is not a multiple of num_nodes={num_nodes}: hierarchical placement gives "
            "every node whole groups, the same number each; use global_placement (policy 'global'), or a "
            "num_nodes that divides num_groups"
        )
    ranks_per_node = num_ranks // num_nodes
    experts_per_node = num_logical // num_nodes
    slots = num_logical // num_ranks + redundant_per_rank
    if slots > experts_per_node:
        raise ValueError(
            f"redundant_per_rank={redundant_per_rank} is too many for hierarchical placement: a node's "
            f"{ranks_per_node} ranks would have {slots} slots each for the node's {experts_per_node} experts, "
            "so some rank would hold an expert twice; use redundant_per_rank <= "
            f"{experts_per_node - num_logical // num_ranks}, or global_placement"
        )
    experts_per_group = num_logical // num_groups
    group_load = load.view(num_groups, experts_per_group).sum(dim=1).tolist()
    node_groups = pack_items(group_load, [1] * num_groups, num_nodes, num_groups // num_nodes)
    load_list = load.tolist()
    ranks: list[list[int]] = []
    for groups in node_groups:
        experts = sorted(g * experts_per_group + i for g in groups for i in range(experts_per_group))
        ranks += _replicate_and_pack([load_list[e] for e in experts], experts, ranks_per_node, slots)
    return Placement(torch.tensor([e for rank in ranks for e in rank], dtype=torch.int64), num_logical, num_ranks)


def placement_for(
    policy: str,
    load_E: torch.Tensor,
    num_ranks: int,
    redundant_per_rank: int,
    num_nodes: int = 1,
    num_groups: int = 1,
) -> Placement:
    """The placement of ``policy`` (one of ``PLACEMENT_POLICIES``).

    ``trivial`` reads only the expert count from ``load_E`` and takes no redundant slots (choosing
    replicas needs a load: use ``global``). ``global`` ignores ``num_nodes`` and ``num_groups``.
    """
    if policy == "trivial":
        if redundant_per_rank != 0:
            raise ValueError(
                f"policy 'trivial' places no redundant experts, got redundant_per_rank={redundant_per_rank}: "
                "choosing replicas needs the load, so use policy 'global' (or 'hierarchical'), or pass 0"
            )
        return trivial_placement(_checked_load(load_E).numel(), num_ranks)
    if policy == "global":
        return global_placement(load_E, num_ranks, redundant_per_rank)
    if policy == "hierarchical":
        return hierarchical_placement(load_E, num_ranks, redundant_per_rank, num_nodes, num_groups)
    raise ValueError(f"unknown placement policy {policy!r}: use one of {PLACEMENT_POLICIES}")


def moved_experts(old: Placement, new: Placement) -> list[tuple[int, int, int]]:
    """The new slots whose expert their rank did not hold before, and which rank sends each.

    Returns ``(dst_rank, dst_slot, src_rank)`` tuples, ascending by ``(dst_rank, dst_slot)``;
    ``dst_slot`` is the slot's index within ``dst_rank`` (0 .. slots_per_rank - 1). The sender is an
    old holder of the expert: the one with the fewest sends so far (ties: lowest rank), so that one old
    replica does not serve every new one. The sender reads its old slot
    ``old.rank_logical_ids(src_rank).index(expert)``. With ``local_copies`` this names the source of
    every new slot exactly once; both read the old weights, so apply them from a copy of the old
    buffers (or into fresh ones).
    """
    _check_comparable(old, new)
    holders: list[list[int]] = [[] for _ in range(old.num_logical)]
    for rank in range(old.num_ranks):
        for expert in old.rank_logical_ids(rank):
            holders[expert].append(rank)
    sends = [0] * old.num_ranks
    moves = []
    for dst_rank in range(new.num_ranks):
        already_here = set(old.rank_logical_ids(dst_rank))
        for dst_slot, expert in enumerate(new.rank_logical_ids(dst_rank)):
            if expert in already_here:
                continue
            src_rank = min(holders[expert], key=lambda r: (sends[r], r))
            sends[src_rank] += 1
            moves.append((dst_rank, dst_slot, src_rank))
    return moves


def local_copies(old: Placement, new: Placement) -> list[tuple[int, int, int]]:
    """The new slots whose expert their rank already held: ``(rank, dst_slot, src_slot)`` tuples,
    ascending by ``(rank, dst_slot)``, both slots indices within ``rank``.

    ``dst_slot == src_slot`` (the weights stay put) is listed too, so that ``local_copies`` and
    ``moved_experts`` together cover every new slot exactly once.
    """
    _check_comparable(old, new)
    copies = []
    for rank in range(new.num_ranks):
        old_slot_of = {expert: slot for slot, expert in enumerate(old.rank_logical_ids(rank))}
        for dst_slot, expert in enumerate(new.rank_logical_ids(rank)):
            if expert in old_slot_of:
                copies.append((rank, dst_slot, old_slot_of[expert]))
    return copies


def zipf_load(num_logical: int, s: float, seed: int = 0) -> torch.Tensor:
    """``[num_logical]`` float64 expert loads with Zipf popularity, mean 1 (sum ``num_logical``).

    A seeded random permutation ranks the experts; the k-th most popular gets weight ``k ** -s``
    before normalising (s = 0: uniform).
    """
    if not isinstance(num_logical, int) or isinstance(num_logical, bool) or num_logical < 1:
        raise ValueError(f"num_logical must be a positive int, got {num_logical!r}")
    if not (isinstance(s, (int, float)) and s >= 0 and s < float("inf")):
        raise ValueError(f"the Zipf exponent s must be a finite number >= 0, got {s!r}")
    generator = torch.Generator().manual_seed(seed)
    by_popularity = torch.randperm(num_logical, generator=generator)
    load = torch.empty(num_logical, dtype=torch.float64)
    load[by_popularity] = torch.arange(1, num_logical + 1, dtype=torch.float64) ** -float(s)
    return load * (num_logical / load.sum())


def _checked_load(load_E: torch.Tensor, num_logical: int | None = None) -> torch.Tensor:
    """``load_E`` as a float64 CPU tensor, after checking its shape and values."""
    if not isinstance(load_E, torch.Tensor):
        raise ValueError(f"load must be a 1-D torch.Tensor of per-expert loads, got {type(load_E).__name__}")
    if load_E.dtype.is_complex or load_E.dtype == torch.bool:
        raise ValueError(f"load must be real numbers (tokens per expert), got dtype {load_E.dtype}")
    if load_E.dim() != 1 or load_E.numel() == 0 or (num_logical is not None and load_E.numel() != num_logical):
        want = f"[{num_logical}]" if num_logical is not None else "[num_logical] with num_logical >= 1"
        raise ValueError(f"load must have shape {want} (one entry per logical expert), got {tuple(load_E.shape)}")
    load = load_E.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(load).all()):
        raise ValueError("load holds NaN or inf: pass finite per-expert token counts")
    if bool((load < 0).any()):
        raise ValueError(f"load holds negative entries (min {float(load.min())}): loads are token counts, >= 0")
    return load


def _check_positive_ints(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_sizes(num_logical: int, num_ranks: int, redundant_per_rank: int) -> None:
    _check_positive_ints(num_logical=num_logical, num_ranks=num_ranks)
    if not isinstance(redundant_per_rank, int) or isinstance(redundant_per_rank, bool) or redundant_per_rank < 0:
        raise ValueError(f"redundant_per_rank must be an int >= 0 (extra slots per rank), got {redundant_per_rank!r}")
    if num_logical % num_ranks:
        raise ValueError(
            f"num_logical={num_logical} is not a multiple of num_ranks={num_ranks}: every rank holds the same "
            "number of experts; use an expert-parallel size that divides the expert count"
        )
    # Each expert can take at most one replica per rank, so at most num_ranks - 1 extra ones.
    most = num_logical - num_logical // num_ranks
    if redundant_per_rank > most:
        raise ValueError(
            f"redundant_per_rank={redundant_per_rank} asks for {redundant_per_rank * num_ranks} extra replicas, but "
            f"with at most one replica of an expert per rank the {num_logical} experts take at most "
            f"{num_logical * (num_ranks - 1)} extra ones: use redundant_per_rank <= {most}"
        )


def _check_comparable(old: Placement, new: Placement) -> None:
    for name in ("num_ranks", "num_logical", "slots_per_rank"):
        if getattr(old, name) != getattr(new, name):
            raise ValueError(
                f"old and new placements differ in {name} ({getattr(old, name)} vs {getattr(new, name)}): moving "
                "experts keeps the ranks, the experts and the slot count; rebuild the weights instead"
            )


def _replicate(load: list[float], extra: int, most_replicas: int) -> list[int]:
    """Replica counts: one each, then ``extra`` more, each to the largest ``load / replicas`` below the cap."""
    replicas = [1] * len(load)
    # Max-heap by load per replica; equal keys pop the lowest id first.
    heap = [(-w, e) for e, w in enumerate(load) if most_replicas > 1]
    heapq.heapify(heap)
    for _ in range(extra):
        _, expert = heapq.heappop(heap)  # never empty: _check_sizes bounds extra by the cap
        replicas[expert] += 1
        if replicas[expert] < most_replicas:
            heapq.heappush(heap, (-load[expert] / replicas[expert], expert))
    return replicas


def _replicate_and_pack(load: list[float], experts: list[int], num_ranks: int, slots: int) -> list[list[int]]:
    """``experts`` (global ids; ``load`` is theirs, aligned) replicated and packed onto ``num_ranks`` ranks
    of ``slots`` slots: each rank's global ids, sorted."""
    replicas = _replicate(load, num_ranks * slots - len(experts), num_ranks)
    weights = [w / c for w, c in zip(load, replicas)]
    return [sorted(experts[i] for i in items) for items in pack_items(weights, replicas, num_ranks, slots)]

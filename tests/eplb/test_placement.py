"""EPLB expert placement (``eplb/placement.py``, its packing ``eplb/packing.py``): every policy's
invariants over seeded random loads, the packing against exhaustive search on small cases,
hierarchical's groups and nodes, the balance targets on Zipf loads, where moved weights come from,
and the errors of bad input."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator

import pytest
import torch

from moe_sbo.eplb import (
    PLACEMENT_POLICIES,
    Placement,
    global_placement,
    hierarchical_placement,
    local_copies,
    moved_experts,
    placement_for,
    trivial_placement,
    zipf_load,
)
from moe_sbo.eplb.packing import pack_items


def _loads(generator: torch.Generator, num_logical: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Loads of several shapes: flat, skewed, heavy-tailed, small integers (ties and zeros), Zipf."""
    yield "uniform", torch.rand(num_logical, generator=generator, dtype=torch.float64) * 100
    yield "cubed", torch.rand(num_logical, generator=generator, dtype=torch.float64) ** 3 * 100
    yield "exponential", -torch.log(torch.rand(num_logical, generator=generator, dtype=torch.float64))
    yield "small ints", torch.randint(0, 4, (num_logical,), generator=generator).to(torch.float64)
    seed = int(torch.randint(0, 10_000, (1,), generator=generator))
    yield "zipf", zipf_load(num_logical, 0.5 + 1.5 * float(torch.rand(1, generator=generator)), seed)


def _item_weights(placement: Placement, load_E: torch.Tensor) -> torch.Tensor:
    """One replica's modelled load, per physical slot."""
    counts = placement.replica_counts().to(torch.float64)
    return (load_E.to(torch.float64) / counts)[placement.physical_to_logical]


def _assert_invariants(placement: Placement, load_E: torch.Tensor, num_ranks: int, redundant: int) -> None:
    num_logical = load_E.numel()
    slots = num_logical // num_ranks + redundant
    assert (placement.num_logical, placement.num_ranks, placement.slots_per_rank) == (num_logical, num_ranks, slots)
    assert placement.physical_to_logical.dtype == torch.int64
    counts = placement.replica_counts()
    assert counts.min() >= 1 and int(counts.sum()) == placement.num_physical == num_ranks * slots
    for rank in range(num_ranks):
        experts = placement.rank_logical_ids(rank)
        assert len(experts) == slots and len(set(experts)) == slots
        assert list(experts) == sorted(experts)  # canonical: slots ascending by expert id
    table = placement.logical_to_physical()
    assert table.shape == (num_logical, int(counts.max()))
    for expert in range(num_logical):
        physical = [p for p in table[expert].tolist() if p >= 0]
        assert physical == sorted(physical) and len(physical) == int(counts[expert])
        assert (table[expert, len(physical) :] == -1).all()
        assert all(int(placement.physical_to_logical[p]) == expert for p in physical)
        assert len({placement.rank_of_physical(p) for p in physical}) == len(physical)
    rank_loads = placement.rank_loads(load_E)
    assert rank_loads.dtype == torch.float64 and rank_loads.shape == (num_ranks,)
    torch.testing.assert_close(rank_loads.sum(), load_E.to(torch.float64).sum(), rtol=1e-12, atol=1e-9)
    placement.validate()


def _assert_graham_bound(placement: Placement, load_E: torch.Tensor, num_ranks: int) -> None:
    """The bound that the swap pass guarantees (see ``test_global_packing_against_exhaustive_search``)."""
    weights = _item_weights(placement, load_E)
    rank_loads = placement.rank_loads(load_E)
    bound = float(rank_loads.mean()) + (1 - 1 / num_ranks) * float(weights.max() - weights.min())
    assert float(rank_loads.max()) <= bound + 1e-9 * max(float(load_E.sum()), 1.0)


def _random_case(generator: torch.Generator) -> tuple[int, int, int, int, int]:
    """(num_logical, num_ranks, redundant_per_rank, num_nodes, num_groups), hierarchical-compatible."""
    num_ranks = [1, 2, 3, 4, 6, 8][int(torch.randint(0, 6, (1,), generator=generator))]
    divisors = [n for n in range(1, num_ranks + 1) if num_ranks % n == 0]
    num_nodes = divisors[int(torch.randint(0, len(divisors), (1,), generator=generator))]
    groups_per_node = int(torch.randint(1, 4, (1,), generator=generator))
    num_groups = num_nodes * groups_per_node
    # num_logical: a multiple of num_ranks and of num_groups.
    step = num_ranks * num_groups // _gcd(num_ranks, num_groups)
    num_logical = step * int(torch.randint(1, max(2, 48 // step + 1), (1,), generator=generator))
    most_redundant = num_logical // num_nodes - num_logical // num_ranks  # hierarchical's limit, the lower one
    redundant = int(torch.randint(0, min(most_redundant, 4) + 1, (1,), generator=generator))
    return num_logical, num_ranks, redundant, num_nodes, num_groups


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def test_every_policy_keeps_the_invariants():
    """Over seeded random sizes and loads: every expert placed, replica counts summing to the slots,
    exactly slots_per_rank distinct experts per rank, rank loads summing to the load."""
    generator = torch.Generator().manual_seed(2024)
    for _ in range(60):
        num_logical, num_ranks, redundant, num_nodes, num_groups = _random_case(generator)
        for kind, load in _loads(generator, num_logical):
            where = f"{kind} E={num_logical} P={num_ranks} r={redundant} nodes={num_nodes} groups={num_groups}"
            trivial = placement_for("trivial", load, num_ranks, 0)
            _assert_invariants(trivial, load, num_ranks, 0)
            assert trivial.physical_to_logical.tolist() == list(range(num_logical)), where
            glob = placement_for("global", load, num_ranks, redundant)
            _assert_invariants(glob, load, num_ranks, redundant)
            _assert_graham_bound(glob, load, num_ranks)
            assert glob.equals(global_placement(load, num_ranks, redundant)), f"not deterministic: {where}"
            hier = placement_for("hierarchical", load, num_ranks, redundant, num_nodes, num_groups)
            _assert_invariants(hier, load, num_ranks, redundant)
            _assert_groups_stay_on_one_node(hier, num_nodes, num_groups)


def _all_placements(num_logical: int, num_ranks: int, redundant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every valid placement up to the order of ranks: ``[Y, P, E]`` per-rank replica shares (1/replicas
    where the rank holds the expert, else 0; rank loads = shares @ load) and ``[Y, E]`` replica counts."""
    slots = num_logical // num_ranks + redundant
    rank_sets = list(itertools.combinations(range(num_logical), slots))
    shares, counts = [], []
    for choice in itertools.combinations_with_replacement(rank_sets, num_ranks):
        count = collections.Counter(e for rank in choice for e in rank)
        if len(count) < num_logical:
            continue
        share = torch.zeros(num_ranks, num_logical, dtype=torch.float64)
        for rank, experts in enumerate(choice):
            for e in experts:
                share[rank, e] = 1 / count[e]
        shares.append(share)
        counts.append([count[e] for e in range(num_logical)])
    return torch.stack(shares), torch.tensor(counts)


# (num_logical, num_ranks, redundant_per_rank): up to a few thousand placements each, enumerated in well under a second.
SMALL_CASES = [
    (4, 2, 0),
    (4, 2, 1),
    (6, 2, 0),
    (6, 2, 1),
    (6, 2, 2),
    (6, 3, 0),
    (6, 3, 1),
    (8, 2, 0),
    (8, 2, 1),
    (8, 4, 0),
]


def test_global_packing_against_exhaustive_search():
    """``global_placement`` against every valid placement of small cases (E 4-8, P 2-4, redundant 0-2).

    The bound, proved: when the swap pass stops, no swap between the heaviest rank H and any other rank
    Y lowers H. If H and Y differ in load, some item a only on H and b only on Y have a > b (both hold
    S items, and the ones they share cancel), and that swap would lower H unless a - b >= L_H - L_Y.
    So L_H - L_Y <= w_max - w_min for every Y; averaged over the P - 1 others,
    ``max <= mean + (1 - 1/P) (w_max - w_min)`` (Graham's list-scheduling bound), with w the replica
    weights load/replicas. The optimum is >= the mean and >= the heaviest replica of any placement, and
    the replication step (water filling) makes ours the lightest possible, so ``max <= (2 - 1/P) * opt``.

    Measured, not proved: given the replica counts the algorithm chose, the packing is exactly optimal
    in almost every case (asserted: >= 97% over all cases; 99% when written). Against the optimum over
    all placements (replica counts chosen too) it is exact far less often (a third to all, by case)
    and up to 4/3 off: replicating the heaviest replica is not always best for the packing. Example:
    load (2, 1, 1, 0) on 2 ranks with 1 redundant slot each: the water filling replicates experts 0
    and 1, giving 2.5 vs 1.5 (balance 1.25), where replicating experts 0 and 3 gives 2 vs 2.
    """
    exact_same = total = 0
    findings = []
    for num_logical, num_ranks, redundant in SMALL_CASES:
        shares, counts = _all_placements(num_logical, num_ranks, redundant)
        generator = torch.Generator().manual_seed(1000 * num_logical + 10 * num_ranks + redundant)
        case_exact_same = case_exact_all = case_total = 0
        worst_same = worst_all = 1.0
        for _ in range(40):
            for kind, load in _loads(generator, num_logical):
                if float(load.sum()) == 0:
                    continue
                placement = global_placement(load, num_ranks, redundant)
                got = float(placement.rank_loads(load).max())
                every_max = (shares @ load).max(dim=1).values
                optimum = float(every_max.min())
                same_counts = (counts == placement.replica_counts()).all(dim=1)
                optimum_same = float(every_max[same_counts].min())
                eps = 1e-9 * float(load.sum())
                assert optimum <= optimum_same + eps and optimum_same <= got + eps
                assert got <= (2 - 1 / num_ranks) * optimum + eps, (kind, load)
                _assert_graham_bound(placement, load, num_ranks)
                case_exact_same += got <= optimum_same + eps
                case_exact_all += got <= optimum + eps
                case_total += 1
                worst_same, worst_all = max(worst_same, got / optimum_same), max(worst_all, got / optimum)
        findings.append(
            f"E={num_logical} P={num_ranks} r={redundant}: {shares.shape[0]} placements, exact given its "
            f"replicas {case_exact_same}/{case_total} (worst {worst_same:.4f}), exact overall "
            f"{case_exact_all}/{case_total} (worst {worst_all:.4f})"
        )
        exact_same += case_exact_same
        total += case_total
    print("\n".join(findings))
    assert exact_same >= 0.97 * total, "\n".join(findings)


def test_the_greedy_replication_is_not_always_optimal():
    """The example of the docstring above, pinned: a known limit of the water-filling replication."""
    load = torch.tensor([2.0, 1.0, 1.0, 0.0])
    placement = global_placement(load, 2, 1)
    assert placement.replica_counts().tolist() == [2, 2, 1, 1]
    assert placement.balance(load) == pytest.approx(1.25)
    better = Placement(torch.tensor([0, 1, 3, 0, 2, 3]), 4, 2)
    assert better.balance(load) == pytest.approx(1.0)


def test_packing_keeps_the_rest_placeable():
    """Greedy would put the fifth light item on bin 1 (the lightest), leaving bins 0 and 2 the only open
    ones for the three copies of the last item; the Gale-Ryser check sends it to bin 0 instead. (The
    water-filling replication never makes such inputs in the random tests; the guard is for safety.)"""
    weights = [10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]
    copies = [1, 1, 1, 1, 1, 1, 3]
    bins = pack_items(weights, copies, 3, 3)
    assert all(len(b) == 3 for b in bins) and all(6 in b for b in bins)
    assert sorted(len(set(b)) for b in bins) == [3, 3, 3]
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4, 5, 6, 6, 6]


def _assert_groups_stay_on_one_node(placement: Placement, num_nodes: int, num_groups: int) -> None:
    ranks_per_node = placement.num_ranks // num_nodes
    experts_per_group = placement.num_logical // num_groups
    node_of_group: dict[int, set[int]] = collections.defaultdict(set)
    for rank in range(placement.num_ranks):
        for expert in placement.rank_logical_ids(rank):
            node_of_group[expert // experts_per_group].add(rank // ranks_per_node)
    assert all(len(nodes) == 1 for nodes in node_of_group.values()), dict(node_of_group)
    groups_per_node = collections.Counter(next(iter(nodes)) for nodes in node_of_group.values())
    assert set(groups_per_node.values()) == {num_groups // num_nodes}


def test_hierarchical_keeps_groups_on_one_node_and_balances_nodes():
    """Each group's experts on one node, every node num_groups/num_nodes groups; the node loads obey the
    swap-pass bound over group loads (``mean + (1 - 1/N)(max - min)``), and within a node, the ranks obey
    it over the node's replicas."""
    generator = torch.Generator().manual_seed(7)
    for num_logical, num_ranks, redundant, num_nodes, num_groups in [
        (256, 8, 1, 2, 8),
        (256, 16, 2, 4, 8),
        (64, 8, 1, 4, 16),
        (48, 6, 2, 3, 6),
    ]:
        for kind, load in _loads(generator, num_logical):
            placement = hierarchical_placement(load, num_ranks, redundant, num_nodes, num_groups)
            _assert_invariants(placement, load, num_ranks, redundant)
            _assert_groups_stay_on_one_node(placement, num_nodes, num_groups)
            ranks_per_node = num_ranks // num_nodes
            node_loads = placement.rank_loads(load).view(num_nodes, ranks_per_node).sum(dim=1)
            group_loads = load.view(num_groups, -1).sum(dim=1)
            bound = float(node_loads.mean()) + (1 - 1 / num_nodes) * float(group_loads.max() - group_loads.min())
            assert float(node_loads.max()) <= bound + 1e-9 * float(load.sum()), kind
            weights = _item_weights(placement, load).view(num_nodes, -1)
            rank_loads = placement.rank_loads(load).view(num_nodes, ranks_per_node)
            for node in range(num_nodes):
                spread = float(weights[node].max() - weights[node].min())
                node_bound = float(rank_loads[node].mean()) + (1 - 1 / ranks_per_node) * spread
                assert float(rank_loads[node].max()) <= node_bound + 1e-9 * float(load.sum()), (kind, node)


def test_hierarchical_on_one_node_is_global():
    load = zipf_load(64, 1.2, seed=3)
    assert hierarchical_placement(load, 8, 1, 1, 4).equals(global_placement(load, 8, 1))


def test_zipf_targets_at_ep8():
    """``zipf_load(256, 1.0)`` on 8 ranks. Trivial: 1.89 (seed 0; the ranks' sums of a random Zipf
    permutation, the hottest expert alone 1.31x a rank's mean). Targets: global with 1 redundant slot
    per rank <= 1.10, with 2 <= 1.05; measured 1.0000 for both, on every seed tried. Hierarchical
    (8 groups on 2 nodes, 1 redundant): 1.004. EP32 and EP64 print below (run with -s)."""
    for seed in range(5):
        load = zipf_load(256, 1.0, seed)
        trivial = trivial_placement(256, 8).balance(load)
        assert trivial > 1.3, f"trivial placement already balanced ({trivial}): the test load is not skewed"
        assert global_placement(load, 8, 1).balance(load) <= 1.10
        assert global_placement(load, 8, 2).balance(load) <= 1.05
        assert hierarchical_placement(load, 8, 1, 2, 8).balance(load) <= 1.10
    load = zipf_load(256, 1.0)
    for num_ranks in (8, 32, 64):
        figures = {
            "trivial": trivial_placement(256, num_ranks).balance(load),
            "global r=1": global_placement(load, num_ranks, 1).balance(load),
            "global r=2": global_placement(load, num_ranks, 2).balance(load),
            "hierarchical r=1 (8 groups, 2 nodes)": hierarchical_placement(load, num_ranks, 1, 2, 8).balance(load),
        }
        print(f"EP{num_ranks}: " + ", ".join(f"{name} {value:.4f}" for name, value in figures.items()))
        assert figures["global r=1"] <= 1.10 and figures["global r=2"] <= 1.05


def test_no_change_moves_nothing():
    load = zipf_load(32, 1.0)
    placement = global_placement(load, 4, 1)
    assert moved_experts(placement, placement) == []
    copies = local_copies(placement, placement)
    assert copies == [(rank, slot, slot) for rank in range(4) for slot in range(placement.slots_per_rank)]


def _assert_every_slot_sourced(old: Placement, new: Placement) -> None:
    moves, copies = moved_experts(old, new), local_copies(old, new)
    sources = [(dst, slot) for dst, slot, _ in moves] + [(rank, slot) for rank, slot, _ in copies]
    assert sorted(sources) == [(r, s) for r in range(new.num_ranks) for s in range(new.slots_per_rank)]
    for dst_rank, dst_slot, src_rank in moves:
        expert = new.rank_logical_ids(dst_rank)[dst_slot]
        assert expert in old.rank_logical_ids(src_rank) and expert not in old.rank_logical_ids(dst_rank)
    for rank, dst_slot, src_slot in copies:
        assert new.rank_logical_ids(rank)[dst_slot] == old.rank_logical_ids(rank)[src_slot]


def _arriving(old: Placement, new: Placement) -> set[tuple[int, int]]:
    """(rank, expert) pairs of ``new`` that ``old`` does not have."""
    pairs = [{(r, e) for r in range(p.num_ranks) for e in p.rank_logical_ids(r)} for p in (old, new)]
    return pairs[1] - pairs[0]


def test_trivial_to_global_moves_only_experts_that_change_rank():
    """Trivial to global (no redundant slots: moves keep the slot count), then global to global with
    redundant slots for a changed load: a move for each (rank, expert) pair that is new, nothing else."""
    generator = torch.Generator().manual_seed(11)
    for num_logical, num_ranks, redundant in [(256, 8, 1), (64, 16, 2), (32, 4, 3)]:
        for _, load in _loads(generator, num_logical):
            old = trivial_placement(num_logical, num_ranks)
            new = global_placement(load, num_ranks, 0)
            _assert_every_slot_sourced(old, new)
            moves = moved_experts(old, new)
            assert len(moves) == len(_arriving(old, new))
            # Trivial holds each expert once: its one holder sends every copy.
            local = num_logical // num_ranks
            assert all(src == new.rank_logical_ids(dst)[slot] // local for dst, slot, src in moves)
            before = global_placement(load, num_ranks, redundant)
            after = global_placement(load.flip(0) + 1, num_ranks, redundant)
            _assert_every_slot_sourced(before, after)
            assert len(moved_experts(before, after)) == len(_arriving(before, after))


def test_moves_spread_over_the_old_holders():
    """Each expert on two ranks before; the sender is the holder with the fewest sends so far (ties: the
    lowest rank), worked out by hand."""
    old = Placement(torch.tensor([0, 1, 0, 2, 1, 3, 2, 3]), 4, 4)
    new = Placement(torch.tensor([2, 3, 1, 2, 0, 2, 0, 1]), 4, 4)
    assert moved_experts(old, new) == [
        (0, 0, 1),  # expert 2 from ranks 1 or 3: both unused, rank 1
        (0, 1, 2),  # expert 3 from ranks 2 or 3: both unused, rank 2
        (1, 0, 0),  # expert 1 from ranks 0 (0 sends) or 2 (1 send): rank 0
        (2, 0, 0),  # expert 0 from ranks 0 (1) or 1 (1): tie, rank 0
        (2, 1, 3),  # expert 2 from ranks 1 (1) or 3 (0): rank 3
        (3, 0, 1),  # expert 0 from ranks 0 (2) or 1 (1): rank 1
        (3, 1, 2),  # expert 1 from ranks 0 (2) or 2 (1): rank 2
    ]
    assert local_copies(old, new) == [(1, 1, 1)]  # rank 1 keeps expert 2, in slot 1
    _assert_every_slot_sourced(old, new)


def test_zipf_load():
    load = zipf_load(256, 1.0, seed=5)
    assert load.dtype == torch.float64 and load.shape == (256,)
    assert float(load.sum()) == pytest.approx(256)
    expected = torch.arange(1, 257, dtype=torch.float64) ** -1.0
    torch.testing.assert_close(load.sort(descending=True).values, expected * (256 / expected.sum()))
    assert torch.equal(load, zipf_load(256, 1.0, seed=5))
    assert not torch.equal(load, zipf_load(256, 1.0, seed=6))
    torch.testing.assert_close(zipf_load(16, 0.0), torch.ones(16, dtype=torch.float64))


def test_placement_object():
    placement = Placement(torch.tensor([0, 1, 2, 0], dtype=torch.int32), 3, 2)
    assert placement.physical_to_logical.dtype == torch.int64
    assert (placement.slots_per_rank, placement.num_physical, placement.num_redundant) == (2, 4, 1)
    assert placement.replica_counts().tolist() == [2, 1, 1]
    assert placement.logical_to_physical().tolist() == [[0, 3], [1, -1], [2, -1]]
    assert [placement.rank_of_physical(p) for p in range(4)] == [0, 0, 1, 1]
    assert placement.rank_logical_ids(1) == (2, 0)
    load = torch.tensor([4.0, 1.0, 3.0])
    assert placement.rank_loads(load).tolist() == [3.0, 5.0]
    assert placement.balance(load) == pytest.approx(1.25)
    assert placement.balance(torch.zeros(3)) == 1.0
    same = Placement(torch.tensor([0, 1, 2, 0]), 3, 2)
    assert placement.equals(same) and placement != same and placement == placement
    assert not Placement(torch.tensor([0, 1, 2, 3]), 4, 2).equals(Placement(torch.tensor([0, 1, 2, 3]), 4, 1))
    source = torch.tensor([0, 1, 2, 0])
    kept = Placement(source, 3, 2)
    source[0] = 7  # the placement holds its own copy
    assert kept.physical_to_logical.tolist() == [0, 1, 2, 0]


@pytest.mark.parametrize(
    ("table", "num_logical", "num_ranks", "match"),
    [
        (torch.tensor([0, 1, 2]), 3, 2, "not a positive multiple of num_ranks=2"),
        (torch.tensor([0, 1]), 3, 2, "every expert needs a slot"),
        (torch.tensor([0, 1, 2, 5]), 4, 2, "expert id 5, outside"),
        (torch.tensor([0, -1, 2, 3]), 4, 2, "expert id -1, outside"),
        (torch.tensor([0, 1, 0, 1]), 3, 2, r"logical experts \[2\] have no replica"),
        (torch.tensor([0, 0, 1, 2]), 3, 2, "rank 0 holds logical expert 0 twice"),
        (torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), 3, 1, "8 slots per rank but only 3 experts"),
        (torch.tensor([[0, 1], [2, 3]]), 4, 2, "must be 1-D"),
        (torch.tensor([0.0, 1.0]), 2, 1, "integer expert ids"),
        ([0, 1], 2, 1, "must be a torch.Tensor"),
        (torch.tensor([0, 1]), 2, 0, "num_ranks must be a positive int"),
    ],
)
def test_bad_placements_are_refused(table, num_logical, num_ranks, match):
    with pytest.raises(ValueError, match=match):
        Placement(table, num_logical, num_ranks)


def test_bad_input_to_the_policies_is_refused():
    load = torch.ones(16)
    with pytest.raises(ValueError, match="not a multiple of num_ranks=3"):
        global_placement(load, 3, 0)
    with pytest.raises(ValueError, match="redundant_per_rank must be an int >= 0"):
        global_placement(load, 4, -1)
    with pytest.raises(ValueError, match=r"at most 12 extra ones: use redundant_per_rank <= 3"):
        global_placement(torch.ones(4), 4, 4)
    with pytest.raises(ValueError, match="use redundant_per_rank <= 0"):
        global_placement(load, 1, 1)
    with pytest.raises(ValueError, match=r"shape \[num_logical\]"):
        global_placement(torch.ones(4, 4), 4, 0)
    with pytest.raises(ValueError, match="negative entries"):
        global_placement(torch.tensor([1.0, -1.0]), 2, 0)
    with pytest.raises(ValueError, match="NaN or inf"):
        global_placement(torch.tensor([1.0, float("nan")]), 2, 0)
    with pytest.raises(ValueError, match="NaN or inf"):
        global_placement(torch.tensor([1.0, float("inf")]), 2, 0)
    with pytest.raises(ValueError, match="1-D torch.Tensor"):
        global_placement([1.0, 2.0], 2, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not split into num_groups=3 equal groups"):
        hierarchical_placement(load, 4, 0, 2, 3)
    with pytest.raises(ValueError, match="num_groups=3 is not a multiple of num_nodes=2.*use global_placement"):
        hierarchical_placement(torch.ones(24), 4, 0, 2, 3)
    with pytest.raises(ValueError, match="num_ranks=4 is not a multiple of num_nodes=3"):
        hierarchical_placement(torch.ones(24), 4, 0, 3, 3)
    with pytest.raises(ValueError, match="too many for hierarchical.*redundant_per_rank <= 4"):
        hierarchical_placement(load, 4, 5, 2, 2)
    with pytest.raises(ValueError, match="'trivial' places no redundant experts.*use policy 'global'"):
        placement_for("trivial", load, 4, 1)
    with pytest.raises(ValueError, match="unknown placement policy 'greedy'"):
        placement_for("greedy", load, 4, 0)
    with pytest.raises(ValueError, match="differ in slots_per_rank"):
        moved_experts(trivial_placement(16, 4), global_placement(load, 4, 1))
    with pytest.raises(ValueError, match="differ in num_ranks"):
        local_copies(trivial_placement(16, 4), trivial_placement(16, 2))
    with pytest.raises(ValueError, match="Zipf exponent"):
        zipf_load(8, -1.0)
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        trivial_placement(3, 1).rank_loads(torch.ones(4))
    assert PLACEMENT_POLICIES == ("trivial", "global", "hierarchical")

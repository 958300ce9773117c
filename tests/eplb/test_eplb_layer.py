"""Expert load balancing inside the layer, on gloo ranks: replicas and moved experts give the outputs of
the layer without them, the load window counts the router's choices, and a rebalance moves only the
experts that change rank, all or nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.eplb import Placement, global_placement, trivial_placement, zipf_load
from moe_sbo.eplb.runtime import EPLBOptions, LoadWindow, ReplicaTable
from moe_sbo.layer import MoELayer

DISPATCHERS = ("allgather", "alltoall", "low_latency")


def _options(name: str, tokens: int) -> dict | None:
    return {"max_tokens_per_rank": tokens} if name == "low_latency" else None


def _skewed(cfg, seed: int) -> torch.Tensor:
    """A router bias that makes the routing follow a Zipf(1) popularity over the experts."""
    return zipf_load(cfg.num_experts, 1.0, seed=seed).log().float()


def _replicas_match_plain_rank(device, dispatcher, redundant, overlap):
    """The same tokens through the layer without eplb and with replicas (and after a rebalance)."""
    cfg, rank, world = get_preset("tiny"), dist.get_rank(), dist.get_world_size()
    tokens = 24
    x = torch.randn(tokens - rank, cfg.hidden_size, generator=torch.Generator().manual_seed(7 + rank))
    plain = MoELayer(cfg, dispatcher=dispatcher, seed=3, dispatcher_options=_options(dispatcher, tokens))
    eplb = EPLBOptions(redundant_per_rank=redundant)
    balanced = MoELayer(
        cfg, dispatcher=dispatcher, seed=3, dispatcher_options=_options(dispatcher, tokens), eplb=eplb, overlap=overlap
    )
    for layer in (plain, balanced):  # a skewed routing, so that replicas and moves matter
        layer.router.e_score_correction_bias.data.copy_(_skewed(cfg, 1))
    with torch.no_grad():
        expected = plain(x)
        before = balanced(x)
        load = balanced.expert_load(all_ranks=True)
        report = balanced.rebalance()
        after = balanced(x)
    with torch.no_grad():
        again = balanced(x)
    return {
        "before": torch.equal(before, expected),
        "close": all(torch.allclose(y, expected, rtol=1e-5, atol=1e-6) for y in (before, after)),
        "repeatable": torch.equal(again, after),
        "max_err": max((before - expected).abs().max().item(), (after - expected).abs().max().item()),
        "load_sum": int(load.sum()),
        "tokens": sum(tokens - r for r in range(world)) * cfg.num_experts_per_tok,
        "moved": report.moved_slots,
        "slots": balanced.experts.num_local_experts,
        "p2l": balanced.placement.physical_to_logical.tolist(),
    }


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("redundant", [0, 1])
def test_replicas_and_rebalance_keep_the_output(ranks2, dispatcher, redundant):
    """Equal to the layer without eplb: bitwise while each expert's rows are computed as there (no
    replicas, experts not moved yet); within float32 rounding once an expert's rows are split over
    replicas or computed on another rank (a CPU GEMM's result for a row depends on the rows beside
    it: one or two rows take a GEMV path); bitwise repeatable."""
    results = ranks2.run(_replicas_match_plain_rank, dispatcher, redundant, "none")
    cfg = get_preset("tiny")
    for r in results:
        assert r["close"] and r["repeatable"], r["max_err"]
        assert r["before"] or redundant, r["max_err"]
        assert r["load_sum"] == r["tokens"]  # every (token, slot) counted once, over both ranks
        assert r["slots"] == cfg.num_experts // 2 + redundant
    assert results[0]["p2l"] == results[1]["p2l"]  # both ranks moved to the same placement
    assert results[0]["moved"] > 0  # the skewed load made the policy move experts


@pytest.mark.parametrize("overlap", ["dispatch", "combine", "split"])
def test_replicas_hold_under_every_sbo_mode(ranks4, overlap):
    for r in ranks4.run(_replicas_match_plain_rank, "alltoall", 1, overlap):
        assert r["close"] and r["repeatable"], r["max_err"]


def _rebalance_rank(device, fp8_like: bool):
    """A rebalance to a given placement: the slots hold exactly the new experts' seeded weights."""
    cfg, rank, world = get_preset("tiny"), dist.get_rank(), dist.get_world_size()
    layer = MoELayer(cfg, dispatcher="alltoall", seed=5, eplb=EPLBOptions(redundant_per_rank=1))
    reference = MoELayer(cfg, dispatcher="local", seed=5)
    target = global_placement(zipf_load(cfg.num_experts, 1.2, seed=4), world, 1)
    old = layer.placement
    report = layer.rebalance(target)
    same = all(
        torch.equal(layer.experts.gate_up_proj[slot], reference.experts.gate_up_proj[expert])
        and torch.equal(layer.experts.down_proj[slot], reference.experts.down_proj[expert])
        for slot, expert in enumerate(target.rank_logical_ids(rank))
    )
    kept = sum(e in old.rank_logical_ids(rank) for e in target.rank_logical_ids(rank))
    return same, report, kept, list(layer.local_expert_ids)


def test_rebalance_moves_only_experts_that_change_rank(ranks4):
    cfg = get_preset("tiny")
    results = ranks4.run(_rebalance_rank, False)
    slots = cfg.num_experts // 4 + 1
    arrived = sum(slots - kept for _, _, kept, _ in results)
    per_slot = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # gate, up, down in float32
    for same, report, _, _ in results:
        assert same
        assert report.moved_slots == arrived and report.moved_bytes == arrived * per_slot
    assert sum(r.sent_bytes for _, r, _, _ in results) == arrived * per_slot


def _mismatched_rank(device):
    cfg, rank, world = get_preset("tiny"), dist.get_rank(), dist.get_world_size()
    layer = MoELayer(cfg, dispatcher="alltoall", seed=5, eplb=EPLBOptions(redundant_per_rank=1))
    before = [t.clone() for t in (layer.experts.gate_up_proj, layer.experts.down_proj)]
    old = layer.placement
    target = global_placement(zipf_load(cfg.num_experts, 1.0, seed=rank), world, 1)  # differs per rank
    try:
        layer.rebalance(target)
    except ValueError as exc:
        unchanged = torch.equal(before[0], layer.experts.gate_up_proj) and torch.equal(
            before[1], layer.experts.down_proj
        )
        return str(exc), unchanged and layer.placement is old
    return "", False


def test_ranks_given_different_placements_refuse_before_any_transfer(ranks2):
    for message, unchanged in ranks2.run(_mismatched_rank):
        assert message.startswith("every rank must rebalance to the same placement, but ranks [1]")
        assert unchanged


def test_a_placement_of_other_sizes_is_refused_with_the_fix():
    cfg = get_preset("tiny")
    layer = MoELayer(cfg, seed=1, eplb=EPLBOptions())
    with pytest.raises(
        ValueError, match=r"keep this layer's 16 experts on 1 ranks in 16 slots each, got 16 experts, 2 "
    ):
        layer.rebalance(trivial_placement(cfg.num_experts, 2))
    with pytest.raises(ValueError, match="build the layer with eplb=EPLBOptions"):
        MoELayer(cfg, seed=1).rebalance()


def _automatic_rank(device):
    cfg = get_preset("tiny")
    plain = MoELayer(cfg, dispatcher="alltoall", seed=2)
    auto = MoELayer(
        cfg, dispatcher="alltoall", seed=2, eplb=EPLBOptions(redundant_per_rank=2, rebalance_every=3, window=4)
    )
    for layer in (plain, auto):
        layer.router.e_score_correction_bias.data.copy_(_skewed(cfg, 2))
    start = auto.placement
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    with torch.no_grad():
        outputs = [(auto(x), plain(x)) for _ in range(4)]
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in outputs)
    return close, not auto.placement.equals(start), auto.forwards_since_rebalance


def test_automatic_rebalance_every_n_forwards_keeps_the_output(ranks2):
    for close, moved, since in ranks2.run(_automatic_rank):
        assert close and moved and since == 1


def test_load_window_counts_the_last_forwards_only():
    window = LoadWindow(num_experts=5, window=2, device=torch.device("cpu"))
    window.record(torch.tensor([[0, 1], [1, -1]]))
    window.record(torch.tensor([[4, 4]]))
    assert window.total().tolist() == [1, 2, 0, 0, 2]
    window.record(torch.tensor([[2, 3]]))  # the first forward leaves the window
    assert window.total().tolist() == [0, 0, 1, 1, 2]


def test_replica_table_prefers_the_own_rank_and_spreads_the_rest():
    # 6 experts on 3 ranks, 3 slots each: 0 on ranks 0 and 1, 1 and 5 on ranks 0 and 2.
    placement = Placement(torch.tensor([0, 1, 5, 0, 2, 3, 1, 4, 5]), num_logical=6, num_ranks=3)
    p2l = placement.physical_to_logical.tolist()
    table = ReplicaTable(placement, rank=2, device=torch.device("cpu"))
    ids = torch.tensor([[e, -1] for e in range(6) for _ in range(10)])  # 10 consecutive tokens each
    physical = table.to_physical(ids)
    assert (physical[:, 1] == -1).all()
    picks = {e: physical[ids[:, 0] == e, 0].tolist() for e in range(6)}
    assert all(p2l[p] == e for e, chosen in picks.items() for p in chosen)  # a replica of the same expert
    assert set(picks[1]) == {6} and set(picks[5]) == {8} and set(picks[4]) == {7}  # rank 2's own replicas
    assert sorted(picks[0]) == [0] * 5 + [3] * 5  # no replica here: spread evenly over both
    assert torch.equal(table.to_physical(ids), physical)  # deterministic


def _fp8_rebalance_rank(device):
    """FP8 experts: each slot's e4m3 weights and block scales arrive together, byte for byte."""
    cfg = get_preset("deepseek-v3").with_num_experts(8).replace(hidden_size=256, moe_intermediate_size=128)
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = MoELayer(cfg, dispatcher="alltoall", seed=3, expert_dtype="fp8", eplb=EPLBOptions(redundant_per_rank=1))
    reference = MoELayer(cfg, dispatcher="local", seed=3, expert_dtype="fp8")
    target = global_placement(zipf_load(cfg.num_experts, 1.5, seed=2), world, 1)
    report = layer.rebalance(target)
    names = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
    exact = all(
        torch.equal(
            getattr(layer.experts, n)[slot].view(torch.uint8), getattr(reference.experts, n)[e].view(torch.uint8)
        )
        for slot, e in enumerate(target.rank_logical_ids(rank))
        for n in names
    )
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        close = torch.allclose(layer(x), reference(x), rtol=1e-5, atol=1e-6)
    return exact, close, report.moved_bytes


def test_fp8_experts_move_with_their_scales(ranks2):
    per_slot = 3 * 256 * 128 + 4 * (2 * 1 * 2 + 2 * 1)  # e4m3 bytes + float32 block scales
    for exact, close, moved_bytes in ranks2.run(_fp8_rebalance_rank):
        assert exact and close
        assert moved_bytes > 0 and moved_bytes % per_slot == 0


def test_replica_table_prefers_the_own_node_before_other_nodes():
    # 8 experts on 4 ranks as 2 nodes of 2, 3 slots each.
    placement = Placement(torch.tensor([0, 1, 2, 3, 4, 5, 0, 6, 7, 1, 4, 6]), num_logical=8, num_ranks=4)
    ids = torch.tensor([[e] for e in range(8) for _ in range(6)])
    picks = {}
    for rank in (0, 3):
        table = ReplicaTable(placement, rank=rank, device=torch.device("cpu"), ranks_per_node=2)
        physical = table.to_physical(ids)[:, 0]
        picks[rank] = {e: sorted(set(physical[ids[:, 0] == e].tolist())) for e in range(8)}
    # Rank 3 (node 1): expert 0 lives on ranks 0 and 2 -> rank 2's; 1, 4 and 6 on rank 3 itself.
    assert picks[3] == {0: [6], 1: [9], 2: [2], 3: [3], 4: [10], 5: [5], 6: [11], 7: [8]}
    # Rank 0 (node 0): expert 6 has no replica on node 0 -> spread over ranks 2 and 3.
    assert picks[0][6] == [7, 11] and picks[0][0] == [0] and picks[0][4] == [4]


def _local_eplb_rank(device):
    """``local`` holds every expert on each rank: its placement is one rank's, whatever the group."""
    cfg = get_preset("tiny")
    layer = MoELayer(cfg, dispatcher="local", seed=4, eplb=EPLBOptions())
    plain = MoELayer(cfg, dispatcher="local", seed=4)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        return layer.placement.num_ranks, torch.equal(layer(x), plain(x))


def test_local_dispatcher_with_eplb_on_a_group_places_one_rank(ranks2):
    assert ranks2.run(_local_eplb_rank) == [(1, True), (1, True)]

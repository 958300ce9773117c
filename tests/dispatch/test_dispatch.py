"""Every dispatcher against ``local`` on 2 and 4 gloo ranks, for every routing kind and awkward case."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch.layout import combine_rows, group_rows_by_expert, pack_topk, unpack_topk
from moe_sbo.dispatch.records import Traffic
from moe_sbo.layer import MoELayer

ROUTINGS = {
    "noaux_tc": {},
    "group_limited_greedy": {
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 16.0,
    },
    "greedy": {"topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1},
}
# tokens per rank as a function of (rank, world size): the awkward cases the issue names.
EP_DISPATCHERS = ["allgather", "alltoall", "low_latency"]  # low_latency at its default capacity, 128
TOKEN_CASES = {
    "equal": lambda r, p: 8,
    "divide_nothing": lambda r, p: 7 + 6 * r,
    "zero_on_some_ranks": lambda r, p: 0 if r % 2 == 0 else 13,
    "zero_everywhere": lambda r, p: 0,
}


def test_traffic_adds_every_field():
    """``Traffic.__add__`` spells its fields out (it runs every combine): a field added later must
    be summed too."""
    a = Traffic(*(10**i for i in range(len(fields(Traffic)))))
    b = Traffic(*(3 * 10**i for i in range(len(fields(Traffic)))))
    total = a + b
    assert all(getattr(total, f.name) == getattr(a, f.name) + getattr(b, f.name) for f in fields(Traffic))


def test_layout_hand_worked():
    # Rows 0..2, K=2, L=3 local experts; -1 marks another rank's expert.
    ids = torch.tensor([[2, 0], [-1, 2], [1, -1]])
    weights = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    layout = group_rows_by_expert(ids, weights, 3)
    assert layout.row_R.tolist() == [0, 2, 0, 1]  # expert 0: row 0; expert 1: row 2; expert 2: rows 0, 1
    assert layout.num_rows_per_expert_L.tolist() == [1, 1, 2]
    torch.testing.assert_close(layout.weight_R, torch.tensor([0.2, 0.5, 0.1, 0.4]))
    assert layout.pair_MK.tolist() == [[2, 0], [4, 3], [1, 4]]  # the inverse; 4 = R: not local
    y = torch.arange(4, dtype=torch.float32)[:, None].repeat(1, 2)  # expert output of pair n = n
    torch.testing.assert_close(
        combine_rows(y, layout), torch.tensor([[0 * 0.2 + 2 * 0.1] * 2, [3 * 0.4] * 2, [1 * 0.5] * 2])
    )


def test_pack_topk_round_trips_weights_bit_exactly():
    ids, weights = torch.randint(-1, 300, (5, 8)), torch.randn(5, 8)
    back_ids, back_weights = unpack_topk(pack_topk(ids, weights))
    assert torch.equal(back_ids, ids) and torch.equal(back_weights, weights)


def _case_rank(device, dispatcher, routing, token_case, skew):
    cfg = get_preset("tiny").replace(**ROUTINGS[routing])
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = TOKEN_CASES[token_case](rank, world)
    generator = torch.Generator().manual_seed(1000 * world + 10 * rank + len(token_case))
    x = torch.randn(tokens, cfg.hidden_size, generator=generator)
    ref = MoELayer(cfg, dispatcher="local", dtype=torch.float32, seed=11)
    ep = MoELayer(cfg, dispatcher=dispatcher, dtype=torch.float32, seed=11)
    with torch.no_grad():
        if skew == "router":
            topk = ref.router(x)
            ids, weights = topk.topk_ids_TK, topk.topk_weights_TK
        else:
            # Every token picks the same experts: "one_expert" puts all rows on expert 0's rank,
            # "one_rank" keeps all K choices inside the last rank.
            first = 0 if skew == "one_expert" else cfg.num_experts - cfg.num_experts_per_tok
            ids = torch.arange(first, first + cfg.num_experts_per_tok).repeat(tokens, 1)
            weights = torch.rand(tokens, cfg.num_experts_per_tok, generator=generator)
        outputs = []
        for layer in (ref, ep):
            recv = layer.dispatcher.dispatch(x, ids, weights)
            y = layer.dispatcher.combine(layer.experts.forward_dispatched(recv), recv.handle)
            outputs.append(y)
        traffic = ep.dispatcher.last_traffic
    owners = torch.div(ids, ep.dispatcher.num_local_experts, rounding_mode="floor")
    remote_ranks = sum(len(set(row) - {rank}) for row in owners.tolist())
    return {
        "err": (outputs[0] - outputs[1]).abs().max().item() if tokens else 0.0,
        "shape_ok": outputs[1].shape == (tokens, cfg.hidden_size),
        "traffic": traffic,
        "remote_rows": remote_ranks,
        "tokens": tokens,
        "row_bytes": cfg.hidden_size * 4 + 2 * cfg.num_experts_per_tok * 4,
    }


def _check(results, dispatcher):
    for r in results:
        assert r["shape_ok"]
        assert r["err"] < 1e-5, r
    sent = sum(r["traffic"].dispatch_bytes_sent for r in results)
    recv = sum(r["traffic"].dispatch_bytes_recv for r in results)
    assert sent == recv  # every byte sent is received somewhere
    if dispatcher == "alltoall":
        # Each token goes once to each *remote* rank owning one of its experts: no more, no less.
        for r in results:
            assert r["traffic"].dispatch_bytes_sent == r["remote_rows"] * r["row_bytes"]
        assert sum(r["traffic"].combine_bytes_sent for r in results) == sum(
            r["remote_rows"] * (r["row_bytes"] - 2 * 4 * 4) for r in results
        )
    if dispatcher == "low_latency":
        # Fixed blocks: capacity rows to each other rank whatever the routing (row_bytes is 16-aligned).
        for r in results:
            assert r["traffic"].dispatch_bytes_sent == (len(results) - 1) * 128 * r["row_bytes"]
            assert r["traffic"].combine_bytes_sent == (len(results) - 1) * 128 * (r["row_bytes"] - 2 * 4 * 4)


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("token_case", sorted(TOKEN_CASES))
def test_dispatchers_match_local_on_4_ranks(ranks4, dispatcher, routing, token_case):
    _check(ranks4.run(_case_rank, dispatcher, routing, token_case, "router"), dispatcher)


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@pytest.mark.parametrize("skew", ["router", "one_expert", "one_rank"])
def test_dispatchers_match_local_on_2_ranks(ranks2, dispatcher, skew):
    _check(ranks2.run(_case_rank, dispatcher, "noaux_tc", "divide_nothing", skew), dispatcher)


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@pytest.mark.parametrize("skew", ["one_expert", "one_rank"])
def test_skewed_routing_on_4_ranks(ranks4, dispatcher, skew):
    _check(ranks4.run(_case_rank, dispatcher, "greedy", "zero_on_some_ranks", skew), dispatcher)


def _stamped_rank(device, dispatcher):
    """x = rank + 1 everywhere: every received row must name a rank that really sent it."""
    cfg = get_preset("tiny")
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = MoELayer(cfg, dispatcher=dispatcher, dtype=torch.float32, seed=2)
    tokens = 3 + rank
    x = torch.full((tokens, cfg.hidden_size), float(rank + 1))
    # Token t of rank r picks experts owned by ranks (r + t) % P and (r + t + 1) % P.
    local = cfg.num_experts // world
    ids = (
        torch.stack([((rank + t) % world) * local + torch.arange(2) for t in range(tokens)] + [])
        if False
        else torch.tensor(
            [
                [
                    ((rank + t) % world) * local,
                    ((rank + t) % world) * local + 1,
                    ((rank + t + 1) % world) * local,
                    ((rank + t + 1) % world) * local + 1,
                ]
                for t in range(tokens)
            ]
        )
    )
    with torch.no_grad():
        recv = layer.dispatcher.dispatch(x, ids, torch.ones(tokens, 4))
    # Rows past the real count are padding (low_latency's fixed layout); the other schemes have none.
    real_x_RH = recv.expert_x_RH[: int(recv.num_rows_per_expert_L.sum())]
    sources = sorted(set(real_x_RH[:, 0].tolist()))
    # Which ranks' tokens chose one of my experts, computed from the rule above:
    expected = sorted(
        {float(r + 1) for r in range(world) for t in range(3 + r) if rank in ((r + t) % world, (r + t + 1) % world)}
    )
    rows_constant = bool((real_x_RH == real_x_RH[:, :1]).all())
    return sources, expected, rows_constant, recv.num_rows_per_expert_L.tolist()


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
def test_rank_stamped_rows_reach_the_right_experts(ranks4, dispatcher):
    for sources, expected, rows_constant, per_expert in ranks4.run(_stamped_rank, dispatcher):
        assert sources == expected and rows_constant
        # Experts 0 and 1 of each rank get every row sent here; experts 2, 3 none.
        assert per_expert[0] == per_expert[1] > 0 and per_expert[2:] == [0, 0]

"""DeepEP 1.x's ``tests/test_internode.py``, ported to ``moe_sbo.deep_ep`` on gloo CPU ranks that act
as two nodes (``MOE_SBO_RANKS_PER_NODE``), so the normal mode runs over ``node_aware``.

``test_main`` below is DeepEP's where it checks results; what changed:

====================================================  ==========  =============================================
check                                                 status      why
====================================================  ==========  =============================================
get_dispatch_layout: per-rank, per-RDMA-rank (node),  unchanged
per-expert counts, is_token_in_rank
received row count == global tokens for this rank     unchanged
per-expert received counts == global expert counts    unchanged
rows stamped by source rank, in                       unchanged   ``handle[-4]`` is the received prefix sum, as
recv_gbl_rank_prefix_sum order (check_data)                       in DeepEP
recv_topk_idx in [-1, L) and per-expert counts        unchanged
recv_topk_weights stamped by source rank              unchanged
num_worst_tokens: padded sizes, equal prefix, -1 tail unchanged
cached dispatch (handle) delivers the same rows       unchanged
combine with two biases (calc_diff < 5e-6)            unchanged
combine: top-k weights summed (calc_diff < 1e-9)      unchanged
FP8 input, rank-stamped and random                    unchanged
same seed -> same hash of every received tensor       adapted     DeepEP's pressure test (21 runs) cut to two
grouped routing over nodes (create_grouped_scores)    unchanged
nodes: 8 GPUs per node, several hosts                 adapted     2 "nodes" of 1, 2 or 4 CPU ranks
                                                                  (``MOE_SBO_RANKS_PER_NODE``)
shapes; previous/async loops at EP8                   adapted     small shapes; EP8 runs one of the four loops
tuning sweeps and bench_kineto timings                dropped     timings of DeepEP's kernels, no checks
====================================================  ==========  =============================================

Counts: 12 checks unchanged, 3 adapted (pressure test, nodes, shapes), 1 block dropped (timing only).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from deep_ep_utils import (
    calc_diff,
    create_grouped_scores,
    hash_tensor,
    inplace_unique,
    per_token_cast_back,
    per_token_cast_to_fp8,
)

import moe_sbo.deep_ep as deep_ep

ALL_MODES = ((False, False), (False, True), (True, False), (True, True))


# noinspection PyShadowingNames
def test_main(
    args: dict,
    num_sms: int,
    local_rank: int,
    num_local_ranks: int,
    num_ranks: int,
    num_nodes: int,
    rank: int,
    buffer: deep_ep.Buffer,
    group,
    device: str,
    modes: tuple = ALL_MODES,
) -> int:
    # Settings
    num_tokens, hidden = args["num_tokens"], args["hidden"]
    num_topk_groups, num_topk, num_experts = args["num_topk_groups"], args["num_topk"], args["num_experts"]

    assert num_experts % num_ranks == 0

    # Random data
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_pure_rand_e4m3 = per_token_cast_to_fp8(x_pure_rand)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    group_scores = scores.view(num_tokens, num_nodes, -1).amax(dim=-1)
    group_idx = torch.topk(group_scores, k=num_topk_groups, dim=-1, sorted=False).indices
    masked_scores = create_grouped_scores(scores, group_idx, num_nodes)
    topk_idx = torch.topk(masked_scores, num_topk, dim=-1, largest=True, sorted=False)[1]
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32, device=device) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device)
    rank_idx = topk_idx // (num_experts // num_ranks)
    rank_idx = rank_idx.to(torch.int64)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)
    rdma_rank_idx = rank_idx // num_local_ranks
    rdma_rank_idx.masked_fill_(rank_idx == -1, -1)
    inplace_unique(rdma_rank_idx, num_nodes)
    hash_value = 0

    # Expert meta
    num_tokens_per_expert = torch.zeros((num_experts,), dtype=torch.int, device=device)
    for i in range(num_experts):
        num_tokens_per_expert[i] = (topk_idx == i).sum()
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert, group=group)

    # Rank layout meta
    num_tokens_per_rank = torch.empty((num_ranks,), dtype=torch.int, device=device)
    num_tokens_per_rdma_rank = torch.empty((num_nodes,), dtype=torch.int, device=device)
    token_idx_in_rank = torch.full((num_ranks, num_tokens), -1, dtype=torch.long, device=device)
    for i in range(num_ranks):
        num_tokens_per_rank[i] = (rank_idx == i).sum()
        token_sel = (rank_idx == i).max(dim=-1)[0]
        count = token_sel.sum().item()
        tokens = torch.sort(token_sel.to(torch.int), descending=True)[1]
        tokens[:count] = torch.sort(tokens[:count])[0]
        token_idx_in_rank[i][tokens[:count]] = torch.arange(count, dtype=torch.long, device=device)
    for i in range(num_nodes):
        num_tokens_per_rdma_rank[i] = (rdma_rank_idx == i).sum()
    token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
    is_token_in_rank = token_idx_in_rank >= 0
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank, group=group)

    ref_num_tokens_per_rank, ref_num_tokens_per_rdma_rank, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = (
        buffer.get_dispatch_layout(topk_idx, num_experts)
    )
    assert torch.allclose(ref_num_tokens_per_rank, num_tokens_per_rank)
    assert torch.allclose(ref_num_tokens_per_rdma_rank, num_tokens_per_rdma_rank)
    assert torch.allclose(ref_num_tokens_per_expert, num_tokens_per_expert)
    assert torch.allclose(ref_is_token_in_rank, is_token_in_rank)

    # Config
    rdma_buffer_size, nvl_buffer_size = 128, (720 if num_ranks in (24, 48, 96, 144, 160) else 512)
    config = deep_ep.Config(num_sms, 8, nvl_buffer_size, 16, rdma_buffer_size)

    # Test dispatch
    # noinspection PyShadowingNames
    def check_data(check_x, recv_gbl_rank_prefix_sum):
        assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
        check_start = 0
        for i in range(num_ranks):
            check_end = recv_gbl_rank_prefix_sum[i].item()
            assert (check_x[check_start:check_end, :].int() - i).sum().item() == 0
            check_start = check_end

    for previous_mode, async_mode in modes:
        for current_x in (x_pure_rand, x, x_pure_rand_e4m3, x_e4m3):
            for with_topk in (False, True):
                is_rand = current_x is x_pure_rand or current_x is x_pure_rand_e4m3
                dispatch_args = {
                    "x": current_x,
                    "num_tokens_per_rank": num_tokens_per_rank,
                    "num_tokens_per_rdma_rank": num_tokens_per_rdma_rank,
                    "is_token_in_rank": is_token_in_rank,
                    "num_tokens_per_expert": num_tokens_per_expert,
                    "config": config,
                    "async_finish": async_mode,
                }
                if with_topk:
                    dispatch_args.update(
                        {"topk_idx": topk_idx, "topk_weights": topk_weights_pure_rand if is_rand else topk_weights}
                    )
                if previous_mode:
                    dispatch_args.update({"previous_event": buffer.capture()})
                recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = (
                    buffer.dispatch(**dispatch_args)
                )
                event.current_stream_wait() if async_mode else ()

                if current_x is x_pure_rand or current_x is x:
                    hash_value += hash_tensor(recv_x)
                else:
                    hash_value += hash_tensor(recv_x[0])
                    hash_value += hash_tensor(recv_x[1])

                recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                # Checks
                recv_gbl_rank_prefix_sum = handle[-4]
                assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0), (
                    f"{gbl_num_tokens_per_rank[rank].item()} != {recv_x.size(0)}"
                )
                assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == recv_num_tokens_per_expert_list
                if not is_rand:
                    check_data(recv_x, recv_gbl_rank_prefix_sum)
                recv_topk_weights_clone = None
                if with_topk:
                    # Check `topk_idx`
                    assert (
                        recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < (num_experts // num_ranks)))
                    ).sum().item() == recv_topk_idx.numel()
                    for i, count in enumerate(recv_num_tokens_per_expert_list):
                        assert recv_topk_idx.eq(i).sum().item() == count

                    # Check `topk_weights`
                    recv_topk_weights_clone = recv_topk_weights.clone()
                    if not is_rand:
                        recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(
                            recv_topk_weights
                        )[recv_topk_idx.eq(-1)]
                        check_data(recv_topk_weights, recv_gbl_rank_prefix_sum)

                # Test `num_worst_tokens != 0`
                if with_topk:
                    num_worst_tokens = num_tokens * num_ranks
                    dispatch_args.update({"num_worst_tokens": num_worst_tokens})
                    recv_worst_x, recv_worst_topk_idx, recv_worst_topk_weights, empty_list, _, event = buffer.dispatch(
                        **dispatch_args
                    )
                    event.current_stream_wait() if async_mode else ()
                    recv_worst_x = (
                        per_token_cast_back(*recv_worst_x) if isinstance(recv_worst_x, tuple) else recv_worst_x
                    )
                    assert len(empty_list) == 0
                    assert num_worst_tokens == recv_worst_x.size(0)
                    assert num_worst_tokens == recv_worst_topk_idx.size(0)
                    assert num_worst_tokens == recv_worst_topk_weights.size(0)
                    assert torch.equal(recv_x, recv_worst_x[: recv_x.size(0)])
                    assert torch.equal(recv_topk_idx, recv_worst_topk_idx[: recv_x.size(0)])
                    assert torch.equal(recv_topk_weights_clone, recv_worst_topk_weights[: recv_x.size(0)])
                    assert torch.all(recv_worst_topk_idx[recv_x.size(0) :] == -1).item()

                # Test cached dispatch (must without top-k staffs)
                if not with_topk:
                    dispatch_args = {"x": current_x, "handle": handle, "config": config, "async_finish": async_mode}
                    if previous_mode:
                        dispatch_args.update({"previous_event": buffer.capture()})
                    recv_x, _, _, _, _, event = buffer.dispatch(**dispatch_args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                    if not is_rand:
                        check_data(recv_x, recv_gbl_rank_prefix_sum)

                # Test combine
                bias_0 = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device)
                bias_1 = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device)
                combine_args = {
                    "x": recv_x,
                    "bias": (bias_0, bias_1),
                    "handle": handle,
                    "config": config,
                    "async_finish": async_mode,
                }
                if with_topk:
                    combine_args.update({"topk_weights": recv_topk_weights})
                if previous_mode:
                    combine_args.update({"previous_event": buffer.capture()})
                combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                event.current_stream_wait() if async_mode else ()
                check_x = (combined_x.float() - bias_0.float() - bias_1.float()) / is_token_in_rank.sum(
                    dim=1
                ).unsqueeze(1)
                ref_x = x_pure_rand if is_rand else x
                assert calc_diff(check_x, ref_x) < 5e-4 if current_x is x_pure_rand_e4m3 else 5e-6
                if with_topk:
                    check_topk_weights = (
                        combined_topk_weights
                        if is_rand
                        else (combined_topk_weights / is_token_in_rank.sum(dim=1).unsqueeze(1))
                    )
                    ref_topk_weights = topk_weights_pure_rand if is_rand else topk_weights
                    assert calc_diff(check_topk_weights, ref_topk_weights) < 1e-9

                hash_value += hash_tensor(recv_x)
    return hash_value


test_main.__test__ = False  # DeepEP's name, kept; called by the rank function, not collected by pytest


def internode_rank(device, args: dict, ranks_per_node: int, modes: tuple, runs: int) -> bool:
    """DeepEP's ``test_loop`` on one rank: ``ranks_per_node`` consecutive ranks form a node (DeepEP: 8
    GPUs of a host), its pressure test cut to ``runs`` runs with the same seed."""
    rank, num_ranks, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    num_nodes = num_ranks // ranks_per_node
    previous = os.environ.get("MOE_SBO_RANKS_PER_NODE")
    os.environ["MOE_SBO_RANKS_PER_NODE"] = str(ranks_per_node)
    try:
        buffer = deep_ep.Buffer(
            group, int(2e9), int(1e9), low_latency_mode=False, num_qps_per_rank=24, explicitly_destroy=True
        )
    finally:
        if previous is None:
            del os.environ["MOE_SBO_RANKS_PER_NODE"]
        else:
            os.environ["MOE_SBO_RANKS_PER_NODE"] = previous
    assert buffer.num_nodes == num_nodes > 1
    args = dict(args, num_topk_groups=min(num_nodes, 4))
    ref_hash = None
    for _ in range(runs):
        torch.manual_seed(rank)
        current = test_main(
            args,
            24,
            rank % ranks_per_node,
            ranks_per_node,
            num_ranks,
            num_nodes,
            rank,
            buffer,
            group,
            str(device),
            modes,
        )
        assert ref_hash is None or current == ref_hash
        ref_hash = current
    buffer.destroy()
    dist.barrier()
    return True


SMALL = {"num_tokens": 20, "hidden": 256, "num_topk": 4}


def test_internode_ep2_two_nodes(ranks2):
    assert all(ranks2.run(internode_rank, dict(SMALL, num_experts=8), 1, ALL_MODES, 2))


def test_internode_ep4_two_nodes(ranks4):
    assert all(ranks4.run(internode_rank, dict(SMALL, num_experts=16), 2, ((False, True), (True, False)), 1))


def test_internode_ep8_two_nodes(ranks8):
    assert all(ranks8.run(internode_rank, dict(SMALL, num_tokens=12, num_experts=16), 4, ((True, True),), 1))

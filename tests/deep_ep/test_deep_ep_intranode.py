"""DeepEP 1.x's ``tests/test_intranode.py``, ported to ``moe_sbo.deep_ep`` on gloo CPU ranks.

``test_main`` below is DeepEP's, line for line where it checks results; what changed:

====================================================  ==========  =============================================
check                                                 status      why
====================================================  ==========  =============================================
get_dispatch_layout: per-rank, per-expert counts,     unchanged
is_token_in_rank against the test's own reckoning
received row count == global tokens for this rank     unchanged
per-expert received counts == global expert counts    unchanged
received rows stamped by source rank, in              unchanged   ``handle[0]`` is the rank prefix matrix, as
rank_prefix_matrix order (check_data)                             in DeepEP
recv_topk_idx in [-1, L) and per-expert counts        unchanged
recv_topk_weights stamped by source rank              unchanged
num_worst_tokens: padded sizes, equal prefix, -1 tail unchanged
cached dispatch (handle) delivers the same rows       unchanged
combine: x * ranks reached (calc_diff < 5e-6)         unchanged
combine: top-k weights summed (calc_diff < 1e-9)      unchanged
FP8 (e4m3, column-major scales) dispatch              unchanged   ``is_sm90_compiled()`` is True: fp8 rows move
                                                                  as bytes
low-latency functions after normal mode               unchanged   DeepEP's ``test_ll_compatibility`` switch on
(clean_low_latency_buffer, then test_low_latency)                 (off by default there), at EP2
devices: 'cuda' -> the ranks' device                  adapted     gloo CPU ranks here, ranks sharing a GPU in
                                                                  the gpu-marked variant
shapes: 4096 tokens x 7168, 256 experts, top-8        adapted     small shapes (the CPU suite's time budget)
previous/async loops at EP8                           adapted     async and previous events are no-ops on CPU;
                                                                  EP8 runs one of the four (time budget)
tuning sweeps of Config / SM counts, bench() timings  dropped     they time DeepEP's kernels and check nothing;
                                                                  Configs are accepted and change nothing
====================================================  ==========  =============================================

Counts: 12 checks unchanged, 3 adapted (start-up, shapes, loops), 1 block dropped (timing only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deep_ep_utils import calc_diff, inplace_unique, per_token_cast_back, per_token_cast_to_fp8

import moe_sbo.deep_ep as deep_ep

SMALL = {"num_tokens": 24, "hidden": 256, "num_topk": 4}


# noinspection PyShadowingNames
def test_main(
    args: dict,
    num_sms: int,
    local_rank: int,
    num_ranks: int,
    rank: int,
    buffer: deep_ep.Buffer,
    group,
    device: str,
    modes: tuple = ((False, False), (False, True), (True, False), (True, True)),
) -> None:
    # Settings
    num_tokens, hidden = args["num_tokens"], args["hidden"]
    num_topk, num_experts = args["num_topk"], args["num_experts"]

    assert num_experts % num_ranks == 0

    # Random data
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    x_e4m3 = per_token_cast_to_fp8(x) if deep_ep.Buffer.is_sm90_compiled() else None
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T) if x_e4m3 is not None else None
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1]
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32, device=device) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device)
    rank_idx = topk_idx // (num_experts // num_ranks)
    rank_idx = rank_idx.to(torch.int64)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)

    # Expert meta
    num_tokens_per_expert = torch.zeros((num_experts,), dtype=torch.int, device=device)
    for i in range(num_experts):
        num_tokens_per_expert[i] = (topk_idx == i).sum()
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert, group=group)

    # Rank layout meta
    num_tokens_per_rank = torch.empty((num_ranks,), dtype=torch.int, device=device)
    token_idx_in_rank = torch.full((num_ranks, num_tokens), -1, dtype=torch.long, device=device)
    for i in range(num_ranks):
        num_tokens_per_rank[i] = (rank_idx == i).sum()
        token_sel = (rank_idx == i).max(dim=-1)[0]
        count = token_sel.sum().item()
        tokens = torch.sort(token_sel.to(torch.int), descending=True)[1]
        tokens[:count] = torch.sort(tokens[:count])[0]
        token_idx_in_rank[i][tokens[:count]] = torch.arange(count, dtype=torch.long, device=device)
    token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
    is_token_in_rank = token_idx_in_rank >= 0
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank, group=group)

    ref_num_tokens_per_rank, _, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, num_experts
    )
    assert torch.allclose(ref_num_tokens_per_rank, num_tokens_per_rank)
    assert torch.allclose(ref_num_tokens_per_expert, num_tokens_per_expert)
    assert torch.allclose(ref_is_token_in_rank, is_token_in_rank)

    # Config
    nvl_buffer_size = 256
    config = deep_ep.Config(num_sms, 8, nvl_buffer_size)

    # Test dispatch
    # noinspection PyShadowingNames
    def check_data(check_x, rank_prefix_matrix):
        assert torch.allclose(check_x.amin(dim=1), check_x.amax(dim=1))
        check_start = 0
        for i in range(num_ranks):
            check_end = rank_prefix_matrix[i][rank].item()
            assert (check_x[check_start:check_end, :].int() - i).sum().item() == 0
            check_start = check_end

    for previous_mode, async_mode in modes:
        for current_x in filter(lambda elem: elem is not None, (x_pure_rand, x, x_e4m3)):
            for with_topk in (False, True):
                dispatch_args = {
                    "x": current_x,
                    "num_tokens_per_rank": num_tokens_per_rank,
                    "is_token_in_rank": is_token_in_rank,
                    "num_tokens_per_expert": num_tokens_per_expert,
                    "config": config,
                    "async_finish": async_mode,
                }
                if with_topk:
                    dispatch_args.update(
                        {
                            "topk_idx": topk_idx,
                            "topk_weights": topk_weights_pure_rand if current_x is x_pure_rand else topk_weights,
                        }
                    )
                if previous_mode:
                    dispatch_args.update({"previous_event": buffer.capture()})
                recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = (
                    buffer.dispatch(**dispatch_args)
                )
                event.current_stream_wait() if async_mode else ()
                recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                # Checks
                rank_prefix_matrix = handle[0]
                assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0), (
                    f"{gbl_num_tokens_per_rank[rank].item()} != {recv_x.size(0)}"
                )
                assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == recv_num_tokens_per_expert_list
                if current_x is not x_pure_rand:
                    check_data(recv_x, rank_prefix_matrix)
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
                    if current_x is not x_pure_rand:
                        recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(
                            recv_topk_weights
                        )[recv_topk_idx.eq(-1)]
                        check_data(recv_topk_weights, rank_prefix_matrix)

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
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix)

                # Test combine
                combine_args = {"x": recv_x, "handle": handle, "config": config, "async_finish": async_mode}
                if with_topk:
                    combine_args.update({"topk_weights": recv_topk_weights})
                if previous_mode:
                    combine_args.update({"previous_event": buffer.capture()})
                combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                event.current_stream_wait() if async_mode else ()
                check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
                ref_x = x_pure_rand if current_x is x_pure_rand else x
                assert calc_diff(check_x, ref_x) < 5e-6
                if with_topk:
                    check_topk_weights = (
                        combined_topk_weights
                        if (current_x is x_pure_rand)
                        else (combined_topk_weights / is_token_in_rank.sum(dim=1).unsqueeze(1))
                    )
                    ref_topk_weights = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                    assert calc_diff(check_topk_weights, ref_topk_weights) < 1e-9


test_main.__test__ = False  # DeepEP's name, kept; called by the rank function, not collected by pytest


def intranode_rank(device, args: dict, modes: tuple, test_ll_compatibility: bool) -> bool:
    """DeepEP's ``test_loop`` on one rank, its start-up replaced by the rank fixture's group."""
    from test_deep_ep_low_latency import test_main as low_latency_test_main

    rank, num_ranks, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    ll_num_tokens, ll_hidden, ll_num_experts, ll_num_topk = 8, 256, 4 * num_ranks, 3
    num_rdma_bytes = 0
    if test_ll_compatibility:
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            ll_num_tokens, ll_hidden, num_ranks, ll_num_experts
        )
    buffer = deep_ep.Buffer(
        group,
        int(2e9),
        num_rdma_bytes,
        low_latency_mode=test_ll_compatibility,
        num_qps_per_rank=(ll_num_experts // num_ranks if test_ll_compatibility else 1),
        explicitly_destroy=True,
    )
    torch.manual_seed(rank)
    test_main(args, 24, rank, num_ranks, rank, buffer, group, str(device), modes)
    if test_ll_compatibility:
        buffer.clean_low_latency_buffer(ll_num_tokens, ll_hidden, ll_num_experts)
        low_latency_test_main(
            ll_num_tokens, ll_hidden, ll_num_experts, ll_num_topk, rank, num_ranks, group, buffer, str(device), seed=1
        )
    buffer.destroy()
    dist.barrier()
    return True


def test_intranode_ep2(ranks2):
    args = dict(SMALL, num_experts=8)
    assert all(ranks2.run(intranode_rank, args, ((False, False), (False, True), (True, False), (True, True)), True))


def test_intranode_ep4(ranks4):
    args = dict(SMALL, num_experts=16)
    assert all(ranks4.run(intranode_rank, args, ((False, False), (True, True)), False))


def test_intranode_ep8(ranks8):
    args = dict(SMALL, num_tokens=16, num_experts=16)
    assert all(ranks8.run(intranode_rank, args, ((True, True),), False))

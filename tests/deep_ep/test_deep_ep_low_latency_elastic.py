"""DeepEP's ``tests/test_low_latency_elastic.py`` (its pre-release elastic mode, released as shrink
mode: ``enable_shrink``, whose checks moved into ``tests/test_low_latency.py --shrink-test``), ported
to ``moe_sbo.deep_ep`` on 8 gloo CPU ranks.

Ranks 1, 3 and 5 stop (destroy their buffer and return) before the dispatch of round 1, the combine
of round 3 and the clean of round 5; after every call each survivor's mask buffer must name exactly
the ranks stopped so far, the dispatch must count and hold exactly the unmasked ranks' rows, and the
combine must equal x times the sum of the weights of the experts of unmasked ranks. ``api_loop`` below
is DeepEP's where it checks results; what changed:

=====================================================  ==========  ===========================================
check                                                  status      why
=====================================================  ==========  ===========================================
mask buffer == ranks stopped so far, after each        unchanged
dispatch, combine and clean
recv_count == cumulative_local_expert_recv_stats       unchanged
recv_count == sum of the layout ranges' counts         unchanged
recv_count == choices of the expert by unmasked ranks  unchanged
rows stamped by source rank: amin == amax per row      unchanged
rows per unmasked source rank == its choices           unchanged
rows inside each layout range come from that rank      unchanged
row token column == handle[0] (src_info)               adapted     as in test_deep_ep_low_latency.py: each
                                                                   range's token columns must be exactly the
                                                                   tokens of that rank choosing the expert
combine == x * sum of weights of unmasked experts,     unchanged   bf16 and fp8, zero-copy, receive hook
no NaN
clean_mask_buffer unmasks every rank                   unchanged
round_scale / use_ue8m0 / use_logfmt variants          dropped     refused (test_deep_ep_low_latency.py checks
                                                                   the refusals)
every parameter combination, 10 rounds, sleep 2 s      adapted     two combinations (bf16 with a receive hook
                                                                   and zero-copy; fp8 without), 6 rounds each
a stopped rank detected by DeepEP's kernel timeout     adapted     by the ranks' wait bound (2 s here) and the
                                                                   buffer's destroy telling the others at once
=====================================================  ==========  ===========================================

Counts: 10 checks unchanged, 3 adapted, 1 block dropped. Transfers complete inside each call in shrink
mode, so a receive hook has nothing left to do (it is still called).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from deep_ep_utils import all_gather_stacked, calc_diff, hash_tensor, per_token_cast_back

import moe_sbo.deep_ep as deep_ep
from moe_sbo.launch.ranks import LocalRanks

WAIT_BOUND_S = 2.0  # how long the ranks wait for a rank that stopped, before they mask it

failure_cases = {
    # round -> [rank, api]
    1: [1, "dispatch"],
    3: [3, "combine"],
    5: [5, "clean"],
}


def api_loop(
    num_tokens,
    hidden,
    num_experts,
    rank,
    num_ranks,
    rank_offset,
    x,
    topk_idx,
    all_topk_idx,
    topk_weights,
    return_recv_hook,
    dispatch_use_fp8,
    zero_copy,
    buffer_params,
    device,
    test_rounds=6,
    dispatch_check_recv_data=True,
):
    buffer = deep_ep.Buffer(**buffer_params)
    num_local_experts = num_experts // num_ranks
    hash_value = 0
    mask_status = torch.zeros((num_ranks,), dtype=torch.int, device=device)
    expected_failed_ranks = set()

    def simulate_failure_and_exit(r, api):
        if r in failure_cases and failure_cases[r][1] == api:
            if rank == failure_cases[r][0]:
                buffer.destroy()
                return True
            expected_failed_ranks.add(failure_cases[r][0])
        return False

    def check_mask_buffer_query(r, api):
        buffer.low_latency_query_mask_buffer(mask_status)
        detected_failed_ranks = set(mask_status.nonzero().squeeze(-1).tolist())
        assert expected_failed_ranks == detected_failed_ranks, f"{api} round {r}: {detected_failed_ranks}"

    def check_mask_buffer_clean():
        buffer.low_latency_clean_mask_buffer()
        buffer.low_latency_query_mask_buffer(mask_status)
        assert len(set(mask_status.nonzero().squeeze(-1).tolist())) == 0

    for r in range(test_rounds):
        # Dispatch
        if simulate_failure_and_exit(r, "dispatch"):
            return "stopped"

        cumulative_local_expert_recv_stats = torch.zeros((num_local_experts,), dtype=torch.int, device=device)
        packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
            x,
            topk_idx,
            num_tokens,
            num_experts,
            use_fp8=dispatch_use_fp8,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            async_finish=not return_recv_hook,
            return_recv_hook=return_recv_hook,
        )
        hook() if return_recv_hook else event.current_stream_wait()

        check_mask_buffer_query(r, "dispatch")

        packed_recv_x = (packed_recv_x[0], packed_recv_x[1].contiguous()) if dispatch_use_fp8 else packed_recv_x
        simulated_gemm_x = (
            per_token_cast_back(packed_recv_x[0].view(-1, hidden), packed_recv_x[1].view(-1, hidden // 128)).view(
                packed_recv_x[0].shape
            )
            if dispatch_use_fp8
            else packed_recv_x.clone()
        )

        # Check dispatch result correctness
        for i in range(num_local_experts):
            expert_id = rank * num_local_experts + i
            recv_x = (
                per_token_cast_back(packed_recv_x[0][i], packed_recv_x[1][i]) if dispatch_use_fp8 else packed_recv_x[i]
            )
            recv_count, recv_layout_range = packed_recv_count[i], handle[1][i]

            # Check expert indices
            int_mask = (2**32) - 1
            num_valid_tokens = recv_count.item()
            assert cumulative_local_expert_recv_stats[i].item() == num_valid_tokens
            assert num_valid_tokens == (recv_layout_range & int_mask).sum().item()
            assert num_valid_tokens == (all_topk_idx == expert_id).sum(dim=[1, 2])[mask_status == 0].sum().item()

            if num_valid_tokens == 0:
                continue
            # Check received data
            if dispatch_check_recv_data:
                recv_x = recv_x[:num_valid_tokens]
                recv_x_amin = recv_x[:, :-128].amin(dim=-1)
                assert torch.equal(recv_x_amin, recv_x[:, :-128].amax(dim=-1))
                for j in range(num_ranks):
                    if mask_status[j]:
                        continue
                    begin_idx, count = (recv_layout_range[j] >> 32).item(), (recv_layout_range[j] & int_mask).item()
                    assert (recv_x_amin == j - rank_offset).sum().item() == (all_topk_idx[j] == expert_id).sum().item()
                    assert (recv_x[begin_idx : begin_idx + count, :-128] - j + rank_offset).sum().item() == 0
                    # Adapted (src_info): the token column names rank j's tokens choosing the expert.
                    token_column = recv_x[begin_idx : begin_idx + count, -128:]
                    chosen = (all_topk_idx[j] == expert_id).any(dim=1).nonzero().squeeze(1)
                    assert torch.equal(token_column[:, 0].float().sort().values, chosen.float())
            if dispatch_use_fp8:
                hash_value ^= hash_tensor(packed_recv_x[0][i, :num_valid_tokens])
                hash_value ^= hash_tensor(packed_recv_x[1][i, :num_valid_tokens])
            else:
                hash_value ^= hash_tensor(packed_recv_x[i, :num_valid_tokens])

        # Combine
        if simulate_failure_and_exit(r, "combine"):
            return "stopped"

        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated_gemm_x
        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
        combined_x, event, hook = buffer.low_latency_combine(
            simulated_gemm_x,
            topk_idx,
            topk_weights,
            handle,
            async_finish=not return_recv_hook,
            zero_copy=zero_copy,
            return_recv_hook=return_recv_hook,
            out=out,
        )
        hook() if return_recv_hook else event.current_stream_wait()
        check_mask_buffer_query(r, "combine")

        # Check combine result correctness
        owner_by_expert = torch.arange(num_experts, device=device) // num_local_experts
        fail_owner_mask = (mask_status == 1).index_select(0, owner_by_expert)
        valid_topk_idx = topk_idx >= 0
        failed_topk_idx = torch.zeros_like(topk_idx, device=device, dtype=torch.bool)
        failed_topk_idx[valid_topk_idx] = fail_owner_mask.index_select(0, topk_idx[valid_topk_idx])
        new_topk_idx = topk_idx.clone()
        new_topk_idx[failed_topk_idx] = -1
        diff = calc_diff(x * topk_weights.masked_fill(new_topk_idx == -1, 0).sum(dim=1).view(-1, 1), combined_x)
        assert torch.isnan(combined_x).sum().item() == 0
        assert diff < (9e-4 if dispatch_use_fp8 else 1e-5), f"Error: {diff=}, {dispatch_use_fp8=}, {zero_copy=}"
        hash_value ^= hash_tensor(combined_x)

        # Clean low latency buffer, without correctness checking
        if simulate_failure_and_exit(r, "clean"):
            return "stopped"
        buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)
        check_mask_buffer_query(r, "clean")

    check_mask_buffer_clean()
    buffer.destroy()
    return sorted(expected_failed_ranks)


def elastic_rank(device, num_tokens, hidden, num_topk, num_experts, return_recv_hook, dispatch_use_fp8, zero_copy):
    """DeepEP's ``test_main`` for one parameter combination on one rank (start-up: the ranks' group)."""
    rank, num_ranks, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    torch.manual_seed(1 + rank)
    rank_offset = 128
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device) * (rank - rank_offset)
    x[:, -128:] = torch.arange(num_tokens, device=device).to(torch.bfloat16).view(-1, 1)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device).abs()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):  # randomly mask some positions
        row, column = (
            torch.randint(num_tokens, (1,), generator=generator),
            torch.randint(num_topk, (1,), generator=generator),
        )
        topk_idx[row, column] = -1
    all_topk_idx = all_gather_stacked(topk_idx, group)
    buffer_params = {
        "group": group,
        "num_rdma_bytes": deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts),
        "low_latency_mode": True,
        "num_qps_per_rank": num_experts // num_ranks,
        "explicitly_destroy": True,
        "enable_elastic": True,
    }
    return api_loop(
        num_tokens,
        hidden,
        num_experts,
        rank,
        num_ranks,
        rank_offset,
        x,
        topk_idx,
        all_topk_idx,
        topk_weights,
        return_recv_hook,
        dispatch_use_fp8,
        zero_copy,
        buffer_params,
        str(device),
    )


@pytest.mark.parametrize(
    ("return_recv_hook", "dispatch_use_fp8", "zero_copy"), [(True, False, True), (False, True, False)]
)
def test_low_latency_elastic_ep8(return_recv_hook, dispatch_use_fp8, zero_copy):
    # Each combination on fresh ranks: the wait for a stopped rank leaves the whole group's gloo
    # pairs behind (the survivors go on in groups of their own).
    with LocalRanks(8, device="cpu", collective_timeout_s=WAIT_BOUND_S) as ranks:
        answers = ranks.run(elastic_rank, 6, 256, 2, 16, return_recv_hook, dispatch_use_fp8, zero_copy)
    assert [answers[r] for r in (1, 3, 5)] == ["stopped"] * 3
    assert [answers[r] for r in (0, 2, 4, 6, 7)] == [[1, 3, 5]] * 5

"""What the ported DeepEP tests do not reach: moe-sbo's six hook events on both modes of the compatible
``Buffer``, -1 ids in normal mode (a token with fewer ranks, or none), the low-latency path against
moe-sbo's own ``low_latency`` dispatcher on the same inputs, and the refusals (one clear
``ValueError`` or ``TypeError`` each, raised alike on every rank so none is left waiting)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_sbo.deep_ep as deep_ep
from moe_sbo.dispatch import EPGroup, make_dispatcher
from moe_sbo.hooks import HOOK_EVENTS


def _hooks_rank(device) -> list[list[str]]:
    group, rank = dist.group.WORLD, dist.get_rank()
    buffer = deep_ep.Buffer(group, low_latency_mode=True)
    seen: list[str] = []
    for event in HOOK_EVENTS:
        buffer.hooks.register(event, lambda d, payload, event=event: seen.append(event))
    torch.manual_seed(rank)
    num_experts, x = 8, torch.randn(6, 128, dtype=torch.bfloat16)
    topk_idx = torch.randint(0, num_experts, (6, 1)).expand(6, 2).clone()
    topk_idx[:, 1] = (topk_idx[:, 0] + 1) % num_experts
    weights = torch.rand(6, 2)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=weights,
    )
    normal = list(seen)
    buffer.combine(recv_x, handle, topk_weights=recv_w)
    normal_all = list(seen)
    seen.clear()
    packed, _, ll_handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, 8, num_experts, use_fp8=False, return_recv_hook=True
    )
    before_hook = list(seen)
    hook()
    _, _, hook = buffer.low_latency_combine(packed, topk_idx, weights, ll_handle, return_recv_hook=True)
    hook()
    return [normal, normal_all, before_hook, list(seen)]


def test_six_hook_events_fire_on_both_modes(ranks2):
    for normal, normal_all, before_hook, low_latency in ranks2.run(_hooks_rank):
        assert normal == list(HOOK_EVENTS[:3])
        assert normal_all == list(HOOK_EVENTS)
        # The receiving hook is the dispatch's wait: nothing after the launch fired before it.
        assert before_hook == ["pre_dispatch", "dispatch_in_flight"]
        assert low_latency == list(HOOK_EVENTS)


def _minus_one_rank(device) -> dict:
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    buffer = deep_ep.Buffer(group)
    num_experts, num_tokens = 4 * world, 5
    x = (torch.arange(num_tokens, dtype=torch.float32)[:, None] + 10 * rank).repeat(1, 16).bfloat16()
    # Token 0: no expert at all; token 1: one of two choices is -1; the rest choose two experts.
    topk_idx = torch.tensor([[-1, -1], [-1, 1], [0, 5], [7, 2], [3, 4]]) % num_experts
    topk_idx[0] = -1
    topk_idx[1, 0] = -1
    weights = torch.full((num_tokens, 2), 0.5)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=weights,
    )
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    return {
        "in_rank": in_rank,
        "recv_rows": recv_x.shape[0],
        "recv_pairs": int((recv_idx >= 0).sum()),
        "list": per_expert_list,
        "combined": combined,
        "x": x,
        "combined_w": combined_w,
        "weights": weights.masked_fill(topk_idx < 0, 0),
    }


def test_normal_mode_takes_minus_one_ids(ranks2):
    results = ranks2.run(_minus_one_rank)
    for r in results:
        reached = r["in_rank"].sum(dim=1)
        assert reached[0] == 0 and reached[1] == 1  # no expert: no rank; one real choice: one rank
        torch.testing.assert_close(r["combined"].float(), r["x"].float() * reached[:, None].float())
        torch.testing.assert_close(r["combined_w"], r["weights"])
    # Every (token, real choice) pair arrives once somewhere; no row for the token with no expert.
    assert sum(r["recv_pairs"] for r in results) == 2 * (3 * 2 + 1)
    assert sum(r["recv_rows"] for r in results) == sum(int(r["in_rank"].sum()) for r in results)
    assert sum(sum(r["list"]) for r in results) == 2 * (3 * 2 + 1)


def _low_latency_equals_native_rank(device, use_fp8: bool, weighted: bool) -> float:
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(100 + rank)
    num_experts, num_tokens, hidden, top_k, capacity = 8, 7, 256, 3, 8
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    topk_idx[2, 1] = -1
    weights = torch.rand(num_tokens, top_k)
    buffer = deep_ep.Buffer(group, low_latency_mode=True)
    dispatch_weights = weights if weighted else None
    packed, count, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, capacity, num_experts, use_fp8=use_fp8, topk_weights=dispatch_weights
    )
    rows = packed if not use_fp8 else (packed[0].float() * packed[1].repeat_interleave(128, dim=-1)).bfloat16()
    # "Experts": expert l scales its rows by (l + 1); the same on the native path below.
    scale_L = torch.arange(1, rows.shape[0] + 1, dtype=torch.float32)[:, None, None]
    combined, _, _ = buffer.low_latency_combine((rows.float() * scale_L).bfloat16(), topk_idx, weights, handle)

    native = make_dispatcher(
        "low_latency", num_experts, EPGroup.from_torch(group), max_tokens_per_rank=capacity, fp8=use_fp8
    )
    with torch.no_grad():
        out = native.dispatch(x, topk_idx, weights)
        local_R = torch.searchsorted(
            out.num_rows_per_expert_L.cumsum(0), torch.arange(out.expert_x_RH.shape[0]), right=True
        )
        y_RH = (out.rows_RH().float() * (local_R.clamp(max=rows.shape[0] - 1) + 1)[:, None]).bfloat16()
        expected = native.combine(y_RH, out.handle)
    return (combined.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_equals_moe_sbo_native(ranks2, use_fp8):
    """The compatible path (one row per choice, weighted at combine) against the native one (rows
    weighted on the experts' rank): the same sums in another order, within bf16 rounding."""
    for err in ranks2.run(_low_latency_equals_native_rank, use_fp8, False):
        assert err < 2e-2


def test_low_latency_with_dispatch_weights_is_the_native_path(ranks2):
    """``topk_weights`` given at dispatch: one row per (token, rank), weighted on the experts' ranks,
    which is the native dispatcher's forward itself: the same bits."""
    for err in ranks2.run(_low_latency_equals_native_rank, False, True):
        assert err == 0.0


def _refusals_rank(device) -> list[str]:
    group = dist.group.WORLD
    messages = []

    def refused(fn, *args, **kwargs):
        with pytest.raises((ValueError, TypeError)) as info:
            fn(*args, **kwargs)
        messages.append(str(info.value))

    refused(deep_ep.Buffer, group, comm=object())
    refused(deep_ep.Buffer, None)
    buffer = deep_ep.Buffer(group)
    refused(buffer.low_latency_query_mask_buffer, torch.zeros(dist.get_world_size(), dtype=torch.int))
    x, idx = torch.randn(4, 128, dtype=torch.bfloat16), torch.tensor([[0, 2]] * 4)  # both ranks: 4 rows
    refused(buffer.low_latency_dispatch, x, idx, 2, 4)  # more tokens than num_max_dispatch_tokens_per_rank
    refused(buffer.low_latency_dispatch, x, idx, 4, 4, use_ue8m0=True)
    refused(
        buffer.low_latency_dispatch, x, idx, 4, 4, dispatch_wait_recv_cost_stats=torch.zeros(2, 2, dtype=torch.int64)
    )
    refused(buffer.low_latency_dispatch, torch.randn(4, 100, dtype=torch.bfloat16), idx, 4, 4, use_fp8=True)
    refused(buffer.low_latency_dispatch, x, idx, 4, 4, topk_weights=torch.ones(4, 2, dtype=torch.float64))
    weights = torch.rand(4, 2)
    packed, _, ll_handle, _, _ = buffer.low_latency_dispatch(x, idx, 4, 4, use_fp8=False, topk_weights=weights)
    refused(buffer.low_latency_combine, packed, idx, weights.clone(), ll_handle)  # not the dispatch's weights
    weights.mul_(2)
    refused(buffer.low_latency_combine, packed, idx, weights, ll_handle)  # the dispatch's, changed since
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 4)
    args = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    refused(buffer.dispatch, x, topk_idx=idx, **args)  # top-k ids without weights
    refused(buffer.dispatch, x, **args, topk_idx=idx, topk_weights=torch.ones(4, 2), num_worst_tokens=1)
    refused(buffer.dispatch, x, num_tokens_per_rank=per_rank)  # no is_token_in_rank
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **args)
    refused(buffer.combine, recv_x.to(torch.float8_e4m3fn), handle)  # combine sums bf16 rows, not fp8
    refused(buffer.get_local_buffer_tensor, torch.bfloat16)
    refused(deep_ep.Config, 20, 8, 8)  # send chunk not below the receive chunk, as DeepEP checks
    refused(buffer.destroy)  # explicitly_destroy was not set
    dist.barrier()
    return messages


def test_refusals_are_clear_and_local(ranks2):
    for messages in ranks2.run(_refusals_rank):
        assert len(messages) == 17 and all(messages)

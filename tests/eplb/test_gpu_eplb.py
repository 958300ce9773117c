"""Expert load balancing on GPU ranks (sharing one GPU where there are fewer GPUs than ranks): every
dispatcher with replicas equals the layer without them before and after a rebalance, a CUDA graph
captured before a rebalance replays the new placement, and counting the load syncs nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpu_ranks import gpu_world
from moe_sbo.config import get_preset
from moe_sbo.eplb import global_placement, zipf_load
from moe_sbo.eplb.runtime import EPLBOptions
from moe_sbo.layer import MoELayer

pytestmark = pytest.mark.gpu
BF16_REL_TOL = 2e-2  # bf16 on the wire and in the GEMMs, experts computed on other ranks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _skew(layer: MoELayer, seed: int) -> None:
    """Zipf(1) popularity over the experts, as a gate-logit bias (every routing method reads it)."""
    bias = zipf_load(layer.cfg.num_experts, 1.0, seed=seed).log().float()
    layer.router.logit_bias = bias.to(layer.router.weight.device)


def _cfg(fp8: bool):
    """bf16 experts: DeepSeek-V2-Lite's layer; FP8: DeepSeek-V3's expert dims with 32 experts."""
    return get_preset("deepseek-v3").with_num_experts(32) if fp8 else get_preset("deepseek-v2-lite")


def _dispatchers_rank(device, fp8):
    cfg, rank = _cfg(fp8), dist.get_rank()
    tokens = 48
    x = torch.randn(tokens - rank, cfg.hidden_size, generator=torch.Generator(device).manual_seed(rank), device=device)
    x = x.bfloat16()
    expert_dtype = "fp8" if fp8 else None
    errors = {}
    with torch.inference_mode():
        plain = MoELayer(cfg, dispatcher="local", device=device, seed=4, expert_dtype=expert_dtype)
        _skew(plain, 3)
        expected = plain(x)
        for name in ("allgather", "alltoall", "low_latency"):
            options = {"max_tokens_per_rank": tokens} if name == "low_latency" else None
            layer = MoELayer(
                cfg,
                dispatcher=name,
                device=device,
                seed=4,
                dispatcher_options=options,
                expert_dtype=expert_dtype,
                eplb=EPLBOptions(redundant_per_rank=1),
            )
            _skew(layer, 3)
            before = layer(x)
            report = layer.rebalance()
            errors[name] = (_rel(before, expected), _rel(layer(x), expected), report.moved_slots)
    return errors


@pytest.mark.parametrize("world", sorted({gpu_world(), 4}))
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_every_dispatcher_with_replicas_matches_the_plain_layer(gpu_pools, world, fp8):
    for errors in gpu_pools(world).run(_dispatchers_rank, fp8):
        for name, (before, after, moved) in errors.items():
            assert before <= BF16_REL_TOL and after <= BF16_REL_TOL and moved > 0, (name, errors)


def _graph_rank(device):
    """low_latency captured in a CUDA graph before a rebalance: replayed after it, the graph reads the
    new weights and replica tables (rewritten in place) and equals the eager forward; counting the
    load and mapping to replicas make no device-to-host sync."""
    cfg, rank, world = get_preset("deepseek-v2-lite"), dist.get_rank(), dist.get_world_size()
    tokens = 32
    layer = MoELayer(
        cfg,
        dispatcher="low_latency",
        device=device,
        seed=5,
        dispatcher_options={"max_tokens_per_rank": tokens},
        eplb=EPLBOptions(redundant_per_rank=1),
    )
    _skew(layer, 5)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator(device).manual_seed(rank), device=device)
    x = x.bfloat16()
    with torch.inference_mode():
        for _ in range(2):
            layer(x)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph):
                y_graph = layer(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph.replay()
        before = y_graph.clone()
        eager_before = layer(x)
        target = global_placement(zipf_load(cfg.num_experts, 1.3, seed=9), world, 1)
        report = layer.rebalance(target)
        graph.replay()
        after = y_graph.clone()
        eager_after = layer(x)
        torch.cuda.synchronize()
    return torch.equal(before, eager_before), torch.equal(after, eager_after), report.moved_slots


def test_a_graph_captured_before_a_rebalance_replays_the_new_placement(gpu_pools):
    for same_before, same_after, moved in gpu_pools(gpu_world()).run(_graph_rank):
        assert same_before and same_after and moved > 0

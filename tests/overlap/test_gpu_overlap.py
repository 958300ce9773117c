"""Overlap modes on the GPU: same output as ``none`` (bf16), side streams really used, CUDA-graph
capture of every mode, the SM budget checked against the GPU. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from gpu_ranks import gpu_world
from moe_sbo.config import get_preset
from moe_sbo.dispatch import options_for_tokens
from moe_sbo.layer import MoELayer
from moe_sbo.measure.trace import spans_from_trace
from moe_sbo.overlap import FIXED_MODES, OVERLAP_MODES, make_overlap
from moe_sbo.streams import capture_graph, sm_count

pytestmark = pytest.mark.gpu
# Modes that queue the very same kernels as none (only the stream or the moment differs) are bitwise
# equal to none: every dispatcher's reductions have a fixed order (reduce.gather_sum, no float
# atomics). combine_sm asks cuBLASLt for fewer SMs, which may select another kernel: bf16 tolerance.
BITWISE_MODES = ("none", "dispatch", "combine", "split")
BITWISE_DISPATCHERS = ("local", "allgather", "alltoall", "low_latency")
BF16_REL_TOL = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _modes_vs_none(device, dispatcher, tokens):
    cfg = get_preset("deepseek-v2-lite")
    rank = dist.get_rank() if dist.is_initialized() else 0
    x = torch.randn(
        tokens + 5 * rank,
        cfg.hidden_size,
        device=device,
        generator=torch.Generator(device=device).manual_seed(9 + rank),
    ).bfloat16()
    out = {}
    with torch.inference_mode():
        layer = MoELayer(
            cfg,
            dispatcher=dispatcher,
            device=device,
            seed=4,
            dispatcher_options=options_for_tokens(dispatcher, x.shape[0]),
        )
        reference = layer(x)
        for mode in OVERLAP_MODES:
            layer.overlap = make_overlap(mode, device)
            for _ in range(12 if mode == "auto" else 1):  # auto explores before it settles
                y = layer(x)
            out[mode] = (torch.equal(y, reference), _rel(y, reference))
    return out


@pytest.mark.parametrize("dispatcher", ["local", "low_latency"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_modes_match_none_on_one_gpu(dispatcher, tokens):
    out = _modes_vs_none(torch.device("cuda"), dispatcher, tokens)
    for mode, (bitwise, rel) in out.items():
        assert rel <= BF16_REL_TOL, (mode, rel)
        if mode in BITWISE_MODES and dispatcher in BITWISE_DISPATCHERS:
            assert bitwise, f"{mode} is not bitwise equal to none (rel {rel:.2e})"


def test_modes_match_none_over_nccl():
    from moe_sbo.launch.ranks import LocalRanks

    with LocalRanks(gpu_world(), device="cuda") as ranks:
        for dispatcher in ("alltoall", "allgather"):
            for out in ranks.run(_modes_vs_none, dispatcher, 64):
                for mode, (_, rel) in out.items():
                    assert rel <= BF16_REL_TOL, (dispatcher, mode, rel)


def _every_mode_rank(device, dispatcher):
    """Every fixed SBO mode of ``dispatcher`` against the single-rank reference and against none; for
    low_latency also replayed from a CUDA graph against its eager forward."""
    cfg, rank = get_preset("tiny"), dist.get_rank()
    tokens = 24
    x = torch.randn(tokens - rank, cfg.hidden_size, device=device, generator=torch.Generator(device).manual_seed(rank))
    x = x.bfloat16()
    options = options_for_tokens(dispatcher, tokens)
    out = {}
    with torch.inference_mode():
        reference = MoELayer(cfg, dispatcher="local", device=device, seed=8)(x)
        none = None
        for mode in FIXED_MODES:
            layer = MoELayer(
                cfg, dispatcher=dispatcher, device=device, seed=8, overlap=mode, dispatcher_options=options
            )
            y = layer(x)
            none = y if none is None else none
            replayed_equal = None
            if layer.dispatcher.graph_capturable:
                static_x = torch.zeros(tokens, cfg.hidden_size, device=device, dtype=x.dtype)
                static_x[: x.shape[0]] = x
                eager = layer(static_x)
                graph, static_y = capture_graph(lambda layer=layer, static_x=static_x: layer(static_x))
                graph.replay()
                replayed_equal = torch.equal(static_y, eager)
            out[mode] = (_rel(y, reference), torch.equal(y, none), replayed_equal)
    return out


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall", "low_latency", "node_aware"])
def test_every_dispatcher_and_mode_at_ep4_and_ep8(gpu_pools, world, dispatcher):
    """EP4 and EP8 on whatever GPUs there are (ranks share them where there are fewer): each fixed mode
    equals the single-rank reference, the bitwise modes equal none, low_latency's graph replays equal
    its eager forwards."""
    for out in gpu_pools(world).run(_every_mode_rank, dispatcher):
        for mode, (rel, same_as_none, replayed_equal) in out.items():
            assert rel <= BF16_REL_TOL, (mode, rel)
            assert same_as_none or mode not in BITWISE_MODES, mode
            assert replayed_equal in (None, True) or mode == "combine_sm", mode


def test_combine_modes_run_shared_experts_on_a_side_stream(tmp_path):
    cfg = get_preset("deepseek-v2-lite")
    x = torch.randn(256, cfg.hidden_size, device="cuda").bfloat16()
    lanes = {}
    with torch.inference_mode():
        for mode in ("none", "combine", "combine_sm"):
            layer = MoELayer(cfg, device="cuda", overlap=mode)
            layer(x)
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                layer(x)
                torch.cuda.synchronize()
            path = tmp_path / f"{mode}.json"
            prof.export_chrome_trace(str(path))
            spans = spans_from_trace(json.loads(path.read_text()))
            lanes[mode] = {
                kind: {s.lane for s in spans if s.kind == kind} for kind in ("shared_experts", "routed_experts")
            }
    assert lanes["none"]["shared_experts"] == lanes["none"]["routed_experts"]
    for mode in ("combine", "combine_sm"):
        assert lanes[mode]["shared_experts"] and not lanes[mode]["shared_experts"] & lanes[mode]["routed_experts"], (
            lanes
        )


@pytest.mark.parametrize("mode", FIXED_MODES)
def test_every_mode_captures_in_a_cuda_graph(mode):
    # low_latency: the dispatcher with no host sync (the others size buffers from data on the host).
    cfg = get_preset("deepseek-v2-lite")
    layer = MoELayer(
        cfg, device="cuda", overlap=mode, dispatcher="low_latency", dispatcher_options={"max_tokens_per_rank": 64}
    )
    static_x = torch.randn(64, cfg.hidden_size, device="cuda").bfloat16()
    with torch.inference_mode():
        graph, static_y = capture_graph(lambda: layer(static_x))
        for seed in range(3):
            static_x.copy_(
                torch.randn(64, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            )
            graph.replay()
            replayed = static_y.clone()
            eager = layer(static_x)  # same layer and mode, launched eagerly: the same kernels
            reference = MoELayer(cfg, device="cuda")(static_x)  # local dispatcher, no overlap
            assert torch.equal(replayed, eager) or mode == "combine_sm"
            assert _rel(replayed, reference) <= BF16_REL_TOL


def test_auto_chooses_a_mode_for_graphs_from_replays_and_captures_it():
    """``choose_for_graphs`` times each candidate's replays and keeps one; a graph captured after it
    runs that mode (its hooks), and gives the layer's output within bf16 tolerance."""
    cfg = get_preset("deepseek-v2-lite")
    layer = MoELayer(
        cfg, device="cuda", overlap="auto", dispatcher="low_latency", dispatcher_options={"max_tokens_per_rank": 64}
    )
    static_x = torch.randn(64, cfg.hidden_size, device="cuda").bfloat16()
    with torch.inference_mode():
        choice = layer.overlap.choose_for_graphs(lambda: layer(static_x), 64, layer.dispatcher.ep, replays=5)
        assert choice in FIXED_MODES and layer.overlap.graph_choices == {64: choice}
        assert layer.overlap.timings_us == {}  # the capture's warm-up forwards did not explore
        graph, static_y = capture_graph(lambda: layer(static_x))
        graph.replay()
        reference = MoELayer(cfg, device="cuda")(static_x)
        assert _rel(static_y, reference) <= BF16_REL_TOL


def test_sm_budget_beyond_the_gpu_is_an_error():
    total = sm_count(torch.device("cuda", torch.cuda.current_device()))
    with pytest.raises(ValueError, match=rf"sm_budget must be in \[1, {total}\]"):
        MoELayer(get_preset("tiny"), device="cuda", overlap="combine_sm", sm_budget=total + 1)
    MoELayer(get_preset("tiny"), device="cuda", overlap="combine_sm", sm_budget=total)

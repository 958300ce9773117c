"""The ported DeepEP tests on GPUs: one rank per visible GPU and at least 2, so on a one-GPU machine
the ranks share it (a gloo group moving CUDA tensors; the low-latency path runs the fused kernels over
symmetric memory), and the low-latency dispatch + combine captured in a CUDA graph and replayed with
new inputs, as DeepEP's tests and engines run it. Skipped without CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from test_deep_ep_examples import example, low_latency_example_rank, normal_example_rank
from test_deep_ep_internode import ALL_MODES, internode_rank
from test_deep_ep_intranode import intranode_rank
from test_deep_ep_low_latency import low_latency_rank

import moe_sbo.deep_ep as deep_ep
from gpu_ranks import gpu_world
from moe_sbo.launch.ranks import RankPool
from moe_sbo.streams import capture_graph

pytestmark = pytest.mark.gpu
WORLD = gpu_world()  # >= 2: ranks share the GPU where there is one
_POOL = RankPool(WORLD, "cuda")  # started on first use and kept (a failed call restarts it)


@contextlib.contextmanager
def _ranks():
    """The module's GPU ranks (``_POOL``)."""
    yield _POOL


@pytest.fixture(scope="module", autouse=True)
def _close_pool():
    yield
    _POOL.close()


def test_intranode_bf16_and_fp8():
    args = {"num_tokens": 64, "hidden": 512, "num_topk": 4, "num_experts": 4 * WORLD}
    with _ranks() as ranks:
        assert all(ranks.run(intranode_rank, args, ALL_MODES, True))


def test_internode_two_nodes():
    if WORLD % 2:
        pytest.skip(f"two nodes need an even rank count, got {WORLD}")
    args = {"num_tokens": 48, "hidden": 512, "num_topk": 4, "num_experts": 4 * WORLD}
    with _ranks() as ranks:
        assert all(ranks.run(internode_rank, args, WORLD // 2, ALL_MODES, 2))


def test_low_latency_bf16_fp8_hooks_zero_copy():
    with _ranks() as ranks:
        assert all(ranks.run(low_latency_rank, 32, 512, 4, 4 * WORLD, 2))


def test_readme_examples():
    with _ranks() as ranks:
        assert all(ranks.run(normal_example_rank, example("normal")))
        assert all(ranks.run(low_latency_example_rank, example("low_latency")))


def _graph_rank(device, use_fp8: bool) -> float:
    """Capture dispatch, identity experts and combine once; replay with new x and weights; compare with
    an eager call on the same inputs."""
    rank, capacity, hidden, num_experts, top_k = dist.get_rank(), 16, 512, 4 * dist.get_world_size(), 4
    buffer = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.zeros(capacity, hidden, dtype=torch.bfloat16, device=device)
    topk_idx = torch.zeros(capacity, top_k, dtype=torch.int64, device=device)
    weights = torch.zeros(capacity, top_k, device=device)
    out = torch.empty(capacity, hidden, dtype=torch.bfloat16, device=device)

    def fill() -> None:
        x.copy_(torch.randn(capacity, hidden, generator=generator, device=device))
        scores = torch.rand(capacity, num_experts, generator=generator, device=device)
        topk_idx.copy_(scores.topk(top_k, dim=1).indices)
        topk_idx[0, -1] = -1
        weights.copy_(torch.rand(capacity, top_k, generator=generator, device=device))

    def step() -> torch.Tensor:
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, capacity, num_experts, use_fp8=use_fp8)
        rows = (recv[0].float() * recv[1].repeat_interleave(128, dim=-1)).bfloat16() if use_fp8 else recv
        combined, _, _ = buffer.low_latency_combine(rows, topk_idx, weights, handle, out=out)
        return combined

    fill()
    step()  # eager: allocates the buffers of the shape
    graph, _ = capture_graph(step)
    worst = 0.0
    for _ in range(3):
        fill()
        graph.replay()
        replayed = out.clone()
        eager = step().clone()
        torch.cuda.synchronize()
        worst = max(worst, ((replayed.float() - eager.float()).abs().max() / eager.float().abs().max()).item())
    return worst


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_graph_capture(use_fp8):
    with _ranks() as ranks:
        for worst in ranks.run(_graph_rank, use_fp8):
            assert worst < 1e-2

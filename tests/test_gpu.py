"""GPU checks (NCCL, bf16, grouped GEMM); skipped without CUDA (on a GPU machine:
``bash benchmarks/run_gpu_overlap.sh`` runs every GPU test)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpu_ranks import gpu_world
from moe_sbo.config import get_preset
from moe_sbo.layer import MoELayer

pytestmark = pytest.mark.gpu
BF16_REL_TOL = 2e-2  # bf16 activations on the wire and bf16 GEMM outputs vs the same math on one rank


def _dispatchers_rank(device, preset, tokens):
    cfg = get_preset(preset)
    rank = dist.get_rank()
    generator = torch.Generator(device=device).manual_seed(50 + rank)
    x = torch.randn(tokens + 3 * rank, cfg.hidden_size, generator=generator, device=device).bfloat16()
    errors = {}
    with torch.inference_mode():
        ref = MoELayer(cfg, dispatcher="local", device=device, seed=1)(x).float()
        for name in ("allgather", "alltoall", "low_latency"):
            options = {"max_tokens_per_rank": tokens + 3 * dist.get_world_size()} if name == "low_latency" else None
            y = MoELayer(cfg, dispatcher=name, device=device, seed=1, dispatcher_options=options)(x).float()
            errors[name] = ((y - ref).norm() / ref.norm()).item()
    return errors


@pytest.mark.parametrize("world", sorted({gpu_world(), 4, 8}))
@pytest.mark.parametrize("preset, tokens", [("tiny", 37), ("deepseek-v2-lite", 64)])
def test_dispatchers_match_local_on_gpus(gpu_pools, preset, tokens, world):
    """EP2, EP4 and EP8 on whatever GPUs there are (ranks share them where there are fewer)."""
    if get_preset(preset).num_experts % world:
        pytest.skip(f"{world} ranks do not divide {preset}'s experts")
    for errors in gpu_pools(world).run(_dispatchers_rank, preset, tokens):
        assert all(err <= BF16_REL_TOL for err in errors.values()), errors


def test_bf16_layer_on_gpu_matches_float32_on_cpu():
    cfg = get_preset("tiny")
    gpu = MoELayer(cfg, device="cuda", seed=3)
    cpu = MoELayer(cfg, dtype=torch.float32, seed=3)
    with torch.no_grad():  # CUDA and CPU generators differ: copy the weights across
        for p_gpu, p_cpu in zip(gpu.parameters(), cpu.parameters()):
            p_cpu.copy_(p_gpu.float().cpu())
        cpu.router.e_score_correction_bias.copy_(gpu.router.e_score_correction_bias.cpu())
        x = torch.randn(200, cfg.hidden_size)
        got = gpu(x.cuda().bfloat16()).float().cpu()
        expected = cpu(x.bfloat16().float())
    # Routing may flip for near-tied experts in bf16; compare tokens whose top-k agree.
    same = (
        torch.sort(gpu.router(x.cuda().bfloat16()).topk_ids_TK, 1).values.cpu()
        == torch.sort(cpu.router(x.bfloat16().float()).topk_ids_TK, 1).values
    ).all(1)
    assert same.float().mean() > 0.95
    rel = ((got[same] - expected[same]).norm() / expected[same].norm()).item()
    assert rel <= BF16_REL_TOL


def test_gather_sum_kernel_on_cuda():
    from moe_sbo.dispatch.reduce import gather_sum

    generator = torch.Generator(device="cuda").manual_seed(4)
    src = torch.randn(300, 7168, generator=generator, device="cuda").bfloat16()
    index = torch.randint(0, 301, (256, 8), generator=generator, device="cuda")  # 300: no source
    weight = torch.rand(300, generator=generator, device="cuda")
    valid = index < 300
    expected = (src.double()[index.clamp(max=299)] * (weight.double()[index.clamp(max=299)] * valid)[..., None]).sum(1)
    out = gather_sum(src, index, weight, kernels="triton")
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(gather_sum(src, index, weight, out_dtype=torch.bfloat16, kernels="triton"), out.bfloat16())
    torch.testing.assert_close(gather_sum(src, index, weight, kernels="torch"), out, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(gather_sum(src, index, weight, kernels="triton"), out) for _ in range(20))


def _repeat_rank(device, dispatcher, overlap, forwards):
    cfg = get_preset("deepseek-v2-lite")
    generator = torch.Generator(device=device).manual_seed(9 + dist.get_rank())
    x = torch.randn(128, cfg.hidden_size, generator=generator, device=device).bfloat16()
    options = {"max_tokens_per_rank": 128} if dispatcher == "low_latency" else None
    layer = MoELayer(cfg, dispatcher=dispatcher, overlap=overlap, device=device, seed=2, dispatcher_options=options)
    with torch.inference_mode():
        first = layer(x)
        return sum(not torch.equal(layer(x), first) for _ in range(forwards))


@pytest.mark.parametrize("overlap", ["none", "combine", "split"])
def test_every_dispatcher_is_bitwise_deterministic_on_gpu(gpu_pools, overlap):
    """No float atomics in any combine: the same input gives the same bits, even with the shared
    experts running beside the reduction (which reordered index_add_'s atomics before)."""
    for dispatcher in ("local", "allgather", "alltoall", "low_latency"):
        differing = gpu_pools(gpu_world()).run(_repeat_rank, dispatcher, overlap, 50)
        assert differing == [0] * len(differing), (dispatcher, differing)

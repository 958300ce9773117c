"""FP8 experts on the GPU: the Triton kernels against ``fp8.py``'s torch reference, the layer against
dense experts on the dequantised weights, and CUDA-graph capture with fp8 dispatch feeding FP8
experts; skipped without CUDA (``bash benchmarks/run_gpu_fp8.sh`` runs them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moe_sbo.config import get_preset
from moe_sbo.experts import fp8_gemm, fp8_gemm_sm90
from moe_sbo.experts.conditions import Conditions
from moe_sbo.experts.fp8_torch import grouped_linear_fp8, grouped_scaled_mm
from moe_sbo.experts.routed import RoutedExperts
from moe_sbo.experts.routes import FP8_SM90, FP8_TRITON, ExpertRows
from moe_sbo.experts.select import choose
from moe_sbo.layer import MoELayer
from moe_sbo.quant import kernels as quant_kernels
from moe_sbo.quant.fp8 import dequantize_fp8, empty_k_major_scales, quantize_fp8, quantize_fp8_blocks
from moe_sbo.streams import capture_graph
from moe_sbo.weights import layer_weights

pytestmark = pytest.mark.gpu
# FP8 experts vs dense experts on the same (dequantised) weights: each of the MLP's two activation
# quantisations (e4m3, 1x128 groups) rounds by ~2.6% RMS on Gaussian data (tests/experts/test_fp8.py), ~4% after both.
FP8_REL_TOL = 5e-2


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def _counts(device, *counts):
    counts_L = torch.tensor(counts, device=device)
    return counts_L, counts_L.cumsum(0).to(torch.int32)


def test_quantize_rows_bits_equal_torch():
    x = torch.randn(300, 7168, device="cuda").bfloat16() * torch.exp(torch.randn(300, 1, device="cuda"))
    x[7, :128] = 0  # a zero group stays finite
    _, offsets = _counts("cuda", 100, 0, 200)
    q, s = quant_kernels.quantize_rows(x, offsets)
    q_ref, s_ref = quantize_fp8(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    # Through an index into a wider buffer (low_latency's index_rows): the gathered rows' bits.
    buffer = torch.zeros(400, 7296, device="cuda", dtype=x.dtype)
    rows = torch.randperm(400, device="cuda")[:300]
    buffer[rows, :7168] = x
    q, s = quant_kernels.quantize_rows(buffer[:, :7168], offsets, rows)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


def test_silu_mul_quantize_matches_torch():
    h = torch.randn(257, 2 * 2048, device="cuda").bfloat16()
    _, offsets = _counts("cuda", 257)
    q, s = quant_kernels.silu_mul_quantize(h, offsets)
    gate, up = h.float().chunk(2, dim=-1)
    q_ref, s_ref = quantize_fp8(F.silu(gate) * up)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    # silu in the kernel (x * sigmoid) and in torch may differ in the last float32 bit: an e4m3 flip.
    got, ref = dequantize_fp8(q, s, torch.float32), dequantize_fp8(q_ref, s_ref, torch.float32)
    assert ((got - ref).abs() <= 2.0**-3 * ref.abs() + 1e-6 * s.repeat_interleave(128, 1)).all()


@pytest.mark.parametrize(
    "config",
    [
        None,
        *fp8_gemm.GEMM_CONFIGS,
        fp8_gemm.GemmConfig(64, 256, 4, 8, 3),
        fp8_gemm.GemmConfig(64, 64, 1, 4, 4),
        fp8_gemm.GemmConfig(64, 64, 1, 4, 4, tma=True),
        fp8_gemm.GemmConfig(128, 256, 8, 8, 3, tma=True),
    ],
)
def test_grouped_gemm_matches_torch_reference(config):
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts, offsets = _counts("cuda", 1, 0, 300, 64, 129, 0, 7, 512)
    rows = int(counts.sum()) + 50  # padding rows past the last expert: neither read nor written
    n, k = 1024, 2048
    x = torch.randn(rows, k, generator=generator, device="cuda")
    w = torch.randn(len(counts), n, k, generator=generator, device="cuda") * k**-0.5
    q, s = quantize_fp8(x)
    wq, ws = quantize_fp8_blocks(w)
    got = fp8_gemm.grouped_gemm(q, s, wq, ws, offsets, torch.float32, config)
    ref = grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)
    real = int(offsets[-1])
    # Hopper's FP8 tensor cores accumulate each 128-value K step with ~14 bits (DeepSeek-V3 report,
    # 3.3.2): 1e-4 off the float32 reference here; the kernel adds the steps in float32.
    assert _rel(got[:real], ref[:real]) < 1e-3


sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or fp8_gemm_sm90.gluon is None,
    reason="fp8_gemm_sm90 needs an sm90 GPU and Triton's Gluon",
)


@sm90
@pytest.mark.parametrize(
    "config",
    [
        fp8_gemm_sm90.DEFAULT_CONFIG,
        dataclasses.replace(fp8_gemm_sm90.DEFAULT_CONFIG, persistent=False),
        dataclasses.replace(fp8_gemm_sm90.TWO_CONSUMERS_CONFIG, k_unroll=1),
        dataclasses.replace(fp8_gemm_sm90.TWO_CONSUMERS_CONFIG, k_unroll=2),
        dataclasses.replace(fp8_gemm_sm90.TWO_CONSUMERS_CONFIG, k_unroll=4, stages=5),
    ],
    ids=["3x64-s4", "3x64-one-tile-per-program", "2x64-s4-u1", "2x64-s4-u2", "2x64-s5-u4"],
)
def test_warp_specialized_gemm_matches_torch_reference(config):
    """The sm90 kernel against the float32 reference: uneven experts (1 row, none, 300, ...) so tiles
    end inside an expert, padding rows past the last expert, K of both MLP GEMMs (16 and 56 steps,
    more than a persistent program's ring holds) and of V2-Lite's down (11 steps: ``k_unroll``'s
    remainder) and one step; and replayed from a CUDA graph after the counts
    change on the device."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    counts, offsets = _counts("cuda", 1, 0, 300, 64, 129, 0, 7, 700)
    rows = int(counts.sum()) + 50
    real = int(offsets[-1])
    for n, k in ((1024, 2048), (256, 7168), (384, 1408), (128, 128)):
        x = torch.randn(rows, k, generator=generator, device="cuda")
        w = torch.randn(len(counts), n, k, generator=generator, device="cuda") * k**-0.5
        q, s = quantize_fp8(x)
        wq, ws = quantize_fp8_blocks(w)
        ref = grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)
        got32 = fp8_gemm_sm90.grouped_gemm(q, s, wq, ws, offsets, torch.float32, config)
        assert _rel(got32[:real], ref[:real]) < 1e-3  # as the Triton kernel: the MMA's own rounding
        got = fp8_gemm_sm90.grouped_gemm(q, s, wq, ws, offsets, torch.bfloat16, config)
        assert _rel(got[:real], ref[:real]) < 1e-2  # bf16 output rounding on top
        # Scales K-major already (the quantisers' k_major output) are read where they lie: the same.
        s_k = empty_k_major_scales(rows, k // 128, "cuda").copy_(s)
        got_k = fp8_gemm_sm90.grouped_gemm(q, s_k, wq, ws, offsets, torch.float32, config)
        assert torch.equal(got_k[:real], got32[:real])
    graph, static = capture_graph(lambda: fp8_gemm_sm90.grouped_gemm(q, s, wq, ws, offsets, torch.float32, config))
    offsets.copy_(torch.tensor([0, 500, 500, 501, 900, 1100, 1100, 1201], device="cuda", dtype=torch.int32))
    graph.replay()
    ref = grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)
    assert _rel(static[:1201], ref[:1201]) < 1e-3


@sm90
def test_prefill_sizes_run_the_warp_specialized_kernel(monkeypatch):
    """FP8 experts choose ``fp8_sm90`` above 256 rows per expert and ``fp8_triton`` from there down
    (eagerly); captured into a CUDA graph, ``fp8_sm90`` from 128. ``fp8_sm90``'s GEMM runs the sm90
    kernel, ``fp8_triton``'s (``fp8_gemm.grouped_gemm``) never does."""
    calls = []
    sm90_gemm = fp8_gemm_sm90.grouped_gemm
    monkeypatch.setattr(fp8_gemm_sm90, "grouped_gemm", lambda *args: calls.append(1) or sm90_gemm(*args))
    generator = torch.Generator(device="cuda").manual_seed(4)
    wq, ws = quantize_fp8_blocks(torch.randn(4, 512, 1024, generator=generator, device="cuda") * 1024**-0.5)
    for rows_per_expert, expected in ((257, FP8_SM90), (256, FP8_TRITON)):
        counts, offsets = _counts("cuda", *[rows_per_expert] * 4)
        q, s = quantize_fp8(torch.randn(4 * rows_per_expert, 1024, generator=generator, device="cuda"))
        assert choose(Conditions.of(q, True, rows_per_expert), "auto") is expected
        rows = ExpertRows(q, offsets, counts, rows_per_expert)
        calls.clear()
        got = expected.gemm((q, s), (wq, ws), torch.float32, rows)
        assert len(calls) == (expected is FP8_SM90)
        assert _rel(got, grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)) < 1e-3
        calls.clear()
        fp8_gemm.grouped_gemm(q, s, wq, ws, offsets, torch.float32)
        assert not calls
    # Captured into a CUDA graph, from 128 rows per expert; the replay equals the reference.
    counts, offsets = _counts("cuda", *[128] * 4)
    q, s = quantize_fp8(torch.randn(4 * 128, 1024, generator=generator, device="cuda"))
    captured = Conditions.of(q, True, 128)._replace(capture=True)
    assert choose(captured, "auto") is FP8_SM90 and choose(Conditions.of(q, True, 128), "auto") is FP8_TRITON
    rows = ExpertRows(q, offsets, counts, 128.0)
    calls.clear()
    graph, static = capture_graph(lambda: FP8_SM90.gemm((q, s), (wq, ws), torch.float32, rows))
    assert calls  # the capture ran the sm90 kernel
    graph.replay()
    assert _rel(static, grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)) < 1e-3


def test_grouped_gemm_with_one_local_expert_matches_torch_reference():
    """One local expert (EP = the expert count): the kernel's expert axis has one lane."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    _, offsets = _counts("cuda", 300)
    x = torch.randn(300, 2048, generator=generator, device="cuda")
    w = torch.randn(1, 1024, 2048, generator=generator, device="cuda") * 2048**-0.5
    q, s = quantize_fp8(x)
    wq, ws = quantize_fp8_blocks(w)
    got = fp8_gemm.grouped_gemm(q, s, wq, ws, offsets, torch.float32)
    assert _rel(got, grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)) < 1e-3


def test_scaled_mm_per_expert_matches_torch_reference():
    generator = torch.Generator(device="cuda").manual_seed(1)
    counts = [256, 0, 1024, 130, 7]
    x = torch.randn(sum(counts), 2048, generator=generator, device="cuda")
    w = torch.randn(len(counts), 1024, 2048, generator=generator, device="cuda") * 2048**-0.5
    q, s = quantize_fp8(x)
    wq, ws = quantize_fp8_blocks(w)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    got = grouped_scaled_mm(q, s, wq, ws, counts, torch.bfloat16)
    assert _rel(got, grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)) < 5e-3  # bf16 output rounding


def test_eager_prefill_runs_cublas_only_where_the_sm90_kernel_does_not():
    """At >= 2048 rows per expert outside graph capture: the warp-specialised kernel where it runs
    (sm90 with Gluon), else cuBLAS per expert; captured, the device-count kernels. Both paths agree."""
    experts = RoutedExperts(4, 1024, 512, dtype=torch.bfloat16, device="cuda", fp8=True)
    for e in range(4):
        experts.set_expert(e, torch.randn(1024, 1024, device="cuda") / 32, torch.randn(1024, 512, device="cuda") / 23)
    counts = torch.tensor([2500, 1800, 2201, 1700], device="cuda")  # >= 2048 rows per expert on average
    x = torch.randn(int(counts.sum()), 1024, device="cuda").bfloat16()
    expected = "fp8_sm90" if fp8_gemm_sm90.device_supported(x.device) else "scaled_mm"
    assert experts.route(x).name == expected
    with torch.no_grad():
        eager = experts(x, counts)
        graph, static_y = capture_graph(lambda: experts(x, counts))  # capture: the device-count kernels
        graph.replay()
        experts.kernels = "scaled_mm"
        cublas = experts(x, counts)
    assert _rel(static_y, eager) < 1e-2 and _rel(cublas, eager) < 1e-2


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3", "qwen3-30b-a3b"])
def test_fp8_layer_matches_dense_layer_on_dequantised_weights(preset):
    cfg = get_preset(preset).with_num_experts(16)
    fp8 = MoELayer(cfg, device="cuda", seed=5, expert_dtype="fp8")
    dense = MoELayer(cfg, device="cuda", seed=0)
    dense.load_weights(layer_weights(fp8))
    x = torch.randn(512, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        err = _rel(fp8(x), dense(x))
    print(f"{preset}: FP8 experts vs dense on the same weights, relative error {err:.2e}")
    assert err <= FP8_REL_TOL


def test_fp8_dispatch_feeds_fp8_experts_in_a_cuda_graph():
    cfg = get_preset("deepseek-v3").with_num_experts(16)
    options = {"max_tokens_per_rank": 64, "fp8": True}
    layer = MoELayer(cfg, dispatcher="low_latency", dispatcher_options=options, device="cuda", expert_dtype="fp8")
    assert layer.dispatcher.deliver_fp8
    reference = MoELayer(cfg, dispatcher="local", device="cuda", expert_dtype="fp8")
    x = torch.randn(64, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        eager = layer(x)
        graph, static_y = capture_graph(lambda: layer(x))
        x.copy_(torch.randn_like(x))
        graph.replay()
        replayed = static_y.clone()
        expected = layer(x)
        ref = reference(x)
    assert torch.equal(replayed, expected)
    assert not torch.equal(eager, expected)  # the replay really saw the new input
    # fp8 dispatch quantises x exactly as FP8 experts do themselves (same groups, same scales), so
    # the two layers differ only in the order of the combine's bf16 sums.
    assert _rel(expected, ref) <= 1e-2

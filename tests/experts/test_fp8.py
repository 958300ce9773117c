"""FP8 routed experts on CPU: the formats' rounding, the Triton kernels (in Triton's interpreter)
against ``fp8.py``'s torch reference, the layer against dense experts on the dequantised weights per
model family, expert parallelism on gloo ranks (fp8 dispatch handing e4m3 rows to FP8 experts), and
bad input. ``tests/experts/test_gpu_fp8.py`` repeats the kernel checks bit for bit on CUDA.

Triton's interpreter rounds float32 -> e4m3 with a carry bug (a value just under a power of two
rounds to half of it: 124.3 -> 64, not 128; see ``tests/dispatch/test_low_latency_kernels.py``) and may round a
subnormal one step low, so on CPU the
quantisers' e4m3 values are compared modulo that bug, and the GEMM is fed the torch quantiser's output.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_sbo.config import get_preset
from moe_sbo.experts import fp8_gemm, fp8_gemm_sm90
from moe_sbo.experts.conditions import Conditions
from moe_sbo.experts.fp8_torch import grouped_linear_fp8
from moe_sbo.experts.routed import RoutedExperts
from moe_sbo.experts.routes import FP8_SM90, FP8_TRITON, ExpertRows
from moe_sbo.layer import MoELayer
from moe_sbo.quant import kernels as quant_kernels
from moe_sbo.quant.fp8 import (
    dequantize_fp8,
    dequantize_fp8_blocks,
    empty_k_major_scales,
    k_major_scales,
    quantize_fp8,
    quantize_fp8_blocks,
)
from moe_sbo.weights import layer_weights

# FP8 experts vs dense experts on the same (dequantised) weights: the MLP quantises two activations
# (x, then silu(gate) * up), each rounded by ~2.6% RMS (test_activation_rounding_is_e4m3s), so the
# expert outputs differ by ~4%; shared experts (dense) and the combine's weighted sum dilute it.
FP8_REL_TOL = 6e-2
FLOAT32_TOL = 1e-5
# The Triton kernels on CPU tensors run only in the interpreter (conftest sets it without CUDA; on a
# CUDA machine tests/experts/test_gpu_fp8.py runs them on the GPU).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def _small(preset: str):
    """The preset's routing at CPU-test size: sizes multiples of 128, as FP8 experts need."""
    return get_preset(preset).with_num_experts(8).replace(hidden_size=256, moe_intermediate_size=128)


def _same_modulo_interpreter_carry(got_q: torch.Tensor, ref_q: torch.Tensor) -> bool:
    got, ref = got_q.float(), ref_q.float()
    # ... and in e4m3's subnormal range (|q| < 2^-6) it may land one subnormal step (2^-9) off.
    return bool(((got == ref) | (2 * got == ref) | ((got - ref).abs() <= 2.0**-9)).all())


def test_activation_rounding_is_e4m3s():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    rel = _rel(dequantize_fp8(*quantize_fp8(x), torch.float32), x)
    assert 0.02 < rel < 0.03  # 3 mantissa bits: <= 2^-4 per value, ~2.6% RMS on Gaussian data


def test_weight_blocks_round_trip_with_partial_edge_tiles():
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(3, 200, 300, generator=generator) * torch.exp(torch.randn(3, 1, 1, generator=generator))
    w[1, :128, :128] = 0  # an all-zero tile stays finite
    q, scale_inv = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2, 3)
    back = dequantize_fp8_blocks(q, scale_inv)
    assert back.isfinite().all() and torch.equal(back[1, :128, :128], torch.zeros(128, 128))
    tile_amax = scale_inv.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :300] * 448
    assert ((back - w).abs() <= 2.0**-4 * w.abs() + 2.0**-9 * tile_amax / 448).all()


@pytest.mark.parametrize(
    "config",
    [
        None,
        *fp8_gemm.GEMM_CONFIGS,
        fp8_gemm.GemmConfig(64, 256, 4, 8, 3),
        fp8_gemm.GemmConfig(64, 64, 1, 4, 4),
        fp8_gemm.GemmConfig(64, 64, 1, 4, 4, tma=True),
        fp8_gemm.GemmConfig(64, 256, 4, 8, 3, tma=True),
    ],
)
@pytest.mark.parametrize("k_major", [False, True], ids=["row-major-scales", "k-major-scales"])
@interpreted
def test_grouped_gemm_kernel_matches_torch_reference(config, k_major):
    generator = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 70, 1, 0, 9])
    offsets = counts.cumsum(0).to(torch.int32)
    rows = int(counts.sum()) + 5  # padding rows past the last expert: neither read nor written
    x = torch.randn(rows, 256, generator=generator)
    w = torch.randn(len(counts), 384, 256, generator=generator) * 256**-0.5
    q, s = quantize_fp8(x)
    wq, ws = quantize_fp8_blocks(w)
    s_in = empty_k_major_scales(rows, 2).copy_(s) if k_major else s
    got = fp8_gemm.grouped_gemm(q, s_in, wq, ws, offsets, torch.float32, config)
    ref = grouped_linear_fp8(q, s, wq, ws, offsets, torch.float32)
    real = int(offsets[-1])
    assert _rel(got[:real], ref[:real]) < FLOAT32_TOL
    # Dense float32 math on the dequantised operands: the block-scaled sum is that product.
    dense = torch.cat(
        [
            dequantize_fp8(q, s, torch.float32)[a:b] @ dequantize_fp8_blocks(wq[e], ws[e]).T
            for e, (a, b) in enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist()))
        ]
    )
    assert _rel(got[:real], dense) < FLOAT32_TOL


@interpreted
@pytest.mark.parametrize("block_m", [128, 192])
@pytest.mark.parametrize(
    "counts", [[3, 0, 70, 1, 0, 9], [0, 0, 0], [129], [1] * 5 + [300], [0, 1, 130, 2000, 77], [1, 2] * 40]
)
def test_sm90_tile_schedule_covers_every_row_once_per_column_tile(counts, block_m):
    """The sm90 kernel's schedule (``fp8_gemm_sm90.tile_schedule``, tiles of 2 or 3 warp groups' 64
    rows): each live tile starts on a row that is a multiple of 4 (its scales' TMA box needs 16
    bytes' alignment) at most 3 rows before its expert's, and ends inside the expert; live tiles come
    before the dead ones (-1), fit the grid's worst case (many experts of 1-2 rows), and cover every
    real row once per column tile, counting each tile's rows from its expert's first."""
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    num_rows, n = int(offsets[-1]) + 7, 384
    tiles = fp8_gemm_sm90.tile_schedule(offsets, num_rows, n, block_m)
    starts = [0, *offsets[:-1].tolist()]
    covered = torch.zeros(num_rows, n // fp8_gemm_sm90.BLOCK_N, dtype=torch.int64)
    experts = tiles[:, 0].tolist()
    live = sum(e >= 0 for e in experts)
    assert all(e >= 0 for e in experts[:live]) and all(e == -1 for e in experts[live:])
    for expert, first, end, pid_n, begin in tiles[:live].tolist():
        assert begin == starts[expert] and first % 4 == 0 and begin - 3 <= first < end <= offsets[expert]
        assert end - first <= block_m
        covered[max(first, begin) : end, pid_n] += 1
    assert (covered[: int(offsets[-1])] == 1).all() and (covered[int(offsets[-1]) :] == 0).all()


def test_the_sm90_kernel_is_not_chosen_off_hopper_and_refuses_clearly():
    """CPU tensors (and any GPU but sm90) keep the Triton kernel; a direct call says why it cannot run."""
    q, s = torch.zeros(600, 256, dtype=torch.float8_e4m3fn), torch.ones(600, 2)
    wq, ws = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 1, 2)
    assert not fp8_gemm_sm90.supported(q, wq)
    assert "needs Triton's Gluon and an sm90 GPU" in FP8_SM90.supports(Conditions.of(q, True, 300))
    offsets = torch.tensor([300, 600], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs Triton's Gluon, an sm90 GPU"):
        fp8_gemm_sm90.grouped_gemm(q, s, wq, ws, offsets, torch.float32)
    with pytest.raises(ValueError, match="consumers must be 2 or 3"):
        fp8_gemm_sm90.grouped_gemm(q, s, wq, ws, offsets, torch.float32, fp8_gemm_sm90.WarpSpecializedConfig(4))
    # Two products per warp group fit only two consumers' registers.
    three_unrolled = dataclasses.replace(fp8_gemm_sm90.DEFAULT_CONFIG, k_unroll=2)
    with pytest.raises(ValueError, match="k_unroll must be 1, or above 1 with two consumers"):
        fp8_gemm_sm90.grouped_gemm(q, s, wq, ws, offsets, torch.float32, three_unrolled)


def test_sm90_kernel_takes_two_consumers_up_to_1024_rows_per_expert():
    """``fp8_gemm_sm90.grouped_gemm`` without a config: 128-row tiles (two consumer warp groups) where
    192-row tiles would pad more of each expert, three consumers above."""
    assert fp8_gemm_sm90.config_for(fp8_gemm_sm90.TWO_CONSUMERS_MAX_ROWS_PER_EXPERT).block_m == 128
    assert fp8_gemm_sm90.config_for(fp8_gemm_sm90.TWO_CONSUMERS_MAX_ROWS_PER_EXPERT + 1).block_m == 192
    # Registers: each consumer 128 threads, the loader one warp, within the SM's 64K.
    for config in (fp8_gemm_sm90.DEFAULT_CONFIG, fp8_gemm_sm90.TWO_CONSUMERS_CONFIG):
        assert config.consumers * 128 * config.consumer_regs + 32 * config.loader_regs <= 65536


@interpreted
def test_the_sm90_route_quantises_k_major_and_takes_the_triton_kernel_for_operands_it_cannot_address(monkeypatch):
    """``fp8_sm90`` quantises the scales K-major (the sm90 kernel loads them so; ``fp8_triton`` keeps
    them row-major) and, for operands ``fp8_gemm_sm90.supported`` refuses (here: CPU tensors), runs
    the Triton kernel on them: the same outputs as ``fp8_triton``."""
    generator = torch.Generator().manual_seed(8)
    experts = RoutedExperts(2, 256, 128, fp8=True)
    for local in range(2):
        experts.set_expert(
            local, torch.randn(256, 256, generator=generator), torch.randn(256, 128, generator=generator)
        )
    counts = torch.tensor([5, 3])
    rows = ExpertRows(torch.randn(8, 256, generator=generator), counts.cumsum(0).to(torch.int32), counts, 4.0)
    k_majors = []
    quantize_rows = quant_kernels.quantize_rows
    monkeypatch.setattr(
        quant_kernels,
        "quantize_rows",
        lambda *a, k_major: k_majors.append(k_major) or quantize_rows(*a, k_major=k_major),
    )
    with torch.no_grad():
        sm90, triton = FP8_SM90.run(experts, rows), FP8_TRITON.run(experts, rows)
    assert k_majors == [True, False]
    torch.testing.assert_close(sm90, triton, rtol=0, atol=0)


def test_fp8_experts_choose_their_gemms_by_the_rows_to_expect(monkeypatch):
    """``RoutedExperts.forward`` with ``expected_rows`` (padding after the real rows, as ``low_latency``
    hands them over): the FP8 GEMMs are chosen for the real rows per expert, not for every row."""
    experts = RoutedExperts(4, 256, 128, fp8=True)
    experts.kernels = "triton"
    generator = torch.Generator().manual_seed(7)
    for local in range(4):
        experts.set_expert(
            local, torch.randn(256, 256, generator=generator), torch.randn(256, 128, generator=generator)
        )
    chosen = []
    grouped_gemm = fp8_gemm.grouped_gemm
    monkeypatch.setattr(
        fp8_gemm,
        "grouped_gemm",
        lambda *args, **kwargs: chosen.append(kwargs["rows_per_expert"]) or grouped_gemm(*args, **kwargs),
    )
    x = torch.randn(64, 256, generator=generator)
    counts = torch.tensor([3, 0, 5, 2])
    padded = experts(x, counts, expected_rows=12)
    assert chosen == [3.0, 3.0]  # 12 real rows to expect over 4 experts, not 64 / 4
    chosen.clear()
    torch.testing.assert_close(padded[:10], experts(x[:10], counts)[:10], rtol=0, atol=0)
    assert chosen == [2.5, 2.5]


def test_grouped_gemm_refuses_a_k_step_other_than_the_scale_block():
    q, s = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    wq, ws = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 1, 2)
    config = fp8_gemm.GemmConfig(64, 128, 4, 4, 4, block_k=64)
    with pytest.raises(ValueError, match="block_k=64"):
        fp8_gemm.grouped_gemm(q, s, wq, ws, torch.tensor([2, 4], dtype=torch.int32), torch.float32, config)


@pytest.mark.parametrize("k_major", [False, True], ids=["row-major-scales", "k-major-scales"])
@interpreted
def test_quantisers_match_torch(k_major):
    """Both quantisers against ``quantize_fp8``, their scales row-major or K-major (strides (1, rows
    rounded up to 4): 40 rows -> 40, 37 -> 40)."""
    generator = torch.Generator().manual_seed(3)
    offsets = torch.tensor([10, 10, 37], dtype=torch.int32)
    x = torch.randn(40, 384, generator=generator) * torch.exp(torch.randn(40, 1, generator=generator))
    q, s = quant_kernels.quantize_rows(x, offsets, k_major=k_major)
    assert s.shape == (40, 3) and s.stride() == ((1, 40) if k_major else (3, 1))
    q_ref, s_ref = quantize_fp8(x[:37])
    assert torch.equal(s[:37], s_ref) and _same_modulo_interpreter_carry(q[:37], q_ref)
    h = torch.randn(37, 2 * 256, generator=generator)
    q, s = quant_kernels.silu_mul_quantize(h, offsets, k_major=k_major)
    assert s.shape == (37, 2) and s.stride() == ((1, 40) if k_major else (2, 1))
    gate, up = h.chunk(2, dim=-1)
    q_ref, s_ref = quantize_fp8(F.silu(gate) * up)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # silu as x * sigmoid(x) in the kernel: a last-bit difference may move a value one e4m3 step.
    one_step = (q.float() - q_ref.float()).abs() <= 2.0**-3 * q_ref.float().abs()
    assert _same_modulo_interpreter_carry(q[~one_step], q_ref[~one_step])


@pytest.mark.parametrize("num_rows", [1, 7, 40])
def test_k_major_scales_are_read_where_they_lie_and_others_copied(num_rows):
    """``k_major_scales``: the [Q, X] transpose of K-major scales is a view of them; row-major scales
    (fp8 dispatch's) are copied into that layout, the row stride rounded up to 4 (16 bytes)."""
    scales = torch.rand(num_rows, 5)
    k_major = empty_k_major_scales(num_rows, 5).copy_(scales)
    view = k_major_scales(k_major)
    assert view.data_ptr() == k_major.data_ptr() and torch.equal(view, scales.t())
    copied = k_major_scales(scales)
    assert torch.equal(copied, scales.t()) and copied.stride() == (-(-num_rows // 4) * 4, 1)
    assert copied.data_ptr() != scales.data_ptr()


@interpreted
def test_quantize_rows_reads_through_an_index_and_a_row_stride():
    """The gather fused into the quantisation: row r quantises ``x[rows[r]]`` of a strided view (a
    receive buffer wider than H), as the copy ``x.index_select(0, rows)`` quantised; padding rows
    past the last offset stay unwritten."""
    generator = torch.Generator().manual_seed(4)
    buffer = torch.randn(30, 512, generator=generator)
    x = buffer[:, :384]  # row stride 512
    # Index entries of padding rows (past the last offset) may point anywhere: they are never read.
    rows = torch.cat([torch.randperm(30, generator=generator)[:19], torch.full((2,), 1 << 40)])
    offsets = torch.tensor([5, 5, 19], dtype=torch.int32)
    q, s = quant_kernels.quantize_rows(x, offsets, rows)
    q_ref, s_ref = quantize_fp8(x.index_select(0, rows[:19]))
    assert q.shape == (21, 384) and s.shape == (21, 3)
    assert torch.equal(s[:19], s_ref) and _same_modulo_interpreter_carry(q[:19], q_ref)
    q_k, s_k = quant_kernels.quantize_rows(x, offsets, rows, k_major=True)
    assert torch.equal(q_k[:19].float(), q[:19].float()) and torch.equal(s_k[:19], s[:19])
    with pytest.raises(ValueError, match="integer"):
        quant_kernels.quantize_rows(x, offsets, rows.float())
    with pytest.raises(ValueError, match="contiguous along H"):
        quant_kernels.quantize_rows(buffer.t(), offsets)


@pytest.mark.parametrize("kernels", [pytest.param("triton", marks=interpreted), "torch"])
def test_fp8_experts_read_rows_through_an_index_as_the_gathered_rows(kernels):
    """``RoutedExperts.forward`` with ``rows_R`` (``low_latency``'s ``index_rows``): the Triton path
    quantises the rows where they lie through the index, the torch path gathers them first; both equal
    the experts on the gathered rows."""
    generator = torch.Generator().manual_seed(6)
    experts = RoutedExperts(3, 256, 128, fp8=True)
    for local in range(3):
        gate_up, down = torch.randn(256, 256, generator=generator), torch.randn(256, 128, generator=generator)
        experts.set_expert(local, gate_up, down)
    experts.kernels = kernels
    counts = torch.tensor([4, 0, 9])
    buffer = torch.randn(20, 256, generator=generator)
    rows = torch.cat([torch.randperm(20, generator=generator)[:13], torch.full((3,), 19)])  # 3 padding rows
    got = experts(buffer, counts, rows_R=rows)
    expected = experts(torch.cat([buffer.index_select(0, rows[:13]), torch.zeros(3, 256)]), counts)
    assert got.shape == (16, 256)
    torch.testing.assert_close(got[:13], expected[:13], rtol=0, atol=0)


@interpreted
def test_fp8_layer_quantises_low_latency_rows_in_place_as_the_copy(monkeypatch):
    """``low_latency`` with ``index_rows`` (bf16 dispatch) feeding FP8 experts: the experts quantise
    the received rows through the layout's index, and the layer's output equals the layer whose
    dispatch copies the rows into expert order."""
    cfg = _small("deepseek-v3")
    layers = {
        flag: MoELayer(
            cfg,
            dispatcher="low_latency",
            seed=3,
            expert_dtype="fp8",
            dispatcher_options={"max_tokens_per_rank": 16, "kernels": "triton", "index_rows": flag},
        )
        for flag in (False, True)
    }
    for layer in layers.values():
        layer.experts.kernels = "triton"
    indexed = []
    quantize_rows = quant_kernels.quantize_rows
    monkeypatch.setattr(
        quant_kernels,
        "quantize_rows",
        lambda x, offsets, rows=None, **kw: indexed.append(rows is not None) or quantize_rows(x, offsets, rows, **kw),
    )
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = layers[True](x), layers[False](x)
    assert indexed == [True, False]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3", "qwen3-30b-a3b"])
def test_fp8_layer_matches_dense_layer_on_dequantised_weights(preset):
    cfg = _small(preset)
    fp8 = MoELayer(cfg, seed=4, expert_dtype="fp8")
    dense = MoELayer(cfg, seed=0)
    dense.load_weights(layer_weights(fp8))
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, expected = fp8(x), dense(x)
    assert 0.003 < _rel(got, expected) <= FP8_REL_TOL  # quantised (not a copy), within the bound
    # A dense layer loaded from FP8 weights holds exactly their dequantisation.
    gate_up, down = fp8.experts.dense_expert(3)
    assert torch.equal(dense.experts.gate_up_proj[3], gate_up) and torch.equal(dense.experts.down_proj[3], down)


def test_fp8_layer_loads_dense_weights_by_quantising_them():
    cfg = _small("deepseek-v3")
    dense, fp8 = MoELayer(cfg, seed=6), MoELayer(cfg, seed=0, expert_dtype="fp8")
    fp8.load_weights(layer_weights(dense))
    q, scale_inv = quantize_fp8_blocks(dense.experts.down_proj[5])
    assert torch.equal(fp8.experts.down_proj[5].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8.experts.down_proj_scale_inv[5], scale_inv)


def _ep_rank(device, dispatcher, options):
    cfg = _small("deepseek-v3")
    rank = dist.get_rank()
    x = torch.randn([12, 5][rank], cfg.hidden_size, generator=torch.Generator().manual_seed(10 + rank))
    layer = MoELayer(cfg, dispatcher=dispatcher, dispatcher_options=options, seed=7, expert_dtype="fp8")
    reference = MoELayer(cfg, dispatcher="local", seed=7, expert_dtype="fp8")
    with torch.no_grad():
        return _rel(layer(x), reference(x)), layer.dispatcher.deliver_fp8


@pytest.mark.parametrize(
    "dispatcher, options, delivered",
    [
        ("alltoall", {}, False),
        ("low_latency", {"max_tokens_per_rank": 16, "kernels": "torch"}, False),
        ("low_latency", {"max_tokens_per_rank": 16, "kernels": "torch", "fp8": True}, True),
        pytest.param(
            "low_latency", {"max_tokens_per_rank": 16, "kernels": "triton", "fp8": True}, True, marks=interpreted
        ),
    ],
)
def test_fp8_experts_at_ep2_equal_one_rank(ranks2, dispatcher, options, delivered):
    # fp8 dispatch quantises x exactly as the experts would (same groups and scales) and hands the
    # e4m3 rows over as they arrived: equal to one rank up to summation order. (The Triton path's
    # interpreter quantiser has the carry bug, so its bound is the FP8 one.)
    tol = FP8_REL_TOL if options.get("kernels") == "triton" else FLOAT32_TOL
    for rel, deliver_fp8 in ranks2.run(_ep_rank, dispatcher, options):
        assert rel <= tol and deliver_fp8 == delivered


def test_bad_fp8_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="expert_dtype must be one of"):
        MoELayer(_small("deepseek-v3"), expert_dtype="int8")
    with pytest.raises(ValueError, match="multiples of 128.*hidden_size.*expert_dtype=None"):
        MoELayer(get_preset("tiny"), expert_dtype="fp8")
    dense = RoutedExperts(2, 128, 128)
    with pytest.raises(ValueError, match="scales_RQ is for FP8 experts"):
        dense(torch.zeros(4, 128), torch.tensor([2, 2]), torch.ones(4, 1))
    fp8 = MoELayer(_small("deepseek-v3"), expert_dtype="fp8")
    weights = layer_weights(fp8)
    with pytest.raises(ValueError, match="need both gate_up_proj_scale_inv and down_proj_scale_inv"):
        fp8.load_weights(type(weights)(**{**vars(weights), "down_proj_scale_inv": None}))
    fp8.experts.kernels = "scaled_mm"
    with pytest.raises(ValueError, match="needs an sm90 CUDA device"):
        fp8(torch.zeros(2, 256))

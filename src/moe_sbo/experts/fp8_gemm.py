"""The block-scaled FP8 grouped GEMM of the routed experts: e4m3 rows grouped by expert times each
expert's e4m3 weight, DeepSeek-V3's recipe (1x128 activation scales, 128x128 weight block scales).

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

One FP8 expert MLP is four launches::

    quantize_rows       x [R, H] -> e4m3 [R, H] and scales [R, H/128] (``quant.kernels``; skipped when
                        the rows arrive in fp8 from ``low_latency``'s fp8 dispatch)
    grouped_gemm        gate_up: [R, H] x [L, 2I, H]^T -> [R, 2I] in the activation dtype
    silu_mul_quantize   silu(gate) * up -> e4m3 [R, I] and scales [R, I/128] (``quant.kernels``)
    grouped_gemm        down: [R, I] x [L, H, I]^T -> [R, H]

This is the Triton implementation (counts on the device, no host sync, CUDA-graph capturable); at
prefill sizes on Hopper ``grouped_gemm`` hands the same call to ``fp8_gemm_sm90.py``, a
warp-specialised Gluon kernel 22-37 % faster from 1024 rows per expert (``use_sm90_kernel`` says
when). ``fp8_torch.py`` holds the same contract in torch: cuBLAS's block-wise ``torch._scaled_mm``
per expert (sm90, counts on the host) and the float32 reference that CPU ranks run.

The hard part is the schedule without a host sync: device row offsets, a grid sized for the worst
case, each program finding its expert and tile by a prefix sum (``tiled_gemm.expert_tile``, shared
with the dense experts' tiled GEMM). Each K step of 128 values multiplies e4m3 tiles on the tensor
cores (exact float32 products) and scales the partial sum by the row's activation scale and the
column block's weight scale, as DeepGEMM and vLLM's ``fused_moe`` do. From 128 rows per expert the
operand tiles come by the tensor memory accelerator (``GemmConfig.tma``: host-side descriptors over
the rows and over the weights as ``[L * N, K]``): 6-12 % faster than per-thread loads on H200
(``gemm_config`` says where).

What did not pay, measured on H200 with Triton 3.6 (docs/FP8.md, "Kernel choices"): Triton's warp
specialisation of the K loop (it compiled only for two-warp-group tiles, and gained 0-4 % there), a
persistent grid (-19 to +1 %), and SwiGLU with its quantisation in gate_up's epilogue (two
accumulators: as fast as the separate ``silu_mul_quantize`` launch without descriptors, 30-40 %
slower with them).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..quant.fp8 import FP8_BLOCK, FP8_GROUP
from . import fp8_gemm_sm90
from .tiled_gemm import GemmConfig, expert_tile, max_tiles, tma_ready

GROUP_V = tl.constexpr(FP8_GROUP)


# Measured on H200 (``moe-sbo bench fp8-experts --sweep-only``, DeepSeek-V3 dims, docs/FP8.md): 64 x 128 tiles
# with one warp group win up to 256 rows per expert (weight-read bound, then one weight scale per step
# keeps the scaling cheap); from there 128 x 128 tiles with two warp groups and four stages. Descriptor
# loads were 6-12 % faster on the GPU from 128 rows per expert, but Triton encodes the descriptors on
# the host at each launch, and eager forwards with few rows are bound by host time already (8 experts
# x 64-128 rows: 2.5-2.7x their replay). So below LARGE_CONFIG they are used only where that cost is
# paid once, in a CUDA graph capture.
DECODE_CONFIG = GemmConfig(block_m=64, block_n=128, group_m=4, num_warps=4, num_stages=4)
LARGE_CONFIG = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4, tma=True)
GEMM_CONFIGS = (DECODE_CONFIG, dataclasses.replace(DECODE_CONFIG, tma=True), LARGE_CONFIG)
TMA_MIN_ROWS_PER_EXPERT = 128
LARGE_MIN_ROWS_PER_EXPERT = 256  # above: LARGE_CONFIG, or the sm90 kernel where it runs
# Under CUDA-graph capture the sm90 kernel from here (its descriptors and schedule launch cost the host,
# as descriptor loads do, so eagerly it waits for LARGE_MIN_ROWS_PER_EXPERT): replayed on H200, 8-32
# experts x 128-256 rows, 8-13 % faster than the best Triton tiles on gate_up and 8-22 % on down
# (docs/BENCHMARKS.md).
SM90_CAPTURED_MIN_ROWS_PER_EXPERT = 128


def use_sm90_kernel(
    q_RK: torch.Tensor, w_LNK: torch.Tensor, capturing: bool = False, rows_per_expert: float | None = None
) -> bool:
    """Whether ``grouped_gemm`` without a ``config`` runs ``fp8_gemm_sm90``'s warp-specialised kernel
    for these operands: prefill sizes (more than ``LARGE_MIN_ROWS_PER_EXPERT`` rows per expert on
    average; from ``SM90_CAPTURED_MIN_ROWS_PER_EXPERT`` when ``capturing`` a CUDA graph) where that
    kernel runs (sm90, Gluon; ``fp8_gemm_sm90.supported``). ``rows_per_expert``: the rows to expect
    per expert (default R / L; ``grouped_gemm``'s)."""
    if rows_per_expert is None:
        rows_per_expert = q_RK.shape[0] / w_LNK.shape[0]
    return sm90_sizes(rows_per_expert, capturing) and fp8_gemm_sm90.supported(q_RK, w_LNK)


def sm90_sizes(rows_per_expert: float, capturing: bool) -> bool:
    """Whether ``rows_per_expert`` rows per expert are the sm90 kernel's sizes (``use_sm90_kernel``)."""
    return rows_per_expert > LARGE_MIN_ROWS_PER_EXPERT or (
        capturing and rows_per_expert >= SM90_CAPTURED_MIN_ROWS_PER_EXPERT
    )


def k_major_scales_wanted(device: torch.device, rows_per_expert: float) -> bool:
    """Whether the MLP's quantisers should write the activation scales K-major
    (``quant.fp8.empty_k_major_scales``) for a forward of ``rows_per_expert`` rows per expert: where
    ``grouped_gemm`` runs the sm90 kernel, which loads them so (others it copies first). The Triton
    kernel reads either layout; at decode sizes the MLP ran 7-10 % slower on K-major scales (H200)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return fp8_gemm_sm90.device_supported(device) and sm90_sizes(rows_per_expert, capturing)


def gemm_config(rows_per_expert: float, capturing: bool = False) -> GemmConfig:
    """The tiles for ``rows_per_expert`` rows per expert on average (the grid depends on rows only,
    so a CUDA graph captured at one size keeps its config whatever the routing); ``capturing``: the
    launch is being captured into a CUDA graph (descriptor loads from ``TMA_MIN_ROWS_PER_EXPERT``)."""
    if rows_per_expert > LARGE_MIN_ROWS_PER_EXPERT:
        return LARGE_CONFIG
    return dataclasses.replace(DECODE_CONFIG, tma=capturing and rows_per_expert >= TMA_MIN_ROWS_PER_EXPERT)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    offsets_ptr,
    a_scale_stride_r,  # the activation scales' strides (row-major or K-major: quant.kernels' k_major)
    a_scale_stride_q,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
):
    BLOCK_K: tl.constexpr = GROUP_V  # one activation scale and one weight scale per K step
    KQ: tl.constexpr = K // BLOCK_K
    NQ: tl.constexpr = (N + BLOCK_K - 1) // BLOCK_K
    NUM_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    live, expert, offs_m, m_mask, pid_n = expert_tile(
        tl.program_id(0), offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N, GROUP_M
    )
    if not live:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows64 = offs_m.to(tl.int64)
    # A descriptor's tile past the tensor's end reads zeros; rows or columns of the next expert that a
    # tile takes in (its last row or column tile) reach only outputs the store leaves out.
    if A_TMA:
        first_row = tl.min(offs_m, axis=0)
    else:
        a_tile = a_ptr + rows64[:, None] * K + offs_k[None, :]
    if B_TMA:
        first_col = expert * N + pid_n * BLOCK_N
    else:
        b_tile = b_ptr + expert.to(tl.int64) * N * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    a_scales = a_scale_ptr + rows64 * a_scale_stride_r
    b_scales = b_scale_ptr + expert.to(tl.int64) * NQ * KQ + (offs_n // BLOCK_K) * KQ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A tile at most one weight block wide has one weight scale per K step: a scalar, so each step
    # costs one multiply-add per accumulator element instead of an outer product of scales.
    ONE_B_SCALE: tl.constexpr = BLOCK_N <= BLOCK_K
    b_scale_tile = b_scale_ptr + expert.to(tl.int64) * NQ * KQ + (pid_n * BLOCK_N // BLOCK_K) * KQ
    for kq in range(KQ):
        if A_TMA:
            a = a_ptr.load([first_row, kq * BLOCK_K])
        else:
            a = tl.load(a_tile + kq * BLOCK_K, mask=m_mask[:, None], other=0.0)
        if B_TMA:
            b = b_ptr.load([first_col, kq * BLOCK_K]).T
        else:
            b = tl.load(b_tile + kq * BLOCK_K, mask=n_mask[None, :], other=0.0)
        scale_a = tl.load(a_scales + kq * a_scale_stride_q, mask=m_mask, other=0.0)
        if ONE_B_SCALE:
            acc += tl.dot(a, b) * (scale_a * tl.load(b_scale_tile + kq))[:, None]
        else:
            scale_b = tl.load(b_scales + kq, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * scale_a[:, None] * scale_b[None, :]
    c_tile = c_ptr + rows64[:, None] * N + offs_n[None, :]
    tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_gemm(
    q_RK: torch.Tensor,
    scales_RQ: torch.Tensor,
    w_LNK: torch.Tensor,
    w_scale_inv_LNQ: torch.Tensor,
    offsets_L: torch.Tensor,
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
    rows_per_expert: float | None = None,
) -> torch.Tensor:
    """e4m3 rows ``q_RK`` (scales ``[R, K/128]``, row-major or K-major: ``quant.fp8.k_major_scales``;
    the sm90 kernel copies row-major ones K-major first) grouped by expert times each expert's e4m3 weight
    ``w_LNK[l]`` transposed (block scales ``[L, N/128, K/128]``) -> ``[R, N]`` in ``out_dtype``.

    ``offsets_L``: int32 cumulative row counts on the device; rows past ``offsets_L[-1]`` are left
    unwritten. K must be a multiple of 128. Without ``config``: ``fp8_gemm_sm90``'s kernel where
    ``use_sm90_kernel`` says (by rows per expert, and whether a CUDA graph is being captured), else
    this Triton kernel with ``gemm_config(R / L, capturing a CUDA graph)``; a ``config`` always runs
    the Triton kernel, its ``tma`` where a descriptor can address the tensor (``tiled_gemm.tma_ready``).
    ``rows_per_expert`` (default R / L): the rows per expert the kernel and tiles are chosen for, the
    real rows to expect where padding follows them (``low_latency`` hands over P x C x K rows, C x K of
    them real on average), as the dense experts choose theirs; the grid still covers all R rows.
    """
    num_rows, k = q_RK.shape
    num_experts, n, _ = w_LNK.shape
    if k % FP8_BLOCK:
        raise ValueError(f"the reduction size must be a multiple of {FP8_BLOCK} for FP8 experts, got {k}")
    if config is not None and config.block_k != FP8_BLOCK:
        raise ValueError(f"FP8 experts step K by their scale block, {FP8_BLOCK}: got block_k={config.block_k}")
    capturing = q_RK.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if rows_per_expert is None:
        rows_per_expert = num_rows / num_experts
    if config is None and use_sm90_kernel(q_RK, w_LNK, capturing, rows_per_expert):
        sm90_config = fp8_gemm_sm90.config_for(rows_per_expert)
        return fp8_gemm_sm90.grouped_gemm(q_RK, scales_RQ, w_LNK, w_scale_inv_LNQ, offsets_L, out_dtype, sm90_config)
    out_RN = torch.empty(num_rows, n, dtype=out_dtype, device=q_RK.device)
    if num_rows == 0:
        return out_RN
    config = config or gemm_config(rows_per_expert, capturing)
    a_tma = config.tma and tma_ready(q_RK)
    b_tma = config.tma and tma_ready(w_LNK)
    _grouped_gemm_kernel[(max_tiles(num_rows, num_experts, n, config),)](
        TensorDescriptor.from_tensor(q_RK, [config.block_m, FP8_BLOCK]) if a_tma else q_RK,
        scales_RQ,
        TensorDescriptor.from_tensor(w_LNK.view(num_experts * n, k), [config.block_n, FP8_BLOCK]) if b_tma else w_LNK,
        w_scale_inv_LNQ,
        out_RN,
        offsets_L,
        *scales_RQ.stride(),
        N=n,
        K=k,
        NUM_EXPERTS=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        GROUP_M=config.group_m,
        A_TMA=a_tma,
        B_TMA=b_tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out_RN

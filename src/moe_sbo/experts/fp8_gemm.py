"""The block-scaled FP8 grouped GEMM of the routed experts: e4m3 rows grouped by expert times each
expert's e4m3 weight, DeepSeek-V3's recipe (1x128 activation scales, 128x128 weight block scales).

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

One FP8 expert MLP is four launches::

    quantize_rows       x [R, H] -> e4m3 [R, H] and scales [R, H/128] (``quant.kernels``; skipped when
                        the rows arrive in fp8 from ``low_latency``'s fp8 dispatch)
    grouped_gemm        gate_up: [R, H] x [L, 2I, H]^T -> [R, 2I] in the activation dtype
    silu_mul_quantize   silu(gate) * up -> e4m3 [R, I] and scales [R, I/128] (``quant.kernels``)
    grouped_gemm        down: [R, I] x [L, H, I]^T -> [R, H]

This is the Triton implementation (counts on the device, no host sync, CUDA-graph capturable). The
other implementations of the same contract: ``fp8_gemm_sm90.py``, a warp-specialised Gluon kernel for
Hopper at prefill sizes, and ``fp8_torch.py``, cuBLAS's block-wise ``torch._scaled_mm`` per expert
(sm90, counts on the host) and the float32 reference that CPU ranks run. Which one runs is
``experts.select``'s rule.

The hard part is the schedule without a host sync: device row offsets, a grid sized for the worst
case, each program finding its expert and tile by a prefix sum (``tiles.expert_tile``, shared with
the dense experts' tiled GEMM). Each K step of 128 values multiplies e4m3 tiles on the tensor cores
(exact float32 products) and scales the partial sum by the row's activation scale and the column
block's weight scale, as DeepGEMM and vLLM's ``fused_moe`` do. Operand tiles come by the tensor
memory accelerator (``GemmConfig.tma``: host-side descriptors over the rows and over the weights as
``[L * N, K]``) where ``gemm_config`` says.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..quant.fp8 import FP8_BLOCK, FP8_GROUP
from .tiles import GemmConfig, expert_tile, max_tiles, tma_ready

GROUP_V = tl.constexpr(FP8_GROUP)


# Tiles (``moe-sbo bench fp8-experts --sweep-only`` chose them; docs/FP8.md): 64 x 128 tiles with one warp
# group up to LARGE_MIN_ROWS_PER_EXPERT rows per expert (weight-read bound, and one weight scale per K
# step keeps the scaling cheap), 128 x 128 tiles with two warp groups and four stages above. Descriptor
# loads from TMA_MIN_ROWS_PER_EXPERT, but Triton encodes the descriptors on the host at each launch, so
# below LARGE_CONFIG they are used only where that cost is paid once, in a CUDA graph capture.
DECODE_CONFIG = GemmConfig(block_m=64, block_n=128, group_m=4, num_warps=4, num_stages=4)
LARGE_CONFIG = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4, tma=True)
GEMM_CONFIGS = (DECODE_CONFIG, dataclasses.replace(DECODE_CONFIG, tma=True), LARGE_CONFIG)
TMA_MIN_ROWS_PER_EXPERT = 128
LARGE_MIN_ROWS_PER_EXPERT = 256


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
    unwritten. K must be a multiple of 128. ``config`` defaults to ``gemm_config(rows_per_expert,
    capturing a CUDA graph)``; its ``tma`` applies where a descriptor can address the tensor
    (``tiles.tma_ready``). ``rows_per_expert`` (default R / L): the rows per expert the tiles are
    chosen for, the real rows to expect where padding follows them (``low_latency`` hands over
    P x C x K rows, C x K of them real on average); the grid still covers all R rows.
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

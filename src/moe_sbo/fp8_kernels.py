"""Triton kernels of the FP8 routed experts: a block-scaled grouped GEMM over expert-sorted rows, and
the two activation quantisers that feed it (``fp8.py``'s format: e4m3, one scale per token and 128 values).

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

One FP8 expert MLP is four launches::

    quantize_rows       grid R x H/1024: x [R, H] -> e4m3 [R, H] and scales [R, H/128] (skipped when
                        the rows arrive in fp8 from ``low_latency``'s fp8 dispatch)
    grouped_gemm        gate_up: [R, H] x [L, 2I, H]^T -> [R, 2I] in the activation dtype
    silu_mul_quantize   grid R x I/1024: silu(gate) * up -> e4m3 [R, I] and scales [R, I/128]
    grouped_gemm        down: [R, I] x [L, H, I]^T -> [R, H]

The grouped GEMM's schedule without a host sync (device row offsets, a grid sized for the worst
case, each program finding its expert and tile by a prefix sum) is ``grouped_gemm_kernels.expert_tile``,
shared with the dense experts' tiled GEMM: a launch depends only on R, so a CUDA graph captured at
one R replays for any routing.

Each K step of 128 values multiplies e4m3 tiles on the tensor cores (exact float32 products) and
scales the partial sum by the row's activation scale and the column block's weight scale, as
DeepSeek's block-FP8 recipe (and DeepGEMM, vLLM's ``fused_moe``) do. Rows past the last offset
(padding) are neither read nor written. The kernels also run under ``TRITON_INTERPRET=1`` on CPU
tensors; the tests hold them to ``fp8.py``'s torch reference there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_BLOCK, FP8_DTYPE, FP8_GROUP, FP8_MAX
from .grouped_gemm_kernels import GemmConfig, expert_tile, max_tiles

GROUP_V = tl.constexpr(FP8_GROUP)
E4M3_MAX = tl.constexpr(FP8_MAX)


def block_h_for_quantize(hidden: int) -> int:
    # 1024 values (8 groups) per program: enough work per launch slot, whole groups only.
    return min(1024, max(triton.next_power_of_2(hidden), FP8_GROUP))


# ---- quantisers --------------------------------------------------------------------------------------


@triton.jit
def quantize_values(x_QV):
    """float32 ``[Q, V]`` (V = 128) -> e4m3 ``[Q, V]`` and float32 scales ``[Q]``, as ``fp8.quantize_fp8``:
    amax / 448 per group (floored so a zero group stays finite), an IEEE division (Triton's "/" is
    approximate), clamp, round to nearest e4m3."""
    scale_Q = tl.maximum(tl.max(tl.abs(x_QV), axis=1), 1e-30) / E4M3_MAX
    q_QV = tl.clamp(tl.math.div_rn(x_QV, scale_Q[:, None]), -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    return q_QV, scale_Q


@triton.jit
def quantize_slice(x_row, h0, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """Values ``[h0, h0 + BLOCK_H)`` of the row at ``x_row`` quantised by ``quantize_values``."""
    offs_q = tl.arange(0, BLOCK_H // GROUP_V)
    q_mask = h0 + offs_q * GROUP_V < HIDDEN
    h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
    x_QV = tl.load(x_row + h_QV, mask=q_mask[:, None], other=0.0).to(tl.float32)
    return quantize_values(x_QV)


@triton.jit
def _store_quantized(q_row, s_row, h0, q_QV, scale_Q, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_q = tl.arange(0, BLOCK_H // GROUP_V)
    q_mask = h0 + offs_q * GROUP_V < HIDDEN
    h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
    tl.store(q_row + h_QV, q_QV, mask=q_mask[:, None])
    tl.store(s_row + h0 // GROUP_V + offs_q, scale_Q, mask=q_mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, last_ptr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    if r < tl.load(last_ptr):  # rows past the last expert's end are padding
        h0 = tl.program_id(1) * BLOCK_H
        r64 = r.to(tl.int64)
        q_QV, scale_Q = quantize_slice(x_ptr + r64 * HIDDEN, h0, HIDDEN, BLOCK_H)
        _store_quantized(q_ptr + r64 * HIDDEN, s_ptr + r64 * (HIDDEN // GROUP_V), h0, q_QV, scale_Q, HIDDEN, BLOCK_H)


@triton.jit
def _silu_mul_quantize_kernel(h_ptr, q_ptr, s_ptr, last_ptr, INTER: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    if r < tl.load(last_ptr):
        h0 = tl.program_id(1) * BLOCK_H
        r64 = r.to(tl.int64)
        offs_q = tl.arange(0, BLOCK_H // GROUP_V)
        q_mask = h0 + offs_q * GROUP_V < INTER
        h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
        gate_row = h_ptr + r64 * (2 * INTER)
        gate_QV = tl.load(gate_row + h_QV, mask=q_mask[:, None], other=0.0).to(tl.float32)
        up_QV = tl.load(gate_row + INTER + h_QV, mask=q_mask[:, None], other=0.0).to(tl.float32)
        act_QV = gate_QV * tl.sigmoid(gate_QV) * up_QV
        q_QV, scale_Q = quantize_values(act_QV)
        _store_quantized(q_ptr + r64 * INTER, s_ptr + r64 * (INTER // GROUP_V), h0, q_QV, scale_Q, INTER, BLOCK_H)


def _empty_quantized(num_rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``[X, width]`` values and their float32 ``[X, width/128]`` scales, uninitialised."""
    q = torch.empty(num_rows, width, dtype=FP8_DTYPE, device=device)
    return q, torch.empty(num_rows, width // FP8_GROUP, dtype=torch.float32, device=device)


def quantize_rows(x_RH: torch.Tensor, offsets_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_RH`` -> (e4m3 ``[R, H]``, float32 scales ``[R, H/128]``); rows at or past ``offsets_L[-1]``
    are left unwritten (they belong to no expert)."""
    num_rows, hidden = x_RH.shape
    q_RH, scales_RQ = _empty_quantized(num_rows, hidden, x_RH.device)
    if num_rows:
        block_h = block_h_for_quantize(hidden)
        _quantize_rows_kernel[(num_rows, triton.cdiv(hidden, block_h))](
            x_RH, q_RH, scales_RQ, offsets_L[-1:], HIDDEN=hidden, BLOCK_H=block_h
        )
    return q_RH, scales_RQ


def silu_mul_quantize(gate_up_R2I: torch.Tensor, offsets_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of ``gate_up_R2I`` (gate columns first) quantised: (e4m3 ``[R, I]``, scales ``[R, I/128]``)."""
    num_rows, inter = gate_up_R2I.shape[0], gate_up_R2I.shape[1] // 2
    q_RI, scales_RQ = _empty_quantized(num_rows, inter, gate_up_R2I.device)
    if num_rows:
        block_h = block_h_for_quantize(inter)
        _silu_mul_quantize_kernel[(num_rows, triton.cdiv(inter, block_h))](
            gate_up_R2I, q_RI, scales_RQ, offsets_L[-1:], INTER=inter, BLOCK_H=block_h
        )
    return q_RI, scales_RQ


# ---- the grouped GEMM --------------------------------------------------------------------------------


# Measured on H200 (``bench_fp8_experts.py --sweep``, DeepSeek-V3 dims): 64 x 128 tiles win up to
# 256 rows per expert (weight-read bound, then one weight scale per step keeps the scaling cheap);
# from there 128 x 128 tiles with two warp groups (~790 TFLOP/s on gate_up at 2048 rows).
DECODE_CONFIG = GemmConfig(block_m=64, block_n=128, group_m=4, num_warps=4, num_stages=4)
LARGE_CONFIG = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)
GEMM_CONFIGS = (DECODE_CONFIG, LARGE_CONFIG)


def gemm_config(rows_per_expert: float) -> GemmConfig:
    """The tiles for ``rows_per_expert`` rows per expert on average (the grid depends on rows only,
    so a CUDA graph captured at one size keeps its config whatever the routing)."""
    return DECODE_CONFIG if rows_per_expert <= 256 else LARGE_CONFIG


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    offsets_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
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
    a_tile = a_ptr + rows64[:, None] * K + offs_k[None, :]
    b_tile = b_ptr + expert.to(tl.int64) * N * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    a_scales = a_scale_ptr + rows64 * KQ
    b_scales = b_scale_ptr + expert.to(tl.int64) * NQ * KQ + (offs_n // BLOCK_K) * KQ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A tile at most one weight block wide has one weight scale per K step: a scalar, so each step
    # costs one multiply-add per accumulator element instead of an outer product of scales.
    ONE_B_SCALE: tl.constexpr = BLOCK_N <= BLOCK_K
    b_scale_tile = b_scale_ptr + expert.to(tl.int64) * NQ * KQ + (pid_n * BLOCK_N // BLOCK_K) * KQ
    for kq in range(KQ):
        a = tl.load(a_tile + kq * BLOCK_K, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_tile + kq * BLOCK_K, mask=n_mask[None, :], other=0.0)
        scale_a = tl.load(a_scales + kq, mask=m_mask, other=0.0)
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
) -> torch.Tensor:
    """e4m3 rows ``q_RK`` (scales ``[R, K/128]``) grouped by expert times each expert's e4m3 weight
    ``w_LNK[l]`` transposed (block scales ``[L, N/128, K/128]``) -> ``[R, N]`` in ``out_dtype``.

    ``offsets_L``: int32 cumulative row counts on the device; rows past ``offsets_L[-1]`` are left
    unwritten. K must be a multiple of 128; ``config`` defaults to ``gemm_config(R / L)``.
    """
    num_rows, k = q_RK.shape
    num_experts, n, _ = w_LNK.shape
    if k % FP8_BLOCK:
        raise ValueError(f"the reduction size must be a multiple of {FP8_BLOCK} for FP8 experts, got {k}")
    if config is not None and config.block_k != FP8_BLOCK:
        raise ValueError(f"FP8 experts step K by their scale block, {FP8_BLOCK}: got block_k={config.block_k}")
    out_RN = torch.empty(num_rows, n, dtype=out_dtype, device=q_RK.device)
    if num_rows == 0:
        return out_RN
    config = config or gemm_config(num_rows / num_experts)
    _grouped_gemm_kernel[(max_tiles(num_rows, num_experts, n, config),)](
        q_RK,
        scales_RQ,
        w_LNK,
        w_scale_inv_LNQ,
        out_RN,
        offsets_L,
        N=n,
        K=k,
        NUM_EXPERTS=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out_RN

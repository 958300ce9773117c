"""The block-scaled FP8 grouped GEMM of the routed experts: e4m3 rows grouped by expert times each
expert's e4m3 weight, DeepSeek-V3's recipe (1x128 activation scales, 128x128 weight block scales).

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

One FP8 expert MLP is three launches::

    quantize_rows         x [R, H] -> e4m3 [R, H] and scales [R, H/128] (``quant.kernels``; skipped
                          when the rows arrive in fp8 from ``low_latency``'s fp8 dispatch)
    grouped_gemm_swiglu   gate_up [R, H] x [L, 2I, H]^T, then silu(gate) * up quantised in the
                          epilogue -> e4m3 [R, I] and scales [R, I/128]
    grouped_gemm          down: [R, I] x [L, H, I]^T -> [R, H] in the activation dtype

(``swiglu=False`` configs split the middle one into ``grouped_gemm`` writing gate_up in the activation
dtype and ``quant.kernels.silu_mul_quantize``.) This is the Triton implementation (counts on the
device, no host sync, CUDA-graph capturable); ``fp8_torch.py`` holds the same contract in torch:
cuBLAS's block-wise ``torch._scaled_mm`` per expert (sm90, counts on the host) and the float32
reference that CPU ranks run.

The schedule has no host sync: device row offsets, a grid sized for the worst case (or, ``persistent``,
one program per SM walking the tiles), each tile's expert found by a prefix sum
(``tiled_gemm.expert_tile``, shared with the dense experts' tiled GEMM). Each K step of 128 values
multiplies e4m3 tiles on the tensor cores (exact float32 products) and adds the partial sum scaled by
the row's activation scale and the column block's weight scale, as DeepGEMM and vLLM's ``fused_moe``
do. ``tma`` loads the operand tiles with the tensor memory accelerator (host-side descriptors);
``warp_specialize`` lets Triton split the K loop into a loading warp group and computing ones, so one
group's scaling runs while another's MMA does.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..quant.fp8 import FP8_BLOCK, FP8_DTYPE, FP8_GROUP
from ..quant.kernels import quantize_values
from ..streams import sm_count
from .tiled_gemm import GemmConfig, expert_tile, max_tiles, tile_count, tma_ready

GROUP_V = tl.constexpr(FP8_GROUP)


# Measured on H200 (``bench_fp8_experts.py --sweep``, DeepSeek-V3 dims): 64 x 128 tiles win up to
# 256 rows per expert (weight-read bound, then one weight scale per step keeps the scaling cheap);
# from there 128 x 128 tiles with two warp groups.
DECODE_CONFIG = GemmConfig(block_m=64, block_n=128, group_m=4, num_warps=4, num_stages=4)
LARGE_CONFIG = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)
GEMM_CONFIGS = (DECODE_CONFIG, LARGE_CONFIG)


def gemm_config(rows_per_expert: float) -> GemmConfig:
    """The tiles for ``rows_per_expert`` rows per expert on average (the grid depends on rows only,
    so a CUDA graph captured at one size keeps its config whatever the routing)."""
    return DECODE_CONFIG if rows_per_expert <= 256 else LARGE_CONFIG


def fuse_swiglu(rows_per_expert: float) -> bool:
    """Whether the MLP runs ``grouped_gemm_swiglu`` (SwiGLU in gate_up's epilogue) rather than
    ``grouped_gemm`` and ``silu_mul_quantize`` for ``rows_per_expert`` rows per expert on average."""
    return gemm_config(rows_per_expert).block_n == FP8_GROUP


@triton.jit
def _scaled_k_loop(
    a_ptr,
    a_scales,
    b_ptr,
    b_scales,
    offs_m,
    m_mask,
    expert,
    n0,
    N: tl.constexpr,
    N_B: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    SWIGLU: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Sum over K steps of (a_k @ b_k^T) * scale_a_k * scale_b_k for rows ``offs_m`` (scales at
    ``a_scales``, per row) and the expert's weight rows ``n0`` on (block scales at ``b_scales``); with
    ``SWIGLU`` also for the rows N further (up beside gate) -> two float32 ``[BLOCK_M, BLOCK_N]``
    accumulators (the second is the first without ``SWIGLU``)."""
    BLOCK_K: tl.constexpr = GROUP_V  # one activation scale and one weight scale per K step
    KQ: tl.constexpr = K // BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    local_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = local_n < N
    b_row = expert * N_B + n0
    if A_TMA:  # a descriptor's tile past the tensor's end reads zeros; other rows reach no output
        first_row = tl.min(offs_m, axis=0)
    else:
        a_tile = a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    if not B_TMA:
        b_tile = b_ptr + (expert * N_B + local_n).to(tl.int64)[None, :] * K + offs_k[:, None]
    # A tile at most one weight block wide has one weight scale per K step: a scalar, so each step
    # costs one multiply-add per accumulator element instead of an outer product of scales.
    ONE_B_SCALE: tl.constexpr = BLOCK_N <= BLOCK_K
    if ONE_B_SCALE:
        gate_scales = b_scales + (n0 // BLOCK_K) * KQ
    else:
        gate_scales = b_scales + (local_n // BLOCK_K) * KQ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:
        up_scales = b_scales + ((N + n0) // BLOCK_K) * KQ
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kq in tl.range(0, KQ, warp_specialize=WARP_SPECIALIZE):
        k0 = kq * BLOCK_K
        if A_TMA:
            a = a_ptr.load([first_row, k0])
        else:
            a = tl.load(a_tile + k0, mask=m_mask[:, None], other=0.0)
        if B_TMA:
            b = b_ptr.load([b_row, k0]).T
        else:
            b = tl.load(b_tile + k0, mask=n_mask[None, :], other=0.0)
        scale_a = tl.load(a_scales + kq, mask=m_mask, other=0.0)
        if ONE_B_SCALE:
            acc += tl.dot(a, b) * (scale_a * tl.load(gate_scales + kq))[:, None]
        else:
            acc += tl.dot(a, b) * scale_a[:, None] * tl.load(gate_scales + kq, mask=n_mask, other=0.0)[None, :]
        if SWIGLU:  # SwiGLU's tiles are one scale block wide: ONE_B_SCALE
            if B_TMA:
                up = b_ptr.load([b_row + N, k0]).T
            else:
                up = tl.load(b_tile + N * K + k0)
            acc_up += tl.dot(a, up) * (scale_a * tl.load(up_scales + kq))[:, None]
    if not SWIGLU:
        acc_up = acc
    return acc, acc_up


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [R, K] e4m3; a descriptor (tiles [BLOCK_M, 128]) when A_TMA
    a_scale_ptr,  # [R, K/128] float32
    b_ptr,  # [L, N_B, K] e4m3 (N_B = N, or 2N: gate then up, when SWIGLU); a descriptor over [L * N_B, K] when B_TMA
    b_scale_ptr,  # [L, N_B/128, K/128] float32
    c_ptr,  # [R, N]: the product in the output dtype, or SwiGLU's e4m3 values when SWIGLU
    c_scale_ptr,  # [R, N/128] float32 scales of c (SWIGLU only)
    offsets_ptr,  # [L] int32 cumulative row ends
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    SWIGLU: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    N_B: tl.constexpr = 2 * N if SWIGLU else N
    NQ_B: tl.constexpr = (N_B + GROUP_V - 1) // GROUP_V
    KQ: tl.constexpr = K // GROUP_V
    NUM_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    # One tile per program (grid = every possible tile), or a persistent grid walking them.
    for tile in range(tl.program_id(0), tile_count(offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N), tl.num_programs(0)):
        _, expert, offs_m, m_mask, pid_n = expert_tile(tile, offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N, GROUP_M)
        rows64 = offs_m.to(tl.int64)
        acc, acc_up = _scaled_k_loop(
            a_ptr,
            a_scale_ptr + rows64 * KQ,
            b_ptr,
            b_scale_ptr + expert.to(tl.int64) * NQ_B * KQ,
            offs_m,
            m_mask,
            expert,
            pid_n * BLOCK_N,
            N,
            N_B,
            K,
            BLOCK_M,
            BLOCK_N,
            A_TMA,
            B_TMA,
            SWIGLU,
            WARP_SPECIALIZE,
        )
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_tile = c_ptr + rows64[:, None] * N + offs_n[None, :]
        if SWIGLU:
            # The tile is one 128-value group of each row: quantised here, as silu_mul_quantize would.
            q, scale = quantize_values(acc * tl.sigmoid(acc) * acc_up)
            tl.store(c_tile, q, mask=m_mask[:, None])
            tl.store(c_scale_ptr + rows64 * (N // GROUP_V) + pid_n, scale, mask=m_mask)
        else:
            tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < N)[None, :])


def _check(q_RK: torch.Tensor, w_LNK: torch.Tensor, config: GemmConfig | None) -> None:
    if q_RK.shape[1] % FP8_BLOCK or q_RK.shape[1] != w_LNK.shape[2]:
        raise ValueError(
            f"FP8 experts need one reduction size, a multiple of {FP8_BLOCK}, in rows and weights: got "
            f"{tuple(q_RK.shape)} and {tuple(w_LNK.shape)}"
        )
    if w_LNK.shape[1] % FP8_BLOCK and w_LNK.shape[1] > FP8_BLOCK:
        raise ValueError(f"FP8 experts need output sizes that are multiples of {FP8_BLOCK}, got {w_LNK.shape[1]}")
    if config is not None and config.block_k != FP8_BLOCK:
        raise ValueError(f"FP8 experts step K by their scale block, {FP8_BLOCK}: got block_k={config.block_k}")


def _launch(q_RK, scales_RQ, w_LNK, w_scale_inv_LNQ, offsets_L, out_RN, out_scales_RQ, n: int, config: GemmConfig):
    num_rows, k = q_RK.shape
    num_experts, n_b, _ = w_LNK.shape
    a_tma = config.tma and tma_ready(q_RK)
    b_tma = config.tma and tma_ready(w_LNK)
    grid = max_tiles(num_rows, num_experts, n, config)
    if config.persistent:  # one program per SM (3 in the interpreter: enough to walk several tiles each)
        grid = min(grid, sm_count(q_RK.device) or 3)
    _grouped_gemm_kernel[(grid,)](
        TensorDescriptor.from_tensor(q_RK, [config.block_m, FP8_BLOCK]) if a_tma else q_RK,
        scales_RQ,
        TensorDescriptor.from_tensor(w_LNK.view(num_experts * n_b, k), [config.block_n, FP8_BLOCK]) if b_tma else w_LNK,
        w_scale_inv_LNQ,
        out_RN,
        out_scales_RQ,
        offsets_L,
        N=n,
        K=k,
        NUM_EXPERTS=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        GROUP_M=config.group_m,
        A_TMA=a_tma,
        B_TMA=b_tma,
        SWIGLU=out_scales_RQ is not None,
        WARP_SPECIALIZE=config.warp_specialize and b_tma,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


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
    _check(q_RK, w_LNK, config)
    num_rows, n = q_RK.shape[0], w_LNK.shape[1]
    out_RN = torch.empty(num_rows, n, dtype=out_dtype, device=q_RK.device)
    if num_rows:
        config = config or gemm_config(num_rows / w_LNK.shape[0])
        _launch(q_RK, scales_RQ, w_LNK, w_scale_inv_LNQ, offsets_L, out_RN, None, n, config)
    return out_RN


def grouped_gemm_swiglu(
    q_RK: torch.Tensor,
    scales_RQ: torch.Tensor,
    w_L2IK: torch.Tensor,
    w_scale_inv_L2IQ: torch.Tensor,
    offsets_L: torch.Tensor,
    config: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_gemm`` with the gate_up weight (``[L, 2I, K]``, gate rows first) and SwiGLU in the
    epilogue: silu(gate) * up of each row, quantised in 128-value groups as ``quant.kernels``'s
    ``silu_mul_quantize`` -> (e4m3 ``[R, I]``, float32 scales ``[R, I/128]``), from the float32
    accumulators (the unfused path rounds gate and up to the activation dtype first).
    ``config.block_n`` must be 128 (a tile is one scale group); I a multiple of 128."""
    _check(q_RK, w_L2IK, config)
    config = config or gemm_config(q_RK.shape[0] / w_L2IK.shape[0])
    inter = w_L2IK.shape[1] // 2
    if config.block_n != FP8_GROUP or inter % FP8_GROUP:
        raise ValueError(
            f"the fused SwiGLU quantises one {FP8_GROUP}-value group per tile: it needs block_n={FP8_GROUP} "
            f"and an intermediate size that is a multiple of it, got block_n={config.block_n}, I={inter}"
        )
    num_rows = q_RK.shape[0]
    q_RI = torch.empty(num_rows, inter, dtype=FP8_DTYPE, device=q_RK.device)
    scales_RI = torch.empty(num_rows, inter // FP8_GROUP, dtype=torch.float32, device=q_RK.device)
    if num_rows:
        _launch(q_RK, scales_RQ, w_L2IK, w_scale_inv_L2IQ, offsets_L, q_RI, scales_RI, inter, config)
    return q_RI, scales_RI


def with_tma(config: GemmConfig, warp_specialize: bool = False) -> GemmConfig:
    """``config`` loading its tiles by descriptor (and, optionally, warp-specialised)."""
    return dataclasses.replace(config, tma=True, warp_specialize=warp_specialize)

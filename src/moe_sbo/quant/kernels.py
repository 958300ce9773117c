"""Triton kernels that quantise activations to FP8 (``fp8.py``'s format: e4m3, one scale per token and
128 values): the rows entering the routed experts, SwiGLU's output between their two GEMMs, and a
slice of a row (``quantize_slice``) that ``low_latency``'s fp8 dispatch stores straight into a peer's
buffer.

Legend: see ``moe_sbo/__init__.py``.

Each program quantises 1024 values (8 groups of 128) of one row; rows past the last expert offset
(padding) are neither read nor written, so a launch depends only on R and a CUDA graph captured at one
R replays for any routing. The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors; the tests
hold them to ``fp8.py``'s torch reference there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE, FP8_GROUP, FP8_MAX, empty_k_major_scales

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
def _store_quantized(q_row, s_row, s_stride_q, h0, q_QV, scale_Q, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_q = tl.arange(0, BLOCK_H // GROUP_V)
    q_mask = h0 + offs_q * GROUP_V < HIDDEN
    h_QV = h0 + offs_q[:, None] * GROUP_V + tl.arange(0, GROUP_V)[None, :]
    tl.store(q_row + h_QV, q_QV, mask=q_mask[:, None])
    tl.store(s_row + (h0 // GROUP_V + offs_q) * s_stride_q, scale_Q, mask=q_mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [X, HIDDEN], row stride stride_x
    rows_ptr,  # [R] int64 source rows when GATHER
    q_ptr,
    s_ptr,
    last_ptr,
    stride_x,
    s_stride_r,
    s_stride_q,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GATHER: tl.constexpr,
):
    r = tl.program_id(0)
    if r < tl.load(last_ptr):  # rows past the last expert's end are padding
        h0 = tl.program_id(1) * BLOCK_H
        r64 = r.to(tl.int64)
        if GATHER:
            src = tl.load(rows_ptr + r64).to(tl.int64)
        else:
            src = r64
        q_QV, scale_Q = quantize_slice(x_ptr + src * stride_x, h0, HIDDEN, BLOCK_H)
        _store_quantized(q_ptr + r64 * HIDDEN, s_ptr + r64 * s_stride_r, s_stride_q, h0, q_QV, scale_Q, HIDDEN, BLOCK_H)


@triton.jit
def _silu_mul_quantize_kernel(
    h_ptr, q_ptr, s_ptr, last_ptr, s_stride_r, s_stride_q, INTER: tl.constexpr, BLOCK_H: tl.constexpr
):
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
        _store_quantized(q_ptr + r64 * INTER, s_ptr + r64 * s_stride_r, s_stride_q, h0, q_QV, scale_Q, INTER, BLOCK_H)


def _empty_quantized(
    num_rows: int, width: int, device: torch.device, k_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``[X, width]`` values and their float32 ``[X, width/128]`` scales, uninitialised; ``k_major``:
    the scales laid out K-major (``fp8.empty_k_major_scales``)."""
    q = torch.empty(num_rows, width, dtype=FP8_DTYPE, device=device)
    if k_major:
        return q, empty_k_major_scales(num_rows, width // FP8_GROUP, device)
    return q, torch.empty(num_rows, width // FP8_GROUP, dtype=torch.float32, device=device)


def quantize_rows(
    x_XH: torch.Tensor, offsets_L: torch.Tensor, rows_R: torch.Tensor | None = None, k_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_XH`` -> (e4m3 ``[R, H]``, float32 scales ``[R, H/128]``); rows at or past ``offsets_L[-1]``
    are left unwritten (they belong to no expert). Without ``rows_R`` the rows are ``x_XH`` itself
    (R = X); with it (an integer ``[R]`` index, as ``DispatchOutput.expert_rows_R``) row r is
    ``x_XH[rows_R[r]]``: the gather fused into the quantisation, so the rows are read once where they
    lie instead of copied first. ``x_XH``'s rows may be strided (a view into a wider buffer).
    ``k_major``: the scales laid out K-major (``fp8.empty_k_major_scales``: ``[R, H/128]`` with strides
    ``(1, R rounded up to 4)``), as the sm90 FP8 GEMM loads them, without a copy."""
    if x_XH.dim() != 2 or x_XH.stride(1) != 1:
        raise ValueError(
            f"quantize_rows needs [X, H] rows contiguous along H, got shape {tuple(x_XH.shape)} and strides "
            f"{x_XH.stride()}"
        )
    hidden = x_XH.shape[1]
    if rows_R is not None and (rows_R.dtype.is_floating_point or rows_R.dim() != 1):
        raise ValueError(f"quantize_rows needs rows_R an integer [R] index, got {rows_R.dtype} {tuple(rows_R.shape)}")
    num_rows = x_XH.shape[0] if rows_R is None else rows_R.shape[0]
    q_RH, scales_RQ = _empty_quantized(num_rows, hidden, x_XH.device, k_major)
    if num_rows:
        block_h = block_h_for_quantize(hidden)
        _quantize_rows_kernel[(num_rows, triton.cdiv(hidden, block_h))](
            x_XH,
            x_XH if rows_R is None else rows_R.contiguous(),
            q_RH,
            scales_RQ,
            offsets_L[-1:],
            x_XH.stride(0),
            *scales_RQ.stride(),
            HIDDEN=hidden,
            BLOCK_H=block_h,
            GATHER=rows_R is not None,
        )
    return q_RH, scales_RQ


def silu_mul_quantize(
    gate_up_R2I: torch.Tensor, offsets_L: torch.Tensor, k_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of ``gate_up_R2I`` (gate columns first) quantised: (e4m3 ``[R, I]``, scales ``[R, I/128]``;
    ``k_major`` as ``quantize_rows``')."""
    num_rows, inter = gate_up_R2I.shape[0], gate_up_R2I.shape[1] // 2
    q_RI, scales_RQ = _empty_quantized(num_rows, inter, gate_up_R2I.device, k_major)
    if num_rows:
        block_h = block_h_for_quantize(inter)
        _silu_mul_quantize_kernel[(num_rows, triton.cdiv(inter, block_h))](
            gate_up_R2I, q_RI, scales_RQ, offsets_L[-1:], *scales_RQ.stride(), INTER=inter, BLOCK_H=block_h
        )
    return q_RI, scales_RQ

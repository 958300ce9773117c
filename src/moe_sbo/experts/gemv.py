"""A Triton grouped GEMM for few rows per expert (decode): each expert's weights are read once, at
the memory's speed, and an expert with no rows is not read at all.

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

At decode a rank's routed experts see a handful of rows each (8 tokens x top-8 over 32 experts: about
two), so their GEMMs are weight reads, and ``torch._grouped_mm``, built for row tiles of 64-128, takes
longer than the weight read there (docs/BENCHMARKS.md, "Dense routed experts"). Here one program owns an
expert and ``BLOCK_N`` output columns: it reads the expert's row range from the device offsets (no
host sync, so a CUDA graph captured at one R replays for any routing), returns at once for an empty
expert, and otherwise streams its [BLOCK_N, K] weight slice once through ``tl.dot`` with all of the
expert's rows (in blocks of ``BLOCK_M``; past the first block the slice is read again, so this kernel
is for small R: ``experts.conditions.GEMV_MAX_ROWS_PER_EXPERT``). float32 accumulation, the activation
dtype out, as ``torch._grouped_mm``.
Runs under ``TRITON_INTERPRET=1`` on CPU tensors (the tests hold it to a per-token reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tl.dot (its smallest M)
BLOCK_N = 64
BLOCK_K = 256


@triton.jit
def _grouped_gemv_kernel(
    x_ptr,  # [R, K] rows grouped by expert
    w_ptr,  # [L, N, K]
    out_ptr,  # [R, N]
    offsets_ptr,  # [L] int32 cumulative row ends
    N,
    K,
    stride_xr,
    stride_wl,
    stride_wn,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT_FP32: tl.constexpr,
):
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(offsets_ptr + expert)
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    if end <= start:  # no rows: the expert's weights are not read
        return
    col_ok = cols < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_wl + cols.to(tl.int64)[:, None] * stride_wn
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x_MK = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_NK = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if EXACT_FP32:  # float32 inputs multiply in full precision, not TF32
                acc += tl.dot(x_MK, tl.trans(w_NK), input_precision="ieee")
            else:
                acc += tl.dot(x_MK, tl.trans(w_NK))
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_or + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemv(x_RK: torch.Tensor, w_LNK: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """``x_RK`` rows grouped by expert (expert l owns rows ``offsets_L[l-1]:offsets_L[l]``, int32
    cumulative ends on the device) times ``w_LNK[l]`` transposed -> ``[R, N]`` in ``x_RK``'s dtype.
    Rows past the last offset (padding) are neither read nor written: their output is undefined
    (``torch.empty``), as with ``torch._grouped_mm``."""
    num_rows, k = x_RK.shape
    experts, n, k_w = w_LNK.shape
    if k_w != k or offsets_L.shape != (experts,):
        raise ValueError(
            f"grouped_gemv needs x [R, K], w [L, N, K] and offsets [L] alike, got {tuple(x_RK.shape)}, "
            f"{tuple(w_LNK.shape)} and {tuple(offsets_L.shape)}"
        )
    x_RK = x_RK.contiguous()
    w_LNK = w_LNK.contiguous()
    out_RN = torch.empty(num_rows, n, dtype=x_RK.dtype, device=x_RK.device)
    if num_rows == 0:
        return out_RN
    grid = (experts, triton.cdiv(n, BLOCK_N))
    _grouped_gemv_kernel[grid](
        x_RK,
        w_LNK,
        out_RN,
        offsets_L,
        n,
        k,
        x_RK.stride(0),
        w_LNK.stride(0),
        w_LNK.stride(1),
        out_RN.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        EXACT_FP32=x_RK.dtype == torch.float32,
        num_warps=4,
        num_stages=3,
    )
    return out_RN

"""A Triton tiled grouped GEMM for dense (bf16) routed experts: row tiles of 64 or 128 rows, each
weight tile read once per row tile.

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

It serves the batches between decode (``gemv.py``: a few rows per expert, one weight read) and
prefill (``torch._grouped_mm``: thousands of rows per expert, FLOP-bound), whose experts see tens to
hundreds of rows each; ``experts.select`` holds the rule (``TILED_MAX_ROWS_PER_EXPERT``). Its tiles
come from ``tiles.py``'s schedule (no host sync: a CUDA graph captured at one R replays for any
routing). From ``TMA_MIN_ROWS_PER_EXPERT`` rows per expert the weight tiles (and contiguous row tiles)
come through tensor descriptors (``GemmConfig.tma``); the descriptors are encoded on the host per
launch, so smaller batches keep per-thread loads.

``rows_R`` (optional) makes the GEMM read its A rows through an index: row r of the product is
``x[rows_R[r]]`` times its expert's weights, so rows grouped by expert need not be copied out of a
buffer in another order first (``low_latency``'s ``index_rows``: the received rows read in place).
Rows past the last offset (padding) are neither read nor written. The kernels also run under
``TRITON_INTERPRET=1`` on CPU float32 tensors (the interpreter's bf16 products are not exact); the
tests hold them to a per-row reference there.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .tiles import GemmConfig, expert_tile, max_tiles, tma_ready


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,  # [X, K] rows (read through rows_ptr when GATHER), row stride stride_x; a descriptor when X_TMA
    rows_ptr,  # [R] int64 source row of each output row (GATHER only)
    w_ptr,  # [L, N, K]; a descriptor over [L * N, K] when W_TMA
    out_ptr,  # [R, N]
    offsets_ptr,  # [L] int32 cumulative row ends
    stride_x,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    GATHER: tl.constexpr,
    X_TMA: tl.constexpr,
    W_TMA: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    NUM_N: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    live, expert, offs_m, m_mask, pid_n = expert_tile(
        tl.program_id(0), offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N, GROUP_M
    )
    if not live:
        return
    if GATHER:
        src_m = tl.load(rows_ptr + offs_m, mask=m_mask, other=0)
    else:
        src_m = offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if not X_TMA:
        x_tile = x_ptr + src_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    if not W_TMA:
        w_tile = w_ptr + expert.to(tl.int64) * N * K + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    # A descriptor's tile past the tensor's end reads zeros; rows or columns of the next expert that a
    # tile takes in (its last row or column tile) reach only outputs the store leaves out.
    first_row = tl.min(offs_m, axis=0)
    first_col = expert * N + pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if X_TMA:
            x = x_ptr.load([first_row, k0])
        elif K % BLOCK_K == 0:
            x = tl.load(x_tile + k0, mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(x_tile + k0, mask=m_mask[:, None] & (offs_k[None, :] + k0 < K), other=0.0)
        if W_TMA:
            w = w_ptr.load([first_col, k0]).T
        elif K % BLOCK_K == 0:
            w = tl.load(w_tile + k0, mask=n_mask[None, :], other=0.0)
        else:
            w = tl.load(w_tile + k0, mask=n_mask[None, :] & (offs_k[:, None] + k0 < K), other=0.0)
        if EXACT_FP32:  # float32 inputs multiply in full precision, not TF32
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out_tile = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Tile configs (``moe-sbo bench dense-experts --sweep`` chose them; docs/BENCHMARKS.md, "Dense routed
# experts"): 64 x 128 tiles with one warp group up to 64 rows per expert, 128 x 256 tiles with two warp
# groups above. Descriptor loads from TMA_MIN_ROWS_PER_EXPERT: below it they gain nothing on the GPU
# and their per-launch host cost would show in eager forwards. One program per tile.
SMALL_CONFIG = GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, block_k=64)
LARGE_CONFIG = GemmConfig(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=4, block_k=64)
TMA_MIN_ROWS_PER_EXPERT = 256


def dense_config(rows_per_expert: float, element_size: int = 2) -> GemmConfig:
    """The tiles for ``rows_per_expert`` rows per expert on average (known before the counts: a CUDA
    graph captured at one size keeps its config whatever the routing), with descriptor loads from
    ``TMA_MIN_ROWS_PER_EXPERT``. Elements of 4 bytes (float32, the exact path tests take) get two
    pipeline stages, so the tiles still fit shared memory."""
    config = SMALL_CONFIG if rows_per_expert <= 64 else LARGE_CONFIG
    if rows_per_expert >= TMA_MIN_ROWS_PER_EXPERT:
        config = dataclasses.replace(config, tma=True)
    return config if element_size <= 2 else dataclasses.replace(config, num_stages=2)


def grouped_gemm(
    x_XK: torch.Tensor,
    w_LNK: torch.Tensor,
    offsets_L: torch.Tensor,
    rows_R: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Rows grouped by expert (expert l owns output rows ``offsets_L[l-1]:offsets_L[l]``, int32
    cumulative ends on the device) times ``w_LNK[l]`` transposed -> ``[R, N]`` in ``x_XK``'s dtype.

    Without ``rows_R`` the rows are ``x_XK`` itself (R = X); with it (an integer ``[R]``) output row r
    reads row ``rows_R[r]`` of ``x_XK``, whose rows may be strided (a view into a wider buffer) but
    must be contiguous along K. Rows past the last offset are neither read nor written: their
    output is undefined (``torch.empty``), as with ``torch._grouped_mm``. The offsets are not read
    on the host: ``offsets_L[-1]`` must not exceed R (nor a ``rows_R`` entry X). ``config`` defaults
    to ``dense_config(R / L, x's element size)``.
    """
    num_rows = x_XK.shape[0] if rows_R is None else rows_R.shape[0]
    experts, n, k = w_LNK.shape
    if x_XK.shape[1] != k or offsets_L.shape != (experts,) or x_XK.stride(1) != 1:
        raise ValueError(
            f"grouped_gemm needs x [R, K] (K contiguous), w [L, N, K] and offsets [L] alike, got "
            f"{tuple(x_XK.shape)} (strides {x_XK.stride()}), {tuple(w_LNK.shape)} and {tuple(offsets_L.shape)}"
        )
    if w_LNK.dtype != x_XK.dtype:
        raise ValueError(f"grouped_gemm needs x and w of one dtype, got {x_XK.dtype} and {w_LNK.dtype}")
    if rows_R is not None and (rows_R.dtype.is_floating_point or rows_R.dim() != 1):
        raise ValueError(f"grouped_gemm needs rows_R an integer [R] index, got {rows_R.dtype} {tuple(rows_R.shape)}")
    # The kernel walks the offsets and the index as dense arrays.
    offsets_L = offsets_L.contiguous()
    rows_R = None if rows_R is None else rows_R.contiguous()
    w_LNK = w_LNK.contiguous()
    out_RN = torch.empty(num_rows, n, dtype=x_XK.dtype, device=x_XK.device)
    if num_rows == 0:
        return out_RN
    config = config or dense_config(num_rows / experts, x_XK.element_size())
    x_tma = config.tma and rows_R is None and tma_ready(x_XK)
    w_tma = config.tma and tma_ready(w_LNK)
    _grouped_gemm_kernel[(max_tiles(num_rows, experts, n, config),)](
        TensorDescriptor(x_XK, x_XK.shape, x_XK.stride(), [config.block_m, config.block_k]) if x_tma else x_XK,
        x_XK if rows_R is None else rows_R,
        TensorDescriptor.from_tensor(w_LNK.view(experts * n, k), [config.block_n, config.block_k]) if w_tma else w_LNK,
        out_RN,
        offsets_L,
        x_XK.stride(0),
        N=n,
        K=k,
        NUM_EXPERTS=experts,
        E_P2=triton.next_power_of_2(experts),
        GATHER=rows_R is not None,
        X_TMA=x_tma,
        W_TMA=w_tma,
        EXACT_FP32=x_XK.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out_RN

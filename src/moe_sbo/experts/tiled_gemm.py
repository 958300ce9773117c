"""A Triton tiled grouped GEMM for dense (bf16) routed experts, and the tile schedule it shares with
``fp8_gemm.py``'s FP8 grouped GEMM.

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

Between decode (``gemv.py``: a few rows per expert, one weight read) and prefill
(``torch._grouped_mm``: thousands of rows per expert, FLOP-bound) lie the batches whose experts see
tens to hundreds of rows each. There ``torch._grouped_mm`` ran 1.4-2.6x its floor (the weight read or
the FLOPs, whichever takes longer) on H200 at 16-128 rows per expert, and this kernel, whose row
tiles of 64 or 128 rows read each weight tile once per tile, 1.04-1.8x, 1.06-1.45x faster
(docs/BENCHMARKS.md, "Dense experts"); ``experts.RoutedExperts`` picks between the three by rows.

The hard part is the schedule without a host sync (``expert_tile``): the row counts per expert live
on the device (``offsets_L``: int32 cumulative ends, as ``torch._grouped_mm`` takes them). The grid is
sized for the worst case (ceil(R / BLOCK_M) + L row tiles, times the column tiles); each program
reads the L offsets, finds its expert and tile by a prefix sum over the experts' tile counts, and
programs past the last tile return at once. So a launch depends only on R, and a CUDA graph captured
at one R replays for any routing. Tiles inside an expert are swizzled in groups of ``GROUP_M`` row
tiles so neighbouring programs share weight tiles in L2. From 256 rows per expert the weight tiles
(and contiguous row tiles) come through tensor descriptors (``GemmConfig.tma``), which brings the
kernel level with ``torch._grouped_mm`` at prefill sizes; the descriptors are encoded on the host per
launch, so smaller batches, which gain nothing from them, keep per-thread loads.

``rows_R`` (optional) makes the GEMM read its A rows through an index: row r of the product is
``x[rows_R[r]]`` times its expert's weights, so rows grouped by expert need not be copied out of a
buffer in another order first (``low_latency``'s ``index_rows``: the received rows read in place).
Rows past the last offset (padding) are neither read nor written. The kernels also run under
``TRITON_INTERPRET=1`` on CPU float32 tensors (the interpreter's bf16 products are not exact); the
tests hold them to a per-row reference there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..streams import compute_capability


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and pipelining of one grouped GEMM launch (the FP8 kernel's BLOCK_K is always 128,
    its scale block). ``tma``: the dense kernel loads its weight tiles, and its row tiles when the
    rows are contiguous (no ``rows_R``), with the tensor memory accelerator (host-side tensor
    descriptors; Hopper and later, or Triton's interpreter) instead of per-thread loads."""

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    block_k: int = 128
    tma: bool = False


@triton.jit
def expert_tile_bounds(
    pid,
    offsets_ptr,
    NUM_EXPERTS: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_N,
    GROUP_M,
    ALIGN: tl.constexpr,
):
    """Program ``pid``'s tile -> (live, expert, first row, row end, pid_n): ``live`` is false past the
    last tile (every live tile comes before every dead one); the tile is rows [first row, row end) of
    ``expert`` (at most BLOCK_M, any size) times columns ``pid_n * BLOCK_N`` on. ``ALIGN``: each
    expert's tiles start at its first row rounded down to a multiple of ALIGN, so its first tile may
    begin with up to ALIGN - 1 rows of the expert before (the caller leaves them out: they are another
    expert's rows); every first row is then a multiple of ALIGN (BLOCK_M is)."""
    offs_e = tl.arange(0, E_P2)
    ends_E = tl.load(offsets_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
    real_starts_E = tl.load(offsets_ptr + offs_e - 1, mask=(offs_e > 0) & (offs_e < NUM_EXPERTS), other=0)
    starts_E = real_starts_E - real_starts_E % ALIGN
    m_tiles_E = tl.where(ends_E > real_starts_E, tl.cdiv(ends_E - starts_E, BLOCK_M), 0)
    tiles_E = m_tiles_E * NUM_N
    tiles_end_E = tl.cumsum(tiles_E, axis=0)
    live = pid < tl.sum(tiles_E)
    expert = tl.sum((tiles_end_E <= pid).to(tl.int32))
    mine_E = offs_e == expert
    t = pid - tl.sum(tl.where(mine_E, tiles_end_E - tiles_E, 0))
    row_start = tl.sum(tl.where(mine_E, starts_E, 0))
    row_end = tl.sum(tl.where(mine_E, ends_E, 0))
    m_tiles = tl.sum(tl.where(mine_E, m_tiles_E, 0))
    # GROUP_M row tiles sweep the columns together, so their weight tiles are read once into L2.
    width = GROUP_M * NUM_N
    first_m = (t // width) * GROUP_M
    group_size = tl.maximum(tl.minimum(m_tiles - first_m, GROUP_M), 1)  # >= 1: dead programs divide too
    pid_m = first_m + (t % width) % group_size
    pid_n = (t % width) // group_size
    first_row = row_start + pid_m * BLOCK_M
    return live, expert, first_row, tl.minimum(first_row + BLOCK_M, row_end), pid_n


@triton.jit
def expert_tile(pid, offsets_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, NUM_N, GROUP_M):
    """Program ``pid``'s tile -> (live, expert, rows_M, row_mask_M, pid_n): ``live`` is false past the
    last tile (the caller returns); the tile is rows ``rows_M`` (those under ``row_mask_M`` belong to
    ``expert``) times columns ``pid_n * BLOCK_N`` on."""
    live, expert, first_row, row_end, pid_n = expert_tile_bounds(
        pid, offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N, GROUP_M, 1
    )
    rows_M = first_row + tl.arange(0, BLOCK_M)
    return live, expert, rows_M, rows_M < row_end, pid_n


def max_tiles(num_rows: int, num_experts: int, n: int, config: GemmConfig) -> int:
    """The grid of a grouped GEMM over ``num_rows`` rows: every expert's last row tile may be partial."""
    return max_row_tiles(num_rows, num_experts, config.block_m) * triton.cdiv(n, config.block_n)


def max_row_tiles(num_rows: int, num_experts: int, block_m: int, align: int = 1) -> int:
    """The most row tiles ``expert_tile_bounds`` makes of ``num_rows`` rows in ``num_experts`` experts:
    one partial tile per expert, and with ``align`` up to ``align - 1`` rows more before each expert's."""
    return triton.cdiv(num_rows + (align - 1) * num_experts, block_m) + num_experts


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


# Tile configs chosen by ``moe-sbo bench dense-experts --sweep`` on H200 (docs/BENCHMARKS.md, "Dense routed
# experts"): 64 x 128 tiles with one warp group up to 64 rows per expert, 128 x 256 tiles with two warp
# groups from 128. Descriptor loads pay only from TMA_MIN_ROWS_PER_EXPERT: below it they gain nothing
# on the GPU and their per-launch host cost would show in eager forwards. One program per tile: a
# persistent grid measured no faster.
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


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a descriptor can address ``t`` (a tensor-memory-accelerator tile load): 16-byte aligned
    base and strides (the last dimension contiguous), on a Hopper-or-later GPU or in Triton's
    interpreter (CPU tensors)."""
    if t.device.type == "cuda" and compute_capability(t.device) < (9, 0):
        return False
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


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

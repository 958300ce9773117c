"""The tile schedule of the grouped GEMMs over expert-sorted rows, shared by the dense tiled GEMM
(``tiled_gemm.py``) and the FP8 kernels (``fp8_gemm.py``, and ``fp8_gemm_sm90.py``'s schedule kernel).

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

The hard part is the schedule without a host sync: the row counts per expert live on the device
(``offsets_L``: int32 cumulative ends, as ``torch._grouped_mm`` takes them). The grid is sized for
the worst case (``max_tiles``: ceil(R / BLOCK_M) + L row tiles, times the column tiles); each
program reads the L offsets, finds its expert and tile by a prefix sum over the experts' tile counts
(``expert_tile_bounds``), and programs past the last tile return at once. So a launch depends only on
R, and a CUDA graph captured at one R replays for any routing. Tiles inside an expert are swizzled
in groups of ``GROUP_M`` row tiles so neighbouring programs share weight tiles in L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a descriptor can address ``t`` (a tensor-memory-accelerator tile load): 16-byte aligned
    base and strides (the last dimension contiguous), on a Hopper-or-later GPU or in Triton's
    interpreter (CPU tensors)."""
    if t.device.type == "cuda" and compute_capability(t.device) < (9, 0):
        return False
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])

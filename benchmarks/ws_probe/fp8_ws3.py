"""Warp-specialised block-scaled FP8 grouped GEMM for Hopper (sm90) in Gluon -- a prototype.

Contract (the same as moe_sbo's Triton ``fp8_gemm.grouped_gemm``)::

    grouped_gemm(q_RK e4m3 [R, K], scales_RQ f32 [R, K/128], w_LNK e4m3 [L, N, K],
                 w_scale_inv_LNQ f32 [L, N/128, K/128], offsets_L int32 [L] (cumulative row ends,
                 on the device), out_dtype) -> [R, N]
    out[r, n] = sum_kq (sum_{k in kq} q[r, k] w[l(r), n, k]) * scales[r, kq] * w_scale_inv[l(r), n // 128, kq]

Rows past ``offsets_L[-1]`` are left unwritten. No host sync: the grid is sized for the worst case,
each program looks its tile up in a schedule written on the device (``tile_schedule``), so a CUDA
graph captured at one R replays for any routing.

Why warp specialisation (the DeepGEMM scheme). Block scaling forces the partial product of every
128-wide K step out of the tensor cores to be scaled ("promoted") into a float32 accumulator. In one
program whose warps march in lockstep the tensor cores idle during each promotion. Here a CTA has

* one producer warp (``_loader``) that only issues TMA loads into a ring of ``STAGES`` shared
  memory slots (A tile [128, 128] + B tile [BLOCK_N, 128] per slot), signalling ``ready[s]`` through
  the TMA transaction count and waiting on ``empty[s]`` before refilling a slot;
* two consumer warp groups (``_consumer``, 4 warps each), warp group h owning rows [64h, 64h+64) of
  the 128-row tile: per K step it waits ``ready[s]``, issues its wgmma (64 x BLOCK_N x 128) on
  its half of the A slot, waits for that product, releases the slot (``empty[s]``, which needs both
  warp groups' arrivals) and promotes the product.

Nothing but mbarriers ties the partitions together -- no CTA barrier (``bar.sync 0``) per K step --
so the two warp groups drift apart and while one promotes the other's wgmma keeps the tensor cores
busy. Registers are rebalanced (``setmaxnreg``): few for the loader warp group, many for the two
consumer warp groups, each holding one [64, BLOCK_N] float32 accumulator plus one product.

Partition layout in Gluon (>= 3.6 list API): the *default* partition is consumer warp group 0 (the
kernel's ``num_warps=4``); worker 0 is consumer warp group 1 (4 warps, may issue wgmma: Gluon sizes
a worker's layouts by its own warp count and the allocator puts 4-warp workers on warp-group
boundaries); worker 1 is the loader (1 warp). 9 warps are launched as 12 (3 warp groups).

Compiled for sm90 with Triton 3.6.0 and 3.9.0 (README.md): BLOCK_N=128 at 3-6 stages has no spills
(consumers use ~153 of their 232 registers); BLOCK_N=256 spills (a [64, 256] accumulator plus a
[64, 256] product is 256 registers per thread) and ``lookahead=True`` (issue step k+1's wgmma before
waiting for step k) spills and is serialised by ptxas (C7515): both kept only to be measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Gluon ships with Triton >= 3.5; some names moved between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # 3.6: tma.async_copy_global_to_shared; newer releases also name it tma.async_load.
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # warp_specialize's arguments: 3.6 takes [(default_fn, args), (worker_fn, args), ...], worker_num_warps,
    # worker_num_regs; 3.5 took (default_args, default_fn, worker_args, worker_fns, num_warps, num_regs).
    import inspect as _inspect

    _WS_PARAMS = list(
        _inspect.signature(
            gl.warp_specialize.__wrapped__ if hasattr(gl.warp_specialize, "__wrapped__") else gl.warp_specialize
        ).parameters
    )
    WS_LIST_API = tl.constexpr(_WS_PARAMS[0] == "functions_and_args")
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    gluon = None

FP8_BLOCK = 128  # the scale block along K (and N for the weights)
BLOCK_M = 128  # two consumer warp groups x 64 rows
TILE_FIELDS = tl.constexpr(4)  # expert (-1: no tile), first row, row end, column tile
GROUP_M = 8


# ----------------------------------------------------------------------------------------------------
# Tile schedule (copied from moe_sbo.experts.tiled_gemm / fp8_wgmma, so this file stands alone)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def expert_tile(pid, offsets_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, NUM_N, GROUP_M):
    """Program ``pid``'s tile -> (live, expert, rows_M, row_mask_M, pid_n): ``live`` is false past the
    last tile; the tile is rows ``rows_M`` (those under ``row_mask_M`` belong to ``expert``) times
    columns ``pid_n * BLOCK_N`` on. Tiles inside an expert are swizzled in groups of GROUP_M row
    tiles so neighbouring programs share weight tiles in L2."""
    offs_e = tl.arange(0, E_P2)
    ends_E = tl.load(offsets_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
    starts_E = tl.load(offsets_ptr + offs_e - 1, mask=(offs_e > 0) & (offs_e < NUM_EXPERTS), other=0)
    m_tiles_E = tl.cdiv(ends_E - starts_E, BLOCK_M)
    tiles_E = m_tiles_E * NUM_N
    tiles_end_E = tl.cumsum(tiles_E, axis=0)
    live = pid < tl.sum(tiles_E)
    expert = tl.sum((tiles_end_E <= pid).to(tl.int32))
    mine_E = offs_e == expert
    t = pid - tl.sum(tl.where(mine_E, tiles_end_E - tiles_E, 0))
    row_start = tl.sum(tl.where(mine_E, starts_E, 0))
    row_end = tl.sum(tl.where(mine_E, ends_E, 0))
    m_tiles = tl.sum(tl.where(mine_E, m_tiles_E, 0))
    width = GROUP_M * NUM_N
    first_m = (t // width) * GROUP_M
    group_size = tl.maximum(tl.minimum(m_tiles - first_m, GROUP_M), 1)  # >= 1: dead programs divide too
    pid_m = first_m + (t % width) % group_size
    pid_n = (t % width) // group_size
    rows_M = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return live, expert, rows_M, rows_M < row_end, pid_n


@triton.jit
def _schedule_kernel(
    offsets_ptr, tiles_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, NUM_N, GROUP_M
):
    """expert_tile's rule with the row range as bounds (BLOCK_M need not be a power of two)."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, E_P2)
    ends_E = tl.load(offsets_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
    starts_E = tl.load(offsets_ptr + offs_e - 1, mask=(offs_e > 0) & (offs_e < NUM_EXPERTS), other=0)
    m_tiles_E = tl.cdiv(ends_E - starts_E, BLOCK_M)
    tiles_E = m_tiles_E * NUM_N
    tiles_end_E = tl.cumsum(tiles_E, axis=0)
    live = pid < tl.sum(tiles_E)
    expert = tl.sum((tiles_end_E <= pid).to(tl.int32))
    mine_E = offs_e == expert
    t = pid - tl.sum(tl.where(mine_E, tiles_end_E - tiles_E, 0))
    row_start = tl.sum(tl.where(mine_E, starts_E, 0))
    row_end = tl.sum(tl.where(mine_E, ends_E, 0))
    m_tiles = tl.sum(tl.where(mine_E, m_tiles_E, 0))
    width = GROUP_M * NUM_N
    first_m = (t // width) * GROUP_M
    group_size = tl.maximum(tl.minimum(m_tiles - first_m, GROUP_M), 1)
    pid_m = first_m + (t % width) % group_size
    pid_n = (t % width) // group_size
    first = row_start + pid_m * BLOCK_M
    tile = tiles_ptr + pid * TILE_FIELDS
    tl.store(tile, tl.where(live, expert, -1))
    tl.store(tile + 1, first)
    tl.store(tile + 2, tl.minimum(first + BLOCK_M, row_end))
    tl.store(tile + 3, pid_n)


def max_tiles(num_rows: int, num_experts: int, n: int, block_n: int, block_m: int = BLOCK_M) -> int:
    """Worst-case grid: every expert's last row tile may be partial."""
    return (triton.cdiv(num_rows, block_m) + num_experts) * triton.cdiv(n, block_n)


def tile_schedule(offsets_L: torch.Tensor, num_rows: int, n: int, block_n: int, block_m: int = BLOCK_M) -> torch.Tensor:
    """int32 ``[tiles, 4]``: per program (expert or -1, first row, row end, column tile), from the
    device offsets (no host read)."""
    num_experts = offsets_L.shape[0]
    tiles = max_tiles(num_rows, num_experts, n, block_n, block_m)
    tiles_T4 = torch.empty(tiles, TILE_FIELDS, dtype=torch.int32, device=offsets_L.device)
    _schedule_kernel[(tiles,)](
        offsets_L,
        tiles_T4,
        NUM_EXPERTS=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        NUM_N=triton.cdiv(n, block_n),
        GROUP_M=GROUP_M,
    )
    return tiles_T4


# ----------------------------------------------------------------------------------------------------
# The warp-specialised Gluon kernel
# ----------------------------------------------------------------------------------------------------
if gluon is not None:

    @gluon.jit
    def _loader(
        a_desc,
        b_desc,
        a_smem,
        b_smem,
        ready,
        empty,
        tiles_ptr,
        N: gl.constexpr,
        KQ: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        NUM_TILES,
        PERSISTENT: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
    ):
        """Producer (1 warp): for each of this program's tiles, fill slot it % STAGES with step it's A
        and B tiles once both consumers have released it (``it`` counts steps over all the program's
        tiles, so in a persistent program the next tile's loads start while the consumers finish
        this one's)."""
        STAGE_BYTES: gl.constexpr = NUM_CONSUMERS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        pid = gl.program_id(0)
        step = gl.num_programs(0) if PERSISTENT else NUM_TILES
        for t in range(pid, NUM_TILES, step):
            tile = tiles_ptr + t * TILE_FIELDS
            expert = gl.load(tile)
            if expert >= 0:  # dead tiles are the last ones: every live tile before them counts
                row0 = gl.load(tile + 1)
                b_row = expert * N + gl.load(tile + 3) * BLOCK_N
                base = ((t - pid) // step) * KQ
                for k in range(KQ):
                    it = base + k
                    s = it % STAGES
                    # A fresh mbarrier counts as having completed the phase before phase 0 (parity 1),
                    # so the first round of waits passes at once: all slots start empty.
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), STAGE_BYTES)
                    for i in gl.static_range(NUM_CONSUMERS):  # one [64, 128] box per consumer warp group
                        tma_load(a_desc, [row0 + 64 * i, k * 128], ready.index(s), a_smem.index(s * NUM_CONSUMERS + i))
                    tma_load(b_desc, [b_row, k * 128], ready.index(s), b_smem.index(s))

    @gluon.jit
    def _consumer(
        a_smem,
        b_smem,
        ready,
        empty,
        a_scale_ptr,
        b_scale_ptr,
        c_ptr,
        tiles_ptr,
        N: gl.constexpr,
        KQ: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        HALF: gl.constexpr,
        NUM_TILES,
        PERSISTENT: gl.constexpr,
        SCALE: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
    ):
        """Consumer warp group HALF (4 warps): rows [64 HALF, 64 HALF + 64) of each tile. At BLOCK_N=256
        the tile's two 128-column halves are multiplied one after the other into two accumulators, so
        only one 64x128 product is in registers at a time (acc 2 x 64 + product 64 registers)."""
        HALF_M: gl.constexpr = 64
        NQ: gl.constexpr = N // 128
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
        zero = gl.zeros([HALF_M, 128], gl.float32, layout=MMA)
        pid = gl.program_id(0)
        step = gl.num_programs(0) if PERSISTENT else NUM_TILES
        for t in range(pid, NUM_TILES, step):
            tile = tiles_ptr + t * TILE_FIELDS
            expert = gl.load(tile)
            if expert >= 0:
                row0 = gl.load(tile + 1)
                row_end = gl.load(tile + 2)
                pid_n = gl.load(tile + 3)
                base = ((t - pid) // step) * KQ
                rows_M = row0 + HALF * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, MMA))
                row_mask_M = rows_M < row_end
                a_scales_M = a_scale_ptr + rows_M.to(gl.int64) * KQ
                # This column tile's weight scales: [L, N/128, K/128] row (expert, pid_n * BLOCK_N / 128).
                b_scales = b_scale_ptr + (expert.to(gl.int64) * NQ + pid_n * (BLOCK_N // 128)) * KQ
                acc_lo = gl.zeros([HALF_M, 128], gl.float32, layout=MMA)
                acc_hi = gl.zeros([HALF_M, 128], gl.float32, layout=MMA)
                # Scales are read one step ahead (from L2), so their latency hides behind the wait and
                # the MMA; rows past the expert read 0.
                a_scale_M = gl.load(a_scales_M, mask=row_mask_M, other=0.0)
                b_scale_lo = gl.load(b_scales)
                if BLOCK_N == 256:
                    b_scale_hi = gl.load(b_scales + KQ)
                for k in range(KQ):
                    it = base + k
                    s = it % STAGES
                    k_next = gl.minimum(k + 1, KQ - 1)  # the last prefetch re-reads step KQ-1 (harmless)
                    next_a_scale_M = gl.load(a_scales_M + k_next, mask=row_mask_M, other=0.0)
                    next_b_scale_lo = gl.load(b_scales + k_next)
                    if BLOCK_N == 256:
                        next_b_scale_hi = gl.load(b_scales + KQ + k_next)
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    a_half = a_smem.index(s * NUM_CONSUMERS + HALF)
                    b_tile = b_smem.index(s)
                    if BLOCK_N == 256:
                        b_lo = b_tile.slice(0, 128, dim=0)
                        b_hi = b_tile.slice(128, 128, dim=0)
                        product = warpgroup_mma(a_half, b_lo.permute((1, 0)), zero, use_acc=False, is_async=True)
                        product = warpgroup_mma_wait(0, deps=[product])
                        acc_lo += product * (a_scale_M * b_scale_lo)[:, None]
                        product = warpgroup_mma(a_half, b_hi.permute((1, 0)), zero, use_acc=False, is_async=True)
                        product, _, _ = warpgroup_mma_wait(0, deps=[product, a_half, b_tile])
                        mbarrier.arrive(empty.index(s), count=1)  # this warp group is done with slot s
                        acc_hi += product * (a_scale_M * b_scale_hi)[:, None]
                        b_scale_hi = next_b_scale_hi
                    elif SCALE:
                        product = warpgroup_mma(a_half, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
                        product, _, _ = warpgroup_mma_wait(0, deps=[product, a_half, b_tile])
                        mbarrier.arrive(empty.index(s), count=1)
                        acc_lo += product * (a_scale_M * b_scale_lo)[:, None]
                    else:  # diagnostic: no block scaling, the accumulator stays in the MMA (same waits)
                        acc_lo = warpgroup_mma(a_half, b_tile.permute((1, 0)), acc_lo, use_acc=True, is_async=True)
                        acc_lo, _, _ = warpgroup_mma_wait(0, deps=[acc_lo, a_half, b_tile])
                        mbarrier.arrive(empty.index(s), count=1)
                    a_scale_M = next_a_scale_M
                    b_scale_lo = next_b_scale_lo
                cols = pid_n * BLOCK_N + gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
                out = c_ptr + rows_M.to(gl.int64)[:, None] * N + cols[None, :]
                gl.store(out, acc_lo.to(c_ptr.dtype.element_ty), mask=row_mask_M[:, None])
                if BLOCK_N == 256:
                    gl.store(out + 128, acc_hi.to(c_ptr.dtype.element_ty), mask=row_mask_M[:, None])

    @gluon.jit
    def _ws_kernel(
        a_desc,  # [R, K] e4m3, tiles [128, 128]
        a_scale_ptr,  # [R, K/128] float32
        b_desc,  # [L * N, K] e4m3, tiles [BLOCK_N, 128]
        b_scale_ptr,  # [L, N/128, K/128] float32
        c_ptr,  # [R, N]
        tiles_ptr,  # [NUM_TILES, 4] int32 (tile_schedule)
        NUM_TILES,
        N: gl.constexpr,
        K: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        LOADER_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PERSISTENT: gl.constexpr,
        SCALE: gl.constexpr,
        NUM_CONSUMERS: gl.constexpr,
    ):
        KQ: gl.constexpr = K // 128
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES * NUM_CONSUMERS, 64, 128], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the loader's arrive.expect_tx
            mbarrier.init(empty.index(i), count=NUM_CONSUMERS)  # one arrive per consumer warp group
        # The argument tuples are written inline: a tuple assigned to a variable first turns its
        # constexpr members into tensors (seen in 3.6), and the partitions need them constexpr.
        if NUM_CONSUMERS == 3:
            gl.warp_specialize(
                [
                    (
                        _consumer,
                        (
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            a_scale_ptr,
                            b_scale_ptr,
                            c_ptr,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            0,
                            NUM_TILES,
                            PERSISTENT,
                            SCALE,
                            NUM_CONSUMERS,
                        ),
                    ),
                    (
                        _consumer,
                        (
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            a_scale_ptr,
                            b_scale_ptr,
                            c_ptr,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            1,
                            NUM_TILES,
                            PERSISTENT,
                            SCALE,
                            NUM_CONSUMERS,
                        ),
                    ),
                    (
                        _consumer,
                        (
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            a_scale_ptr,
                            b_scale_ptr,
                            c_ptr,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            2,
                            NUM_TILES,
                            PERSISTENT,
                            SCALE,
                            NUM_CONSUMERS,
                        ),
                    ),
                    (
                        _loader,
                        (
                            a_desc,
                            b_desc,
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            NUM_TILES,
                            PERSISTENT,
                            NUM_CONSUMERS,
                        ),
                    ),
                ],
                [4, 4, 1],  # worker warps: consumer warp groups 1 and 2, the loader warp
                [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (
                        _consumer,
                        (
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            a_scale_ptr,
                            b_scale_ptr,
                            c_ptr,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            0,
                            NUM_TILES,
                            PERSISTENT,
                            SCALE,
                            NUM_CONSUMERS,
                        ),
                    ),
                    (
                        _consumer,
                        (
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            a_scale_ptr,
                            b_scale_ptr,
                            c_ptr,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            1,
                            NUM_TILES,
                            PERSISTENT,
                            SCALE,
                            NUM_CONSUMERS,
                        ),
                    ),
                    (
                        _loader,
                        (
                            a_desc,
                            b_desc,
                            a_smem,
                            b_smem,
                            ready,
                            empty,
                            tiles_ptr,
                            N,
                            KQ,
                            BLOCK_N,
                            STAGES,
                            NUM_TILES,
                            PERSISTENT,
                            NUM_CONSUMERS,
                        ),
                    ),
                ],
                [4, 1],  # worker warps: consumer warp group 1, the loader warp
                [CONSUMER_REGS, LOADER_REGS],  # setmaxnreg per worker; the default gets the rest
            )


# Defaults: 4 stages of (16 KiB A + 16 KiB B) = 128 KiB of shared memory at BLOCK_N=128.
DEFAULT_BLOCK_N = 128
DEFAULT_STAGES = 4
LOADER_REGS = 40  # a warp that only issues TMA loads (DeepGEMM gives its TMA warp group 40)
CONSUMER_REGS = 232  # DeepGEMM's math warp groups' budget


LAST_KERNEL = None  # the CompiledKernel of the last launch (n_regs, n_spills, metadata.shared), for checks


def kernel_constexprs(
    n,
    k,
    block_n,
    stages,
    loader_regs=LOADER_REGS,
    consumer_regs=CONSUMER_REGS,
    persistent=False,
    scale=True,
    consumers=2,
):
    return dict(
        N=n,
        K=k,
        BLOCK_N=block_n,
        STAGES=stages,
        LOADER_REGS=loader_regs,
        CONSUMER_REGS=consumer_regs,
        PERSISTENT=bool(persistent),
        SCALE=bool(scale),
        NUM_CONSUMERS=consumers,
    )


def operand_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def _tma_ready(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


def supported(q_RK: torch.Tensor, w_LNK: torch.Tensor, block_n: int = DEFAULT_BLOCK_N) -> bool:
    """Whether ``grouped_gemm`` runs for these operands: Gluon importable, an sm90 GPU, e4m3 operands,
    N a multiple of block_n, K a multiple of 128, descriptor-addressable operands."""
    return (
        gluon is not None
        and q_RK.device.type == "cuda"
        and _is_sm90(q_RK.device)
        and q_RK.dtype == torch.float8_e4m3fn
        and w_LNK.dtype == torch.float8_e4m3fn
        and w_LNK.shape[1] % block_n == 0
        and q_RK.shape[1] % FP8_BLOCK == 0
        and _tma_ready(q_RK)
        and _tma_ready(w_LNK)
    )


def grouped_gemm(
    q_RK: torch.Tensor,
    scales_RQ: torch.Tensor,
    w_LNK: torch.Tensor,
    w_scale_inv_LNQ: torch.Tensor,
    offsets_L: torch.Tensor,
    out_dtype: torch.dtype,
    block_n: int = DEFAULT_BLOCK_N,
    stages: int = DEFAULT_STAGES,
    loader_regs: int = LOADER_REGS,
    consumer_regs: int = CONSUMER_REGS,
    persistent: bool = False,
    scale: bool = True,
    consumers: int = 2,
) -> torch.Tensor:
    """See the module docstring. No host sync; rows past ``offsets_L[-1]`` are left unwritten."""
    if block_n not in (128, 256):
        raise ValueError(f"block_n must be 128 or 256, got {block_n}")
    if not supported(q_RK, w_LNK, block_n):
        raise ValueError(
            "fp8_ws needs Gluon, an sm90 GPU, e4m3 operands, N % block_n == 0, K % 128 == 0, 16-byte aligned operands"
        )
    num_rows, k = q_RK.shape
    num_experts, n, _ = w_LNK.shape
    out_RN = torch.empty(num_rows, n, dtype=out_dtype, device=q_RK.device)
    if num_rows == 0:
        return out_RN
    scales_RQ = scales_RQ.contiguous()
    w_scale_inv_LNQ = w_scale_inv_LNQ.contiguous()
    block_m = 64 * consumers
    tiles_T4 = tile_schedule(offsets_L.contiguous(), num_rows, n, block_n, block_m)
    layout = operand_layout()
    global LAST_KERNEL
    num_tiles = tiles_T4.shape[0]
    grid = (
        min(num_tiles, torch.cuda.get_device_properties(q_RK.device).multi_processor_count) if persistent else num_tiles
    )
    LAST_KERNEL = _ws_kernel[(grid,)](
        GluonDescriptor.from_tensor(q_RK, [64, FP8_BLOCK], layout),
        scales_RQ,
        GluonDescriptor.from_tensor(w_LNK.view(num_experts * n, k), [block_n, FP8_BLOCK], layout),
        w_scale_inv_LNQ,
        out_RN,
        tiles_T4,
        num_tiles,
        **kernel_constexprs(n, k, block_n, stages, loader_regs, consumer_regs, persistent, scale, consumers),
        num_warps=4,  # the default partition: consumer warp group 0
    )
    return out_RN

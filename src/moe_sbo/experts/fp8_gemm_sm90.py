"""The block-scaled FP8 grouped GEMM for Hopper (sm90) at prefill sizes, warp-specialised in Gluon
(Triton's lower-level language): ``fp8_gemm.grouped_gemm``'s contract (e4m3 rows grouped by expert,
1x128 activation scales, 128x128 weight block scales, counts on the device, no host sync, CUDA-graph
capturable). ``experts.select`` runs it at prefill sizes where ``device_supported`` says it runs;
the route falls back to ``fp8_gemm`` for operands ``supported`` refuses.

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

Why warp specialisation. Block scaling multiplies each 128-wide K step's partial product by its
scales before adding it, so the product must leave the tensor cores after every step ("promotion").
A kernel whose warps move in lockstep (the Triton kernel: one instruction stream, a CTA barrier per
pipeline step) leaves the tensor cores idle while it waits for the product and scales it. Here the
warps of a CTA split into partitions that share nothing but shared memory and mbarriers, as in
DeepGEMM::

    loader      1 warp        TMA loads of step k's operand tiles and its rows' activation scales
                              into slot k % STAGES of a ring; waits for the slot's ``empty``
                              barrier, arms its ``ready`` barrier
    consumer i  warp group i  rows [64 i, 64 i + 64) of the tile: waits ``ready``, one wgmma
                              (64 x 128 x 128), reads the step's scales while it runs (its rows'
                              from the slot, the weight block's from global memory), waits for
                              its product (two consumers: after issuing the next step's wgmma),
                              arrives on ``empty``, promotes (one multiply-add per accumulator
                              element); at the tile's end stores it in whole lines

The activation scales come by TMA with the operands, as DeepGEMM's do, so they need the K-major
layout (``quant.fp8.k_major_scales``: one step's scales of consecutive rows contiguous; the MLP's
quantisers write them so): read from global memory by the consumers instead, each step would wait
for them.

With three consumers (a 192 x 128 tile) the tensor cores always have another warp group's MMA queued
while one promotes; up to 1024 rows per expert two (128-row tiles, which pad less of each expert:
``config_for``), each of which issues its next step's MMA before promoting a product (``k_unroll``
steps per turn of its loop, two products in flight), so its own MMA fills the gap. Registers are
rebalanced between the partitions (``setmaxnreg``): 160 for each of three consumers (the accumulator
and one product, 64 each) and 24 for the loader; 232 for each of two (two products) and 40.
The program is persistent (one per SM, looping over tiles): the loader runs ahead into the next
tile while the consumers store this one. Its rates against the Triton kernel and cuBLAS are in
docs/FP8.md.

The schedule (``tile_schedule``, Triton) writes each tile's (expert, first row, row end, column
tile, the expert's first row) from the device offsets, live tiles first, first rows on multiples of
4; it runs under ``TRITON_INTERPRET=1`` on CPU (tested there). Gluon has no interpreter and the
kernel needs sm90's wgmma, TMA and ``setmaxnreg``, so the GEMM itself is tested on GPUs only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8_BLOCK, K_MAJOR_ROW_ALIGN, k_major_scales
from ..streams import compute_capability, sm_count
from .tiles import expert_tile_bounds, max_row_tiles, tma_ready

try:  # Gluon ships with Triton >= 3.5; some names moved between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared  # 3.9 / 3.6
    # Every operand tile: e4m3 rows of 128 bytes, 128-byte swizzled as wgmma reads them.
    OPERAND_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    # The activation scales of one K step: a row of float32, unswizzled.
    SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    gluon = None

TILE_FIELDS = 5  # expert (-1: no tile), first row, row end, column tile, the expert's first row
ROWS_PER_CONSUMER = 64  # one wgmma's M
BLOCK_N = 128  # one weight scale block: one weight scale per tile and K step
# The same numbers for the kernels (a kernel reads only constexpr globals).
FIELDS_C = tl.constexpr(TILE_FIELDS)
ROWS_C = tl.constexpr(ROWS_PER_CONSUMER)
BLOCK_N_C = tl.constexpr(BLOCK_N)
# Tiles start on rows that are multiples of this: a TMA box of the K-major scales must begin on a
# 16-byte boundary (unaligned starts stopped the kernel with an illegal instruction on H200).
ROW_ALIGN_C = tl.constexpr(K_MAJOR_ROW_ALIGN)


@dataclass(frozen=True)
class WarpSpecializedConfig:
    """``consumers`` warp groups of 64 rows each (tile: 64 x consumers rows x 128 columns), ``stages``
    shared-memory slots of operand tiles, ``persistent``: one program per SM looping over tiles;
    ``consumer_regs`` / ``loader_regs``: registers per thread of each partition (multiples of 8 that
    fit the SM's 64K with the launch's warps); ``k_unroll``: K steps per turn of a consumer's loop,
    each step's MMA issued before the previous step's product is promoted (above 1 a consumer holds
    two products: two consumers only, whose 232 registers fit them)."""

    consumers: int = 3
    stages: int = 4
    persistent: bool = True
    consumer_regs: int = 160
    loader_regs: int = 24
    group_m: int = 8
    k_unroll: int = 1

    @property
    def block_m(self) -> int:
        return ROWS_PER_CONSUMER * self.consumers


DEFAULT_CONFIG = WarpSpecializedConfig()
# Two consumer warp groups (128-row tiles, which pad less of each expert than 192-row ones) up to this
# many rows per expert, four K steps per turn (each step's MMA issued before the previous product is
# promoted) and five stages; three consumers above (``moe-sbo bench fp8-experts`` chose the bound).
TWO_CONSUMERS_MAX_ROWS_PER_EXPERT = 1024
TWO_CONSUMERS_CONFIG = dataclasses.replace(
    DEFAULT_CONFIG, consumers=2, stages=5, consumer_regs=232, loader_regs=40, k_unroll=4
)


def config_for(rows_per_expert: float) -> WarpSpecializedConfig:
    """The kernel's config for ``rows_per_expert`` rows per expert on average (rows only, so a CUDA
    graph captured at one size keeps it whatever the routing)."""
    return TWO_CONSUMERS_CONFIG if rows_per_expert <= TWO_CONSUMERS_MAX_ROWS_PER_EXPERT else DEFAULT_CONFIG


@triton.jit
def _schedule_kernel(
    offsets_ptr, tiles_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, NUM_N, GROUP_M
):
    pid = tl.program_id(0)
    live, expert, first_row, row_end, pid_n = expert_tile_bounds(
        pid, offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N, GROUP_M, ROW_ALIGN_C
    )
    tile = tiles_ptr + pid * FIELDS_C
    tl.store(tile, tl.where(live, expert, -1))
    tl.store(tile + 1, first_row)
    tl.store(tile + 2, row_end)
    tl.store(tile + 3, pid_n)
    tl.store(tile + 4, tl.load(offsets_ptr + expert - 1, mask=live & (expert > 0), other=0))


def tile_schedule(offsets_L: torch.Tensor, num_rows: int, n: int, block_m: int, group_m: int = 8) -> torch.Tensor:
    """int32 ``[tiles, 5]``: per tile of a grouped GEMM over ``num_rows`` rows, (expert or -1, first row,
    row end, column tile, the expert's first row), from the device offsets (no host read); live tiles
    first. First rows are multiples of ``K_MAJOR_ROW_ALIGN``, so an expert's first tile may begin
    with rows of the expert before it, which its store leaves out. ``tiles`` is the worst case for
    ``num_rows`` (every expert's last row tile partial, every first one starting early)."""
    num_experts = offsets_L.shape[0]
    tiles = max_row_tiles(num_rows, num_experts, block_m, K_MAJOR_ROW_ALIGN) * triton.cdiv(n, BLOCK_N)
    tiles_T5 = torch.empty(tiles, TILE_FIELDS, dtype=torch.int32, device=offsets_L.device)
    _schedule_kernel[(tiles,)](
        offsets_L,
        tiles_T5,
        NUM_EXPERTS=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m,
        NUM_N=triton.cdiv(n, BLOCK_N),
        GROUP_M=group_m,
    )
    return tiles_T5


if gluon is not None:

    @gluon.jit
    def _loader(
        a_desc,
        b_desc,
        s_desc,
        a_smem,
        b_smem,
        s_smem,
        ready,
        empty,
        tiles_ptr,
        num_tiles,
        N: gl.constexpr,
        KQ: gl.constexpr,
        STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr,
        PERSISTENT: gl.constexpr,
    ):
        """One warp: for each of this program's tiles and each K step ``it`` (counted over all of them),
        wait until slot it % STAGES is empty, then load the step's row tiles (one [64, 128] box per
        consumer), weight tile and the rows' activation scales for the step into it; ``ready``
        completes when their bytes have landed."""
        STAGE_BYTES: gl.constexpr = CONSUMERS * (a_desc.block_type.nbytes + s_desc.block_type.nbytes) + (
            b_desc.block_type.nbytes
        )
        pid = gl.program_id(0)
        step = gl.num_programs(0) if PERSISTENT else num_tiles
        for t in range(pid, num_tiles, step):
            tile = tiles_ptr + t * FIELDS_C
            expert = gl.load(tile)
            if expert >= 0:  # live tiles come first, so this program's live tiles are its first ones
                row0 = gl.load(tile + 1)
                b_row = expert * N + gl.load(tile + 3) * BLOCK_N_C
                base = ((t - pid) // step) * KQ
                for k in range(KQ):
                    it = base + k
                    s = it % STAGES
                    # A fresh mbarrier counts as having completed the phase before phase 0, so the
                    # first round of waits (parity 1) passes at once: every slot starts empty.
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), STAGE_BYTES)
                    for i in gl.static_range(CONSUMERS):
                        tma_load(a_desc, [row0 + 64 * i, k * 128], ready.index(s), a_smem.index(s * CONSUMERS + i))
                        tma_load(s_desc, [k, row0 + 64 * i], ready.index(s), s_smem.index(s * CONSUMERS + i))
                    tma_load(b_desc, [b_row, k * 128], ready.index(s), b_smem.index(s))

    @gluon.jit
    def _issue_step(
        it,
        a_smem,
        b_smem,
        scales_slots,
        ready,
        b_scale,
        zero,
        STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr,
        INDEX: gl.constexpr,
    ):
        """Step ``it`` (counted over the program's tiles) of a consumer: wait for its slot, issue its
        wgmma, and read its scales while the MMA runs (the rows' from the slot, landed with the
        operands; the weight block's ``b_scale`` from global memory, L1 after the first) -> (the
        product in flight, its operand tiles, its scales [64], its slot)."""
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a_tile = a_smem.index(s * CONSUMERS + INDEX)
        b_tile = b_smem.index(s)
        product = warpgroup_mma(a_tile, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        scales = scales_slots.index(s * CONSUMERS + INDEX).load(gl.SliceLayout(1, zero.type.layout))
        return product, a_tile, b_tile, scales * gl.load(b_scale), s

    @gluon.jit
    def _k_steps(
        acc,
        k,
        base,
        a_smem,
        b_smem,
        scales_slots,
        ready,
        empty,
        b_scales,
        zero,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr,
        INDEX: gl.constexpr,
    ):
        """K steps ``k .. k + STEPS - 1`` of a consumer's tile (``base``: the tile's first step counted
        over the program's tiles) added into ``acc``. Each step is issued (``_issue_step``), then the
        next step's wgmma before this one's product is waited for, the slot released and the product
        promoted: the tensor cores work on this warp group's next MMA meanwhile. The last step of the
        call has no next: the steps are unrolled, so no MMA is in flight across a turn of a loop
        (ptxas would serialise every wgmma)."""
        it = base + k
        product, a_tile, b_tile, scale_M, s = _issue_step(
            it, a_smem, b_smem, scales_slots, ready, b_scales + k, zero, STAGES, CONSUMERS, INDEX
        )
        for u in gl.static_range(STEPS):
            if u + 1 < STEPS:
                step_next = it + u + 1
                b_scale_next = b_scales + k + u + 1
                product_next, a_next, b_next, scale_M_next, s_next = _issue_step(
                    step_next, a_smem, b_smem, scales_slots, ready, b_scale_next, zero, STAGES, CONSUMERS, INDEX
                )
                landed, _, _ = warpgroup_mma_wait(1, deps=[product, a_tile, b_tile])  # this step's, not the next
            else:
                landed, _, _ = warpgroup_mma_wait(0, deps=[product, a_tile, b_tile])
            mbarrier.arrive(empty.index(s), count=1)  # one arrive per warp group
            acc += landed * scale_M[:, None]
            if u + 1 < STEPS:
                # A wait that returns at once (the next product may stay in flight) but takes the
                # accumulator: the promotion stays before the MMA after next, which reuses the product's
                # registers, instead of sinking to the end and holding a third product's.
                acc = warpgroup_mma_wait(1, deps=[acc])
                product, a_tile, b_tile, scale_M, s = product_next, a_next, b_next, scale_M_next, s_next
        return acc

    @gluon.jit
    def _consumer(
        a_smem,
        b_smem,
        s_smem,
        ready,
        empty,
        b_scale_ptr,
        c_ptr,
        tiles_ptr,
        num_tiles,
        N: gl.constexpr,
        KQ: gl.constexpr,
        STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr,
        INDEX: gl.constexpr,
        PERSISTENT: gl.constexpr,
        K_UNROLL: gl.constexpr,
    ):
        """Warp group INDEX: rows [64 INDEX, 64 INDEX + 64) of each of this program's tiles. Per K step
        (``_k_steps``, K_UNROLL steps per turn): wait for the slot, one wgmma, wait for its product
        (which also ends this warp group's reads of the slot), release the slot, promote. The other
        consumers' MMAs keep the tensor cores busy meanwhile, and with K_UNROLL > 1 this one's next:
        no barrier ties the warp groups together."""
        NQ: gl.constexpr = N // 128
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N_C, 32]
        )
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # a warp: 2 rows x 128 columns
        zero = gl.zeros([ROWS_C, BLOCK_N_C], gl.float32, layout=MMA)
        # Each slot's scales of each consumer's rows as a plain vector (the TMA box is [1, 64]).
        scales_slots = s_smem._reinterpret(
            gl.float32, [STAGES * CONSUMERS, ROWS_C], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        pid = gl.program_id(0)
        step = gl.num_programs(0) if PERSISTENT else num_tiles
        for t in range(pid, num_tiles, step):
            tile = tiles_ptr + t * FIELDS_C
            expert = gl.load(tile)
            if expert >= 0:
                row0 = gl.load(tile + 1)
                row_end = gl.load(tile + 2)
                pid_n = gl.load(tile + 3)
                row_begin = gl.load(tile + 4)
                base = ((t - pid) // step) * KQ
                b_scales = b_scale_ptr + (expert.to(gl.int64) * NQ + pid_n) * KQ  # [L, N/128, K/128]
                acc = gl.zeros([ROWS_C, BLOCK_N_C], gl.float32, layout=MMA)
                for k in range(0, KQ - KQ % K_UNROLL, K_UNROLL):
                    acc = _k_steps(acc, k, base, a_smem, b_smem, scales_slots, ready, empty, b_scales, zero,
                                   K_UNROLL, STAGES, CONSUMERS, INDEX)  # fmt: skip
                for k in range(KQ - KQ % K_UNROLL, KQ):
                    acc = _k_steps(acc, k, base, a_smem, b_smem, scales_slots, ready, empty, b_scales, zero,
                                   1, STAGES, CONSUMERS, INDEX)  # fmt: skip
                # The tile leaves through shared memory (the compiler's layout conversion) in 16 bytes
                # per thread, whole 128-byte lines per store: the MMA layout's own pieces are 4 bytes,
                # and storing from it is slower.
                value = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), STORE)
                rows_S = row0 + INDEX * ROWS_C + gl.arange(0, ROWS_C, layout=gl.SliceLayout(1, STORE))
                cols_S = pid_n * BLOCK_N_C + gl.arange(0, BLOCK_N_C, layout=gl.SliceLayout(0, STORE))
                out = c_ptr + rows_S.to(gl.int64)[:, None] * N + cols_S[None, :]
                gl.store(out, value, mask=((rows_S >= row_begin) & (rows_S < row_end))[:, None])

    @gluon.jit
    def _grouped_gemm_kernel(
        a_desc,  # [R, K] e4m3, boxes [64, 128]
        s_desc,  # the activation scales K-major: [K/128, R] float32, boxes [1, 64]
        b_desc,  # [L * N, K] e4m3, boxes [128, 128]
        b_scale_ptr,  # [L, N/128, K/128] float32
        c_ptr,  # [R, N]
        tiles_ptr,  # [num_tiles, 5] int32 (tile_schedule)
        num_tiles,
        N: gl.constexpr,
        K: gl.constexpr,
        STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr,
        PERSISTENT: gl.constexpr,
        K_UNROLL: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr,
    ):
        KQ: gl.constexpr = K // 128
        # The row tile as one [64, 128] slot per consumer: a shared-memory block's dims must be powers of 2.
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CONSUMERS, 64, 128], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N_C, 128], b_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES * CONSUMERS, 1, ROWS_C], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the loader's expect, completed by the TMA bytes
            mbarrier.init(empty.index(i), count=CONSUMERS)
        # The argument tuples are written inline: a tuple held in a variable first turns its constexpr
        # members into tensors (Triton 3.6), and the partitions need them constexpr. The first pair is
        # the default partition (the kernel's num_warps=4), the others are workers.
        # fmt: off
        if CONSUMERS == 3:
            gl.warp_specialize(
                [
                    (_consumer, (a_smem, b_smem, s_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr,
                                 num_tiles, N, KQ, STAGES, CONSUMERS, 0, PERSISTENT, K_UNROLL)),
                    (_consumer, (a_smem, b_smem, s_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr,
                                 num_tiles, N, KQ, STAGES, CONSUMERS, 1, PERSISTENT, K_UNROLL)),
                    (_consumer, (a_smem, b_smem, s_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr,
                                 num_tiles, N, KQ, STAGES, CONSUMERS, 2, PERSISTENT, K_UNROLL)),
                    (_loader, (a_desc, b_desc, s_desc, a_smem, b_smem, s_smem, ready, empty, tiles_ptr, num_tiles,
                               N, KQ, STAGES, CONSUMERS, PERSISTENT)),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, (a_smem, b_smem, s_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr,
                                 num_tiles, N, KQ, STAGES, CONSUMERS, 0, PERSISTENT, K_UNROLL)),
                    (_consumer, (a_smem, b_smem, s_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr,
                                 num_tiles, N, KQ, STAGES, CONSUMERS, 1, PERSISTENT, K_UNROLL)),
                    (_loader, (a_desc, b_desc, s_desc, a_smem, b_smem, s_smem, ready, empty, tiles_ptr, num_tiles,
                               N, KQ, STAGES, CONSUMERS, PERSISTENT)),
                ],
                [4, 1],
                [CONSUMER_REGS, LOADER_REGS],
            )
        # fmt: on


def device_supported(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: Gluon importable and an sm90 GPU (Hopper's wgmma, TMA and
    ``setmaxnreg``)."""
    return gluon is not None and device.type == "cuda" and compute_capability(device) == (9, 0)


def supported(q_RK: torch.Tensor, w_LNK: torch.Tensor) -> bool:
    """Whether ``grouped_gemm`` runs for these operands: ``device_supported``, e4m3, N a multiple of
    128, operands a descriptor can address."""
    return (
        device_supported(q_RK.device)
        and q_RK.dtype == w_LNK.dtype == torch.float8_e4m3fn
        and w_LNK.shape[1] % BLOCK_N == 0
        and tma_ready(q_RK)
        and tma_ready(w_LNK)
    )


def grouped_gemm(
    q_RK: torch.Tensor,
    scales_RQ: torch.Tensor,
    w_LNK: torch.Tensor,
    w_scale_inv_LNQ: torch.Tensor,
    offsets_L: torch.Tensor,
    out_dtype: torch.dtype,
    config: WarpSpecializedConfig | None = None,
) -> torch.Tensor:
    """``fp8_gemm.grouped_gemm``'s contract on sm90 (``supported`` says where): e4m3 rows ``q_RK``
    (scales ``[R, K/128]``; K-major ones, ``quant.fp8.empty_k_major_scales``, are read where they lie,
    others copied so first) grouped by expert times each expert's e4m3 weight ``w_LNK[l]`` transposed
    (block scales ``[L, N/128, K/128]``) -> ``[R, N]`` in ``out_dtype``. ``offsets_L``: int32
    cumulative row counts on the device; rows past ``offsets_L[-1]`` are left unwritten. ``config``
    defaults to ``config_for(R / L)``."""
    if config is None:
        config = config_for(q_RK.shape[0] / w_LNK.shape[0])
    if config.consumers not in (2, 3):
        raise ValueError(f"consumers must be 2 or 3 warp groups, got {config.consumers}")
    if config.k_unroll < 1 or (config.k_unroll > 1 and config.consumers != 2):
        raise ValueError(
            f"k_unroll must be 1, or above 1 with two consumers (two products per warp group need their "
            f"registers), got k_unroll={config.k_unroll} with {config.consumers} consumers"
        )
    if not supported(q_RK, w_LNK):
        raise ValueError(
            "fp8_gemm_sm90 needs Triton's Gluon, an sm90 GPU, e4m3 operands, N a multiple of 128 and 16-byte "
            "aligned operands; use fp8_gemm.grouped_gemm (the Triton kernel) for these"
        )
    num_rows, k = q_RK.shape
    num_experts, n, _ = w_LNK.shape
    if k % FP8_BLOCK:
        raise ValueError(f"the reduction size must be a multiple of {FP8_BLOCK} for FP8 experts, got {k}")
    out_RN = torch.empty(num_rows, n, dtype=out_dtype, device=q_RK.device)
    if num_rows == 0:
        return out_RN
    tiles_T5 = tile_schedule(offsets_L, num_rows, n, config.block_m, config.group_m)
    num_tiles = tiles_T5.shape[0]
    grid = min(num_tiles, sm_count(q_RK.device)) if config.persistent else num_tiles
    _grouped_gemm_kernel[(grid,)](
        GluonDescriptor.from_tensor(q_RK, [ROWS_PER_CONSUMER, FP8_BLOCK], OPERAND_LAYOUT),
        GluonDescriptor.from_tensor(k_major_scales(scales_RQ), [1, ROWS_PER_CONSUMER], SCALE_LAYOUT),
        GluonDescriptor.from_tensor(w_LNK.view(num_experts * n, k), [BLOCK_N, FP8_BLOCK], OPERAND_LAYOUT),
        w_scale_inv_LNQ.contiguous(),
        out_RN,
        tiles_T5,
        num_tiles,
        N=n,
        K=k,
        STAGES=config.stages,
        CONSUMERS=config.consumers,
        PERSISTENT=config.persistent,
        K_UNROLL=config.k_unroll,
        CONSUMER_REGS=config.consumer_regs,
        LOADER_REGS=config.loader_regs,
        num_warps=4,  # the default partition: consumer warp group 0
    )
    return out_RN

"""The block-scaled FP8 grouped GEMM for Hopper written against the tensor cores' asynchronous MMA
(``wgmma``) in Gluon, Triton's lower-level language: the same contract as ``fp8_gemm.grouped_gemm``
(e4m3 rows grouped by expert, 1x128 activation scales, 128x128 weight block scales, counts on the
device, no host sync, CUDA-graph capturable), for prefill sizes on sm90.

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

Why a second kernel: block scaling multiplies each K step's partial product by its scales before
adding it, so the product must leave the tensor cores every 128 values of K. Triton's ``tl.dot``
waits for that product (``wgmma.wait_group 0``) and the tensor cores idle while it is scaled: the
Triton kernel reached ~0.7 of the GPU's FP8 rate. Here step k's MMA is issued asynchronously and only
then is step k-1's product waited for (``warpgroup_mma_wait(1)``) and scaled, so the scaling runs while
the tensor cores work on the next step, as DeepGEMM's promotion does. Operand tiles arrive by TMA into
a ring of ``stages`` shared-memory slots; a slot is refilled once both warp groups have finished the
MMA that read it.

Two launches: ``_schedule_kernel`` (Triton) writes each program's tile (expert, first row, row end,
column tile; expert -1 past the last tile) from the device offsets, with ``tiled_gemm.expert_tile``'s
rule; the Gluon kernel reads its tile from there. The schedule runs under ``TRITON_INTERPRET=1`` on
CPU (tested there); Gluon has no interpreter, so the GEMM is tested on GPUs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8 import FP8_BLOCK
from ..streams import compute_capability
from .tiled_gemm import GemmConfig, expert_tile, max_tiles, tma_ready

try:  # Gluon ships with Triton >= 3.5; its names moved between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    gluon = None

TILE_FIELDS = tl.constexpr(4)  # expert (-1: no tile), first row, row end, column tile


@triton.jit
def _schedule_kernel(
    offsets_ptr, tiles_ptr, NUM_EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, NUM_N, GROUP_M
):
    pid = tl.program_id(0)
    live, expert, rows_M, row_mask_M, pid_n = expert_tile(pid, offsets_ptr, NUM_EXPERTS, E_P2, BLOCK_M, NUM_N, GROUP_M)
    first = tl.min(rows_M, axis=0)
    tile = tiles_ptr + pid * TILE_FIELDS
    tl.store(tile, tl.where(live, expert, -1))
    tl.store(tile + 1, first)
    tl.store(tile + 2, first + tl.sum(row_mask_M.to(tl.int32), axis=0))
    tl.store(tile + 3, pid_n)


def tile_schedule(offsets_L: torch.Tensor, num_rows: int, n: int, config: GemmConfig) -> torch.Tensor:
    """int32 ``[tiles, 4]``: per program of a grouped GEMM over ``num_rows`` rows, (expert or -1, first
    row, row end, column tile), from the device offsets (no host read)."""
    num_experts = offsets_L.shape[0]
    tiles = max_tiles(num_rows, num_experts, n, config)
    tiles_T4 = torch.empty(tiles, TILE_FIELDS, dtype=torch.int32, device=offsets_L.device)
    _schedule_kernel[(tiles,)](
        offsets_L,
        tiles_T4,
        NUM_EXPERTS=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        BLOCK_M=config.block_m,
        NUM_N=triton.cdiv(n, config.block_n),
        GROUP_M=config.group_m,
    )
    return tiles_T4


if gluon is not None:

    @gluon.jit
    def _wgmma_kernel(
        a_desc,  # [R, K] e4m3, tiles [BLOCK_M, 128]
        a_scale_ptr,  # [R, K/128] float32
        b_desc,  # [L * N, K] e4m3, tiles [BLOCK_N, 128]
        b_scale_ptr,  # [L, N/128, K/128] float32
        c_ptr,  # [R, N]
        tiles_ptr,  # [programs, 4] int32 (tile_schedule)
        N: gl.constexpr,
        K: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        BLOCK_K: gl.constexpr = 128
        KQ: gl.constexpr = K // BLOCK_K
        NQ: gl.constexpr = N // BLOCK_K
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 32]
        )
        TILE_BYTES: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K
        tile = tiles_ptr + gl.program_id(0) * TILE_FIELDS
        expert = gl.load(tile)
        if expert >= 0:
            row0 = gl.load(tile + 1)
            pid_n = gl.load(tile + 3)
            b_row = expert * N + pid_n * BLOCK_N
            rows_M = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
            row_mask_M = rows_M < gl.load(tile + 2)
            a_scales = a_scale_ptr + rows_M.to(gl.int64) * KQ
            b_scales = b_scale_ptr + (expert.to(gl.int64) * NQ + (pid_n * BLOCK_N) // BLOCK_K) * KQ

            a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
            b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
            for i in gl.static_range(STAGES):
                if i < KQ:
                    mbarrier.expect(ready.index(i), TILE_BYTES)
                    tma_load(a_desc, [row0, i * BLOCK_K], ready.index(i), a_smem.index(i))
                    tma_load(b_desc, [b_row, i * BLOCK_K], ready.index(i), b_smem.index(i))

            zero = gl.full([BLOCK_M, BLOCK_N], 0.0, gl.float32, layout=MMA)
            acc = gl.full([BLOCK_M, BLOCK_N], 0.0, gl.float32, layout=MMA)
            mbarrier.wait(ready.index(0), 0)
            product = warpgroup_mma(
                a_smem.index(0), b_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            scale_M = gl.load(a_scales, mask=row_mask_M, other=0.0) * gl.load(b_scales)
            for k in range(1, KQ):
                stage = k % STAGES
                mbarrier.wait(ready.index(stage), (k // STAGES) & 1)
                next_product = warpgroup_mma(
                    a_smem.index(stage), b_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True
                )
                next_scale_M = gl.load(a_scales + k, mask=row_mask_M, other=0.0) * gl.load(b_scales + k)
                # Step k-1's product, scaled while step k's MMA runs.
                done = warpgroup_mma_wait(1, deps=[product])
                cta_barrier()  # both warp groups are past step k-1's tiles before its slot is refilled
                acc += done * scale_M[:, None]
                refill = k - 1 + STAGES
                if refill < KQ:
                    slot = (k - 1) % STAGES
                    mbarrier.expect(ready.index(slot), TILE_BYTES)
                    tma_load(a_desc, [row0, refill * BLOCK_K], ready.index(slot), a_smem.index(slot))
                    tma_load(b_desc, [b_row, refill * BLOCK_K], ready.index(slot), b_smem.index(slot))
                product = next_product
                scale_M = next_scale_M
            done = warpgroup_mma_wait(0, deps=[product])
            acc += done * scale_M[:, None]
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
            cols_N = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
            out = c_ptr + rows_M.to(gl.int64)[:, None] * N + cols_N[None, :]
            gl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_mask_M[:, None])


WGMMA_CONFIG = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=4, tma=True)


def supported(q_RK: torch.Tensor, w_LNK: torch.Tensor, config: GemmConfig = WGMMA_CONFIG) -> bool:
    """Whether ``grouped_gemm`` runs for these operands: Gluon importable, an sm90 GPU (Hopper's
    ``wgmma``), N a multiple of the tile width, operands a descriptor can address."""
    return (
        gluon is not None
        and q_RK.device.type == "cuda"
        and compute_capability(q_RK.device) == (9, 0)
        and w_LNK.shape[1] % config.block_n == 0
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
    config: GemmConfig = WGMMA_CONFIG,
) -> torch.Tensor:
    """``fp8_gemm.grouped_gemm``'s contract on sm90 through asynchronous MMAs (``supported`` says where;
    ``config``'s block_m, block_n, group_m, num_warps and num_stages apply). Rows past
    ``offsets_L[-1]`` are left unwritten."""
    if not supported(q_RK, w_LNK, config):
        raise ValueError(
            "fp8_wgmma needs Triton's Gluon, an sm90 GPU, N a multiple of block_n and 16-byte aligned operands"
        )
    num_rows, k = q_RK.shape
    num_experts, n, _ = w_LNK.shape
    if k % FP8_BLOCK:
        raise ValueError(f"the reduction size must be a multiple of {FP8_BLOCK} for FP8 experts, got {k}")
    out_RN = torch.empty(num_rows, n, dtype=out_dtype, device=q_RK.device)
    if num_rows == 0:
        return out_RN
    tiles_T4 = tile_schedule(offsets_L, num_rows, n, config)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    _wgmma_kernel[(tiles_T4.shape[0],)](
        GluonDescriptor.from_tensor(q_RK, [config.block_m, FP8_BLOCK], layout),
        scales_RQ,
        GluonDescriptor.from_tensor(w_LNK.view(num_experts * n, k), [config.block_n, FP8_BLOCK], layout),
        w_scale_inv_LNQ,
        out_RN,
        tiles_T4,
        N=n,
        K=k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return out_RN

"""Probe (temporary): where the sm90 FP8 kernel's scales should come from, and the layer's kernel time.

Part 1: variants of ``fp8_gemm_sm90``'s kernel (a copy here, with two switches), each GEMM alone at
DeepSeek-V3's dims, 8 experts, beside cuBLAS's row-wise FP8 rate on the same shape, in one run:
  A_SRC  0: one [1, 64] TMA box of activation scales per consumer and step (the kernel today)
         1: one [1, 64 * next_pow2(consumers)] box per step for all consumers
         2: constant activation scales (no loads: the ceiling of this structure)
  B_SRC  0: the weight block's scale loaded from global memory by each consumer per step (today)
         1: loaded by the loader warp before it waits for the slot, stored into the slot as a
            vector the consumers read like the activation scales
         2: constant weight scale
Variants 0/1 are checked against the kernel today (bit-identical outputs expected).

Part 2: the MoE layer at EP1, 32 experts, 4096 tokens, bf16 and fp8 experts: the GPU time per kernel
name (torch.profiler, eager forwards after warm-up), to see what besides the GEMMs the FP8 layer spends.

Usage (GPU): ``python benchmarks/probe_sm90_scale_paths.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from moe_sbo.config import get_preset
from moe_sbo.experts import fp8_gemm_sm90 as sm90
from moe_sbo.experts.fp8_gemm_sm90 import (
    BLOCK_N_C,
    FIELDS_C,
    OPERAND_LAYOUT,
    ROWS_C,
    SCALE_LAYOUT,
    GluonDescriptor,
    tile_schedule,
    tma_load,
)
from moe_sbo.layer import MoELayer
from moe_sbo.measure.timing import KernelTimer
from moe_sbo.quant import kernels as quant_kernels
from moe_sbo.quant.fp8 import k_major_scales
from moe_sbo.streams import sm_count


@gluon.jit
def _loader(
    a_desc, b_desc, s_desc, a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, tiles_ptr, num_tiles,
    N: gl.constexpr, KQ: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CP2: gl.constexpr,
    A_SRC: gl.constexpr, B_SRC: gl.constexpr,
):  # fmt: skip
    S_BYTES: gl.constexpr = 0 if A_SRC == 2 else (CONSUMERS if A_SRC == 0 else 1) * s_desc.block_type.nbytes
    STAGE_BYTES: gl.constexpr = CONSUMERS * a_desc.block_type.nbytes + S_BYTES + b_desc.block_type.nbytes
    NQ: gl.constexpr = N // 128
    BS_LAYOUT: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])  # 64 copies over one warp
    pid = gl.program_id(0)
    step = gl.num_programs(0)
    for t in range(pid, num_tiles, step):
        tile = tiles_ptr + t * FIELDS_C
        expert = gl.load(tile)
        if expert >= 0:
            row0 = gl.load(tile + 1)
            pid_n = gl.load(tile + 3)
            b_row = expert * N + pid_n * BLOCK_N_C
            b_scales = b_scale_ptr + (expert.to(gl.int64) * NQ + pid_n) * KQ
            base = ((t - pid) // step) * KQ
            for k in range(KQ):
                it = base + k
                s = it % STAGES
                if B_SRC == 1:
                    b_scale_M = gl.load(b_scales + k + gl.zeros([ROWS_C], gl.int32, layout=BS_LAYOUT))
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                if B_SRC == 1:
                    bs_smem.index(s).store(b_scale_M)
                mbarrier.expect(ready.index(s), STAGE_BYTES)
                for i in gl.static_range(CONSUMERS):
                    tma_load(a_desc, [row0 + 64 * i, k * 128], ready.index(s), a_smem.index(s * CONSUMERS + i))
                    if A_SRC == 0:
                        tma_load(s_desc, [k, row0 + 64 * i], ready.index(s), s_smem.index(s * CONSUMERS + i))
                if A_SRC == 1:
                    tma_load(s_desc, [k, row0], ready.index(s), s_smem.index(s))
                tma_load(b_desc, [b_row, k * 128], ready.index(s), b_smem.index(s))


@gluon.jit
def _consumer(
    a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
    N: gl.constexpr, KQ: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CP2: gl.constexpr,
    INDEX: gl.constexpr, A_SRC: gl.constexpr, B_SRC: gl.constexpr,
):  # fmt: skip
    NQ: gl.constexpr = N // 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N_C, 32])
    STORE: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    zero = gl.zeros([ROWS_C, BLOCK_N_C], gl.float32, layout=MMA)
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if A_SRC == 0:
        scales_slots = s_smem._reinterpret(gl.float32, [STAGES * CONSUMERS, ROWS_C], PLAIN)
    else:
        scales_slots = s_smem._reinterpret(gl.float32, [STAGES * CP2, ROWS_C], PLAIN)
    pid = gl.program_id(0)
    step = gl.num_programs(0)
    for t in range(pid, num_tiles, step):
        tile = tiles_ptr + t * FIELDS_C
        expert = gl.load(tile)
        if expert >= 0:
            row0 = gl.load(tile + 1)
            row_end = gl.load(tile + 2)
            pid_n = gl.load(tile + 3)
            row_begin = gl.load(tile + 4)
            base = ((t - pid) // step) * KQ
            b_scales = b_scale_ptr + (expert.to(gl.int64) * NQ + pid_n) * KQ
            acc = gl.zeros([ROWS_C, BLOCK_N_C], gl.float32, layout=MMA)
            for k in range(KQ):
                it = base + k
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                a_tile = a_smem.index(s * CONSUMERS + INDEX)
                b_tile = b_smem.index(s)
                product = warpgroup_mma(a_tile, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
                if A_SRC == 0:
                    a_scale_M = scales_slots.index(s * CONSUMERS + INDEX).load(gl.SliceLayout(1, MMA))
                elif A_SRC == 1:
                    a_scale_M = scales_slots.index(s * CP2 + INDEX).load(gl.SliceLayout(1, MMA))
                else:
                    a_scale_M = gl.full([ROWS_C], 1.0, gl.float32, layout=gl.SliceLayout(1, MMA))
                if B_SRC == 0:
                    scale_M = a_scale_M * gl.load(b_scales + k)
                elif B_SRC == 1:
                    scale_M = a_scale_M * bs_smem.index(s).load(gl.SliceLayout(1, MMA))
                else:
                    scale_M = a_scale_M
                product, _, _ = warpgroup_mma_wait(0, deps=[product, a_tile, b_tile])
                mbarrier.arrive(empty.index(s), count=1)
                acc += product * scale_M[:, None]
            value = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), STORE)
            rows_S = row0 + INDEX * ROWS_C + gl.arange(0, ROWS_C, layout=gl.SliceLayout(1, STORE))
            cols_S = pid_n * BLOCK_N_C + gl.arange(0, BLOCK_N_C, layout=gl.SliceLayout(0, STORE))
            out = c_ptr + rows_S.to(gl.int64)[:, None] * N + cols_S[None, :]
            gl.store(out, value, mask=((rows_S >= row_begin) & (rows_S < row_end))[:, None])


@gluon.jit
def _kernel(
    a_desc, s_desc, b_desc, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
    N: gl.constexpr, K: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CP2: gl.constexpr,
    A_SRC: gl.constexpr, B_SRC: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):  # fmt: skip
    KQ: gl.constexpr = K // 128
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CONSUMERS, 64, 128], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N_C, 128], b_desc.layout)
    if A_SRC == 0:
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES * CONSUMERS, 1, ROWS_C], s_desc.layout)
    else:
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, ROWS_C * CP2], s_desc.layout)
    bs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS_C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    # fmt: off
    if CONSUMERS == 3:
        gl.warp_specialize(
            [
                (_consumer, (a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
                             N, KQ, STAGES, CONSUMERS, CP2, 0, A_SRC, B_SRC)),
                (_consumer, (a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
                             N, KQ, STAGES, CONSUMERS, CP2, 1, A_SRC, B_SRC)),
                (_consumer, (a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
                             N, KQ, STAGES, CONSUMERS, CP2, 2, A_SRC, B_SRC)),
                (_loader, (a_desc, b_desc, s_desc, a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr,
                           tiles_ptr, num_tiles, N, KQ, STAGES, CONSUMERS, CP2, A_SRC, B_SRC)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_consumer, (a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
                             N, KQ, STAGES, CONSUMERS, CP2, 0, A_SRC, B_SRC)),
                (_consumer, (a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr, c_ptr, tiles_ptr, num_tiles,
                             N, KQ, STAGES, CONSUMERS, CP2, 1, A_SRC, B_SRC)),
                (_loader, (a_desc, b_desc, s_desc, a_smem, b_smem, s_smem, bs_smem, ready, empty, b_scale_ptr,
                           tiles_ptr, num_tiles, N, KQ, STAGES, CONSUMERS, CP2, A_SRC, B_SRC)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    # fmt: on


def variant_gemm(q_RK, scales_RQ, w_LNK, ws_LNQ, offsets_L, config, a_src, b_src, loader_regs=None):
    num_rows, k = q_RK.shape
    num_experts, n, _ = w_LNK.shape
    cp2 = triton.next_power_of_2(config.consumers)
    out_RN = torch.empty(num_rows, n, dtype=torch.bfloat16, device=q_RK.device)
    tiles = tile_schedule(offsets_L, num_rows, n, config.block_m, config.group_m)
    grid = min(tiles.shape[0], sm_count(q_RK.device))
    box = [1, ROWS_C.value] if a_src == 0 else [1, ROWS_C.value * cp2]
    _kernel[(grid,)](
        GluonDescriptor.from_tensor(q_RK, [64, 128], OPERAND_LAYOUT),
        GluonDescriptor.from_tensor(k_major_scales(scales_RQ), box, SCALE_LAYOUT),
        GluonDescriptor.from_tensor(w_LNK.view(num_experts * n, k), [128, 128], OPERAND_LAYOUT),
        ws_LNQ.contiguous(),
        out_RN,
        tiles,
        tiles.shape[0],
        N=n,
        K=k,
        STAGES=config.stages,
        CONSUMERS=config.consumers,
        CP2=cp2,
        A_SRC=a_src,
        B_SRC=b_src,
        CONSUMER_REGS=config.consumer_regs,
        LOADER_REGS=loader_regs or config.loader_regs,
        num_warps=4,
    )
    return out_RN


VARIANTS = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (2, 2)]


def gemm_part(timer, device, out_rows, experts=8, hidden=7168, inter=2048, rows_list=(1024, 2048, 4096)):
    gen = torch.Generator(device=device).manual_seed(0)
    for rows_per_expert in rows_list:
        rows = experts * rows_per_expert
        offsets_L = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_per_expert
        config = sm90.config_for(rows_per_expert)
        for gemm, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            x = torch.randn(rows, k, generator=gen, device=device)
            q, s = quant_kernels.quantize_rows(x, offsets_L, k_major=True)
            w = (torch.randn(experts, n, k, generator=gen, device=device) * k**-0.5).to(torch.float8_e4m3fn)
            ws = torch.rand(experts, n // 128, k // 128, generator=gen, device=device) + 0.5
            ref = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, config)
            ones_R1, ones_1N = torch.ones(rows, 1, device=device), torch.ones(1, n, device=device)
            w_KN = w[0].t()
            t_ref = timer(lambda: torch._scaled_mm(q, w_KN, ones_R1, ones_1N, out_dtype=torch.bfloat16))
            t_today = timer(lambda: sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, config))
            flop = 2 * rows * n * k
            base = {"gemm": gemm, "rows_per_expert": rows_per_expert, "consumers": config.consumers}
            out_rows.append({**base, "impl": "scaled_mm_rowwise", "t_us": t_ref, "tflops": flop / t_ref / 1e6})
            out_rows.append({**base, "impl": "sm90_today", "t_us": t_today, "tflops": flop / t_today / 1e6})
            for a_src, b_src in VARIANTS:
                row = {**base, "impl": f"A{a_src}B{b_src}"}
                try:
                    y = variant_gemm(q, s, w, ws, offsets_L, config, a_src, b_src)
                    if a_src < 2 and b_src < 2:
                        row["max_abs_diff_vs_today"] = (y.float() - ref.float()).abs().max().item()
                    t = timer(lambda a=a_src, b=b_src: variant_gemm(q, s, w, ws, offsets_L, config, a, b))
                    row.update(t_us=t, tflops=flop / t / 1e6, vs_rowwise=t_ref / t)
                except Exception as exc:  # noqa: BLE001 - a variant that fails is a row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                out_rows.append(row)
                print(row, flush=True)
            print(
                f"{gemm} {rows_per_expert}: rowwise {flop / t_ref / 1e6:.0f} today {flop / t_today / 1e6:.0f}",
                flush=True,
            )


def layer_part(device, out):
    cfg = get_preset("deepseek-v3").with_num_experts(32)
    tokens = 4096
    x = torch.randn(tokens, cfg.hidden_size, device=device).to(torch.bfloat16)
    for experts in ("bf16", "fp8"):
        layer = MoELayer(
            cfg,
            dispatcher="low_latency",
            dispatcher_options={"max_tokens_per_rank": tokens, "fp8": experts == "fp8"},
            device=device,
            expert_dtype="fp8" if experts == "fp8" else None,
        )
        with torch.no_grad():
            for _ in range(3):
                layer(x)
            torch.cuda.synchronize()
            iters = 5
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    layer(x)
                torch.cuda.synchronize()
        per_kernel = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name[:120]] += event.device_time / iters
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
        total = sum(per_kernel.values())
        out[experts] = {"total_us": total, "kernels": top[:40]}
        print(f"layer {experts}: {total:.0f} us of kernels per forward", flush=True)
        for name, us in top[:25]:
            print(f"  {us:8.1f}  {name}", flush=True)
        del layer
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    timer = KernelTimer(device, quick=False, graph=True)
    rows: list[dict] = []
    layer: dict = {}
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    try:
        gemm_part(timer, device, rows)
    finally:
        result["gemm_rows"] = rows
        (args.out / "sm90_scale_paths.json").write_text(json.dumps(result, indent=1))
    layer_part(device, layer)
    result["layer_kernels"] = layer
    (args.out / "sm90_scale_paths.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

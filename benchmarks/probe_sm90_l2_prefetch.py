"""Probe (temporary): the sm90 FP8 kernel's loader asking L2 for the weight tile's rows some K steps
ahead (``l2_prefetch``: one line prefetch per thread and 128 bytes), at 128-256 rows per expert where
each weight tile is read from memory once, each GEMM alone at DeepSeek-V3's dims, against the kept
config and cuBLAS's row-wise FP8 rate. ``--ncu``: a few eager launches for Nsight Compute (no timing).

Usage (GPU): ``python benchmarks/probe_sm90_l2_prefetch.py --out DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from moe_sbo.experts import fp8_gemm_sm90 as sm90
from moe_sbo.measure.timing import KernelTimer
from moe_sbo.quant import kernels as quant_kernels

TWO = sm90.TWO_CONSUMERS_CONFIG
CONFIGS = {
    "kept": TWO,
    "pf4 c2": dataclasses.replace(TWO, l2_prefetch=4, l2_prefetch_chunk=2),
    "pf8 c4": dataclasses.replace(TWO, l2_prefetch=8, l2_prefetch_chunk=4),
    "pf8 c8": dataclasses.replace(TWO, l2_prefetch=8, l2_prefetch_chunk=8),
    "pf12 c4": dataclasses.replace(TWO, l2_prefetch=12, l2_prefetch_chunk=4),
    "pf4 c4": dataclasses.replace(TWO, l2_prefetch=4, l2_prefetch_chunk=4),
}


def operands(experts: int, rows_per_expert: int, n: int, k: int, gen: torch.Generator, device: torch.device):
    rows = experts * rows_per_expert
    offsets_L = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_per_expert
    x = torch.randn(rows, k, generator=gen, device=device)
    q, s = quant_kernels.quantize_rows(x, offsets_L, k_major=True)
    w = (torch.randn(experts, n, k, generator=gen, device=device) * k**-0.5).to(torch.float8_e4m3fn)
    ws = torch.rand(experts, n // 128, k // 128, generator=gen, device=device) + 0.5
    return q, s, w, ws, offsets_L


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ncu", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter = 7168, 2048
    if args.ncu:  # 8 experts x 128 rows, gate_up then down, the kept config then pf8 c4
        for n, k in ((2 * inter, hidden), (hidden, inter)):
            q, s, w, ws, offsets_L = operands(8, 128, n, k, gen, device)
            for name in ("kept", "pf8 c4"):
                sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, CONFIGS[name])
        torch.cuda.synchronize()
        return 0
    timer = KernelTimer(device, quick=False, graph=True)
    rows_out = []
    for experts in (8, 32):
        for rows_per_expert in (128, 256):
            for gemm, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
                q, s, w, ws, offsets_L = operands(experts, rows_per_expert, n, k, gen, device)
                rows = experts * rows_per_expert
                ref = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, TWO)
                flop = 2 * rows * n * k
                a_f8 = q[:rows]
                b_f8 = w[0].t()
                ones_r = torch.ones(rows, 1, device=device)
                ones_n = torch.ones(1, n, device=device)
                # cuBLAS's row-wise FP8 on the same FLOPs: one [rows, k] x [k, n] product
                t_ref = timer(lambda: torch._scaled_mm(a_f8, b_f8, ones_r, ones_n, out_dtype=torch.bfloat16))
                for name, config in CONFIGS.items():
                    row = {"gemm": gemm, "experts": experts, "rows_per_expert": rows_per_expert, "config": name}
                    row.update(vars(config))
                    row["ref_scaled_mm_tflops"] = flop / t_ref / 1e6
                    try:
                        y = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, config)
                        row["max_rel_diff"] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                        t = timer(lambda c=config: sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, c))
                        row.update(t_us=t, tflops=flop / t / 1e6, weight_tbps=experts * n * k / t / 1e6)
                    except Exception as exc:  # noqa: BLE001 - a config that fails is a row
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows_out.append(row)
                    print(
                        f"{gemm:7s} {experts:2d} x {rows_per_expert:5d} {name:10s} "
                        + (
                            f"{row['t_us']:8.1f} us {row['tflops']:7.0f} TFLOP/s {row['weight_tbps']:5.2f} TB/s "
                            f"(row-wise {row['ref_scaled_mm_tflops']:5.0f}) diff {row['max_rel_diff']:.1e}"
                            if "t_us" in row
                            else row["error"]
                        ),
                        flush=True,
                    )
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows_out}
    (args.out / "sm90_l2_prefetch.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Probe (temporary): the sm90 FP8 kernel's registers per consumer and tile order (group_m), each GEMM
alone at DeepSeek-V3's dims, 8 experts, against cuBLAS's row-wise FP8 rate in the same run.

Usage (GPU): ``python benchmarks/probe_sm90_configs.py --out DIR``.
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

THREE = sm90.DEFAULT_CONFIG
TWO = sm90.TWO_CONSUMERS_CONFIG
CONFIGS = {
    "3c r160 g8": THREE,
    "3c r168 g8": dataclasses.replace(THREE, consumer_regs=168),
    "3c r160 g4": dataclasses.replace(THREE, group_m=4),
    "3c r160 g16": dataclasses.replace(THREE, group_m=16),
    "2c u4 g8": TWO,
    "2c u4 g4": dataclasses.replace(TWO, group_m=4),
    "2c u4 g16": dataclasses.replace(TWO, group_m=16),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    timer = KernelTimer(device, quick=False, graph=True)
    gen = torch.Generator(device=device).manual_seed(0)
    rows_out = []
    experts, hidden, inter = 8, 7168, 2048
    for rows_per_expert in (1024, 2048, 4096):
        rows = experts * rows_per_expert
        offsets_L = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_per_expert
        for gemm, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            x = torch.randn(rows, k, generator=gen, device=device)
            q, s = quant_kernels.quantize_rows(x, offsets_L, k_major=True)
            w = (torch.randn(experts, n, k, generator=gen, device=device) * k**-0.5).to(torch.float8_e4m3fn)
            ws = torch.rand(experts, n // 128, k // 128, generator=gen, device=device) + 0.5
            ones_R1, ones_1N = torch.ones(rows, 1, device=device), torch.ones(1, n, device=device)
            w_KN = w[0].t()
            flop = 2 * rows * n * k
            t_ref = timer(lambda: torch._scaled_mm(q, w_KN, ones_R1, ones_1N, out_dtype=torch.bfloat16))
            ref = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, THREE)
            for name, config in CONFIGS.items():
                row = {"gemm": gemm, "rows_per_expert": rows_per_expert, "config": name, **vars(config)}
                try:
                    y = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, config)
                    row["max_rel_diff"] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = timer(lambda c=config: sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, c))
                    row.update(t_us=t, tflops=flop / t / 1e6, vs_rowwise=t_ref / t, rowwise_tflops=flop / t_ref / 1e6)
                except Exception as exc:  # noqa: BLE001 - a config that fails is a row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows_out.append(row)
                print(
                    f"{gemm:7s} {rows_per_expert:5d} {name:12s} "
                    + (f"{row['tflops']:7.0f} TFLOP/s {row['vs_rowwise']:.3f}" if "t_us" in row else row["error"]),
                    flush=True,
                )
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows_out}
    (args.out / "sm90_configs.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

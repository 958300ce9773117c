"""Probe (temporary): six stages for the sm90 FP8 kernel's two consumers at 128-1024 rows per expert,
each GEMM alone at DeepSeek-V3's dims, against the kept config and cuBLAS's row-wise FP8 rate.

Usage (GPU): ``python benchmarks/probe_sm90_stages.py --out DIR``.
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
    "s5 u4": TWO,
    "s6 u4": dataclasses.replace(TWO, stages=6),
    "s6 u2": dataclasses.replace(TWO, stages=6, k_unroll=2),
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
    hidden, inter = 7168, 2048
    for experts in (8, 32):
        for rows_per_expert in (128, 256, 512, 1024):
            rows = experts * rows_per_expert
            offsets_L = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows_per_expert
            for gemm, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
                x = torch.randn(rows, k, generator=gen, device=device)
                q, s = quant_kernels.quantize_rows(x, offsets_L, k_major=True)
                w = (torch.randn(experts, n, k, generator=gen, device=device) * k**-0.5).to(torch.float8_e4m3fn)
                ws = torch.rand(experts, n // 128, k // 128, generator=gen, device=device) + 0.5
                ref = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, TWO)
                flop = 2 * rows * n * k
                for name, config in CONFIGS.items():
                    row = {"gemm": gemm, "experts": experts, "rows_per_expert": rows_per_expert, "config": name}
                    row.update(vars(config))
                    try:
                        y = sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, config)
                        row["max_rel_diff"] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                        t = timer(lambda c=config: sm90.grouped_gemm(q, s, w, ws, offsets_L, torch.bfloat16, c))
                        row.update(t_us=t, tflops=flop / t / 1e6, weight_tbps=experts * n * k / t / 1e6)
                    except Exception as exc:  # noqa: BLE001 - a config that fails is a row
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows_out.append(row)
                    print(
                        f"{gemm:7s} {experts:2d} x {rows_per_expert:5d} {name:6s} "
                        + (f"{row['tflops']:7.0f} TFLOP/s" if "t_us" in row else row["error"]),
                        flush=True,
                    )
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows_out}
    (args.out / "sm90_stages.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Probe (temporary): FP8 MLP at decode sizes with row-major against K-major activation scales, one run."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fp8_experts import graph_time, make_experts  # noqa: E402

from moe_sbo.experts import fp8_gemm  # noqa: E402
from moe_sbo.measure.timing import KernelTimer  # noqa: E402

device = torch.device("cuda")
timer = KernelTimer(device, False)
chosen = fp8_gemm.k_major_scales_wanted
for L in (8, 32):
    fp8, _ = make_experts(L, 7168, 2048, device, torch.bfloat16)
    for rpe in (16, 64, 128, 256):
        counts = torch.full((L,), rpe, dtype=torch.int64, device=device)
        x = torch.randn(L * rpe, 7168, device=device).to(torch.bfloat16)
        for name, rule in (("chosen", chosen), ("k_major", lambda d, r: True), ("row_major", lambda d, r: False)):
            fp8_gemm.k_major_scales_wanted = rule
            with torch.no_grad():
                t = graph_time(lambda: fp8(x, counts), timer, device)
                te = timer(lambda: fp8(x, counts))
            print(f"L={L} rows/expert={rpe} {name:9s} graph {t:8.1f} us eager {te:8.1f} us", flush=True)
    del fp8

"""Probe (temporary): the sm90 FP8 GEMM with its per-step scale loads against the same kernel with
constant scales (no scale loads): what moving the scales off the consumers' path could gain."""

from __future__ import annotations

import json
import os

import torch
from triton.testing import do_bench_cudagraph

from moe_sbo.experts import fp8_gemm_sm90 as sm90
from moe_sbo.quant import kernels as qk

device = torch.device("cuda")
H, I = 7168, 2048
rows_out = []
L = 8
gu = torch.randn(L, 2 * I, H, device=device).to(torch.float8_e4m3fn)
gu_s = torch.rand(L, 2 * I // 128, H // 128, device=device) + 0.5
dn = torch.randn(L, H, I, device=device).to(torch.float8_e4m3fn)
dn_s = torch.rand(L, H // 128, I // 128, device=device) + 0.5
for rpe in (1024, 2048, 4096):
    offsets = torch.arange(1, L + 1, device=device, dtype=torch.int32) * rpe
    qx, sx = qk.quantize_rows(torch.randn(L * rpe, H, device=device), offsets)
    qh, sh = qk.quantize_rows(torch.randn(L * rpe, I, device=device), offsets)
    for name, (q, s, w, ws) in {"gate_up": (qx, sx, gu, gu_s), "down": (qh, sh, dn, dn_s)}.items():
        n, k = w.shape[1], w.shape[2]
        flops = 2 * L * rpe * n * k
        for cfg_name, cfg in (("3c", sm90.DEFAULT_CONFIG), ("2c", sm90.TWO_CONSUMERS_CONFIG)):
            for probe in (False, True):
                sm90.PROBE_NO_SCALES = probe
                fn = lambda: sm90.grouped_gemm(q, s, w, ws, offsets, torch.bfloat16, cfg)  # noqa: E731
                fn()
                t = do_bench_cudagraph(fn, rep=200) * 1e3
                row = {"gemm": name, "rows_per_expert": rpe, "config": cfg_name, "no_scale_loads": probe,
                       "t_us": t, "tflops": flops / t / 1e6}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        sm90.PROBE_NO_SCALES = False
out = os.environ.get("OUT", "out")
os.makedirs(out, exist_ok=True)
json.dump(rows_out, open(os.path.join(out, "probe_scales.json"), "w"), indent=1)

"""Host cost of one ``grouped_gemm_kernels.grouped_gemm`` call, per-thread loads against descriptor
loads (``GemmConfig.tma``: a tensor descriptor built on the host for each call), with the GPU held
back by a sleeping kernel so that the calls only queue: what an eager decode forward pays per GEMM.

Usage (GPU): ``python benchmarks/probe_tma_host.py``; prints µs per call for each config.
"""

import dataclasses
import time

import torch

from moe_sbo.experts.tiled_gemm import LARGE_CONFIG, SMALL_CONFIG, grouped_gemm

dev = "cuda"
x = torch.randn(256, 7168, device=dev, dtype=torch.bfloat16)
w = torch.randn(8, 4096, 7168, device=dev, dtype=torch.bfloat16)
off = (torch.arange(1, 9, device=dev) * 32).to(torch.int32)
for name, cfg in [
    ("small", SMALL_CONFIG),
    ("small_tma", dataclasses.replace(SMALL_CONFIG, tma=True)),
    ("large_ptr", dataclasses.replace(LARGE_CONFIG, tma=False)),
    ("large_tma", LARGE_CONFIG),
]:
    for _ in range(5):
        grouped_gemm(x, w, off, config=cfg)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # hold the GPU so launches only queue
    t = time.perf_counter()
    for _ in range(100):
        grouped_gemm(x, w, off, config=cfg)
    host = (time.perf_counter() - t) / 100 * 1e6
    torch.cuda.synchronize()
    print(f"{name}: host {host:.1f} us per grouped_gemm call")

"""Dense routed experts at decode sizes: ``gemv_kernels``' grouped GEMM against ``torch._grouped_mm``,
one GPU, DeepSeek-V3 dims, and the weight-read floor measured in the same run.

Rows (``bench="gemv"``, ``OUT/gemv.json``) per experts on the GPU (L, default 16: EP2's share of 32)
and rows in all (R, padding included: ``low_latency`` hands the experts P x C x K rows), routing
uniform over the L experts (seeded): ``t_gemv_us`` and ``t_grouped_mm_us`` for the whole routed MLP
(gate_up, SwiGLU, down; ``measure.timing.KernelTimer``: ``triton.testing.do_bench`` median, L2
cleared), ``experts_with_rows``,
``t_floor_us`` (the touched experts' weight bytes at ``read_gbps``, the rate a sum over a 2 GB
buffer reads HBM at in the same run) and each time's ratio to it, ``rel_err`` (||gemv - grouped_mm|| /
||grouped_mm||). The data behind ``experts.GEMV_MAX_ROWS``.

Usage (GPU): ``python benchmarks/bench_gemv.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe_sbo.experts import RoutedExperts
from moe_sbo.measure.results import result_meta
from moe_sbo.measure.timing import KernelTimer, memory_read_us

READ_PROBE_BYTES = 1 << 31  # the buffer the read rate is measured on: 2 GB, far past L2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--experts", type=int, nargs="+", default=[16])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    gbps = READ_PROBE_BYTES / memory_read_us(READ_PROBE_BYTES, device) / 1e3
    timer = KernelTimer(device, quick=False)
    rows = []
    for num_experts in args.experts:
        experts = RoutedExperts(num_experts, args.hidden, args.intermediate, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            experts.gate_up_proj.normal_(std=args.hidden**-0.5)
            experts.down_proj.normal_(std=args.intermediate**-0.5)
        expert_bytes = 3 * args.hidden * args.intermediate * 2
        for num_rows in args.rows:
            generator = torch.Generator().manual_seed(num_rows)
            counts = torch.bincount(torch.randint(num_experts, (num_rows,), generator=generator), minlength=num_experts)
            counts_dev = counts.cuda()
            x = torch.randn(num_rows, args.hidden, dtype=torch.bfloat16, device="cuda")
            times, outs = {}, {}
            for kernels in ("triton", "torch"):
                experts.kernels = kernels

                def forward():
                    return experts(x, counts_dev)

                with torch.no_grad():
                    outs[kernels] = forward()
                    times[kernels] = timer(forward)
            touched = int((counts > 0).sum())
            floor_us = touched * expert_bytes / (gbps * 1e9) * 1e6
            ref = outs["torch"].float()
            row = {
                "bench": "gemv",
                "experts": num_experts,
                "rows": num_rows,
                "experts_with_rows": touched,
                "t_gemv_us": times["triton"],
                "t_grouped_mm_us": times["torch"],
                "t_floor_us": floor_us,
                "read_gbps": gbps,
                "gemv_floor_ratio": times["triton"] / floor_us,
                "grouped_mm_floor_ratio": times["torch"] / floor_us,
                "speedup": times["torch"] / times["triton"],
                "rel_err": ((outs["triton"].float() - ref).norm() / ref.norm()).item(),
            }
            rows.append(row)
            print(row, flush=True)
    meta = result_meta("cuda", 1)
    (args.out / "gemv.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

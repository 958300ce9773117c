"""Why contention eats the overlap, on one GPU: the shared-expert GEMMs beside a communication-like kernel.

NCCL moves data with a few CTAs per channel (one SM each) that read and write HBM; an NVLink
all-to-all cannot be run on one GPU, but its footprint on the GPU can: a persistent Triton copy
kernel on ``--ctas`` CTAs streaming ``--copy-mb`` through HBM. Beside it, the DeepSeek-V3 shared
expert (4096 tokens, H 7168, S 2048 in bf16) on another stream. Measured in one run:

- each alone; then both at once with the GEMM launched first, the copy launched first, and the GEMM
  launched first under a cuBLAS SM carve-out that leaves the copy its CTAs (``moe_sbo.streams.sm_budget``);
- the same with the copy done by the copy engines (``cudaMemcpyAsync`` device to device: no SMs);
- per pair: ``efficiency = (t_a + t_b - t_both) / min(t_a, t_b)`` (1.0: the shorter fully hidden).

Usage (GPU): ``python benchmarks/probe_contention.py --out DIR``. Writes ``DIR/contention.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_sbo.experts import SharedExperts
from moe_sbo.measure.results import result_meta
from moe_sbo.streams import sm_budget, sm_count


@triton.jit
def _persistent_copy(src, dst, n, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def sm_copy(src: torch.Tensor, dst: torch.Tensor, ctas: int) -> None:
    """Copy with exactly ``ctas`` CTAs (as a NCCL channel set would), through HBM."""
    _persistent_copy[(ctas,)](src, dst, src.numel(), BLOCK=8192, num_warps=8)


def timed(run, iters: int) -> float:
    """Median µs of ``run()`` over ``iters`` calls, each from an idle GPU."""
    times = []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--copy-mb", type=int, nargs="+", default=[64, 512])
    p.add_argument("--ctas", type=int, nargs="+", default=[16, 32])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    total_sms = sm_count(device)
    shared = SharedExperts(7168, 2048, dtype=torch.bfloat16, device=device)
    torch.nn.init.normal_(shared.gate_up_proj, std=0.01)
    torch.nn.init.normal_(shared.down_proj, std=0.01)
    x = torch.randn(args.tokens, 7168, device=device, dtype=torch.bfloat16)
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    rows = []

    def both(first, second_on_side):
        """``first`` on the main stream, then ``second_on_side`` on the side stream, concurrently."""

        def run():
            side.wait_stream(main_stream)  # before either launch: the side must not wait for ``first``
            first()
            with torch.cuda.stream(side):
                second_on_side()
            main_stream.wait_stream(side)

        return run

    with torch.inference_mode():
        t_gemm = timed(lambda: shared(x), args.iters)
        for budget in (total_sms, total_sms - 16, total_sms - 32, total_sms // 2):

            def gemm_budget(budget=budget):
                with sm_budget(device, budget):
                    shared(x)

            rows.append(
                {
                    "bench": "contention",
                    "case": "gemm_alone_sm_budget",
                    "sm_budget": budget,
                    "t_us": timed(gemm_budget, args.iters),
                    "t_gemm_full_us": t_gemm,
                }
            )
        for mb in args.copy_mb:
            src = torch.empty(mb * 2**20 // 2, dtype=torch.bfloat16, device=device).normal_()
            dst = torch.empty_like(src)
            transports = {f"sm_copy_{c}ctas": (lambda c=c: sm_copy(src, dst, c)) for c in args.ctas}
            transports["copy_engine"] = lambda: dst.copy_(src)
            for name, copy in transports.items():
                t_copy = timed(copy, args.iters)
                budget = (
                    total_sms - int(name.split("_")[2].removesuffix("ctas")) if name.startswith("sm_copy") else None
                )

                def gemm_budget(budget=budget):
                    with sm_budget(device, budget):
                        shared(x)

                cases = {
                    "gemm_first": both(lambda: shared(x), copy),
                    "copy_first": both(copy, lambda: shared(x)),
                    "gemm_first_sm_budget": both(gemm_budget, copy),
                }

                for order, run in cases.items():
                    if order.endswith("sm_budget") and budget is None:
                        continue
                    t_both = timed(run, args.iters)
                    hidden = min(t_gemm, t_copy)
                    rows.append(
                        {
                            "bench": "contention",
                            "case": "gemm_beside_copy",
                            "transport": name,
                            "copy_MB": mb,
                            "order": order,
                            "sm_budget": budget if "budget" in order else None,
                            "tokens": args.tokens,
                            "t_gemm_us": t_gemm,
                            "t_copy_us": t_copy,
                            "t_both_us": t_both,
                            "t_sequential_us": t_gemm + t_copy,
                            "t_ideal_us": max(t_gemm, t_copy),
                            "copy_GBps": mb * 2**20 / t_copy / 1e3,
                            "efficiency": (t_gemm + t_copy - t_both) / hidden,
                        }
                    )
            del src, dst
    meta = result_meta("cuda", 1)
    meta.update(
        sms=total_sms, gemm="DeepSeek-V3 shared expert: [T,7168]x[7168,4096] -> silu*mul -> [T,2048]x[2048,7168]"
    )
    out = Path(args.out) / "contention.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "bench"})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

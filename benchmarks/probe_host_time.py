"""Where a ``low_latency`` phase spends its host time: cProfile over the four dispatcher calls.

Every visible GPU is one rank; rank 0's profile is printed (top functions by own time) for each token
count, after warm-up, with the GPU and the ranks lined up between iterations (so the host never waits
for a full launch queue). Usage (GPU): ``python benchmarks/probe_host_time.py [--tokens 128 4096]
[--transport symm_mem]``; writes the text to ``--out`` too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.layer import MoELayer
from moe_sbo.runtime import LocalRanks


def profile_rank(device: torch.device, tokens: int, transport: str, iters: int, top: int) -> str:
    cfg = get_preset("deepseek-v3").with_num_experts(32 * dist.get_world_size())
    layer = MoELayer(
        cfg,
        dispatcher="low_latency",
        device=device,
        dispatcher_options={"max_tokens_per_rank": tokens, "transport": transport},
    )
    x = torch.randn(tokens, cfg.hidden_size, device=device).bfloat16()
    d = layer.dispatcher
    profiler = cProfile.Profile()
    walls = {"dispatch_launch": 0.0, "dispatch_wait": 0.0, "combine_launch": 0.0, "combine_wait": 0.0}
    with torch.inference_mode():
        topk = layer.router(x)
        for it in range(5 + iters):
            torch.cuda.synchronize()
            dist.barrier()
            timed = it >= 5
            if timed:
                profiler.enable()
            t0 = time.perf_counter()
            pending = d.dispatch_launch(x, topk.topk_ids_TK, topk.topk_weights_TK)
            t1 = time.perf_counter()
            recv = d.dispatch_wait(pending)
            t2 = time.perf_counter()
            if timed:
                profiler.disable()
            y = layer.experts(recv.expert_x_RH, recv.num_rows_per_expert_L)
            if timed:
                profiler.enable()
            t3 = time.perf_counter()
            pending = d.combine_launch(y, recv.handle)
            t4 = time.perf_counter()
            d.combine_wait(pending)
            t5 = time.perf_counter()
            if timed:
                profiler.disable()
                for key, a, b in (
                    ("dispatch_launch", t0, t1),
                    ("dispatch_wait", t1, t2),
                    ("combine_launch", t3, t4),
                    ("combine_wait", t4, t5),
                ):
                    walls[key] += (b - a) * 1e6 / iters
    text = io.StringIO()
    text.write(
        f"-- {transport}, {tokens} tokens, EP{dist.get_world_size()}: host µs per call (mean) "
        + ", ".join(f"{k} {v:.0f}" for k, v in walls.items())
        + "\n"
    )
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--transport", default="symm_mem")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    texts = []
    with LocalRanks(torch.cuda.device_count(), device="cuda") as ranks:
        for tokens in args.tokens:
            texts.append(ranks.run(profile_rank, tokens, args.transport, args.iters, args.top)[0])
    print("\n".join(texts))
    if args.out:
        Path(args.out).write_text("\n".join(texts))


if __name__ == "__main__":
    main()

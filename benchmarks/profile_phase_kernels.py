"""Which kernels a low_latency dispatch and combine spend their GPU time in (every visible GPU one
rank, eager, profiler; rank 0's view).

Usage (GPU): ``python benchmarks/profile_phase_kernels.py --tokens 128 [--experts 8] [--kernels torch]
[--transport symm_mem]``. Prints the kernels of one dispatch and one combine by total CUDA time, and
the sum of kernel times per phase (the transfer's kernel included: NCCL's, or the barrier's).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer


def profile_rank(device: torch.device, tokens: int, experts: int, fp8: bool, kernels: str, transport: str) -> str:
    cfg = get_preset("deepseek-v3").replace(num_experts=experts * dist.get_world_size(), n_group=4, topk_group=4)
    layer = MoELayer(
        cfg,
        dispatcher="low_latency",
        device=device,
        dispatcher_options={"max_tokens_per_rank": tokens, "fp8": fp8, "kernels": kernels, "transport": transport},
    )
    x = torch.randn(tokens, cfg.hidden_size, device=device).bfloat16()
    out = [f"-- {kernels}/{transport}, {'fp8' if fp8 else 'bf16'}, {tokens} tokens, EP{dist.get_world_size()}"]
    with torch.inference_mode():
        topk = layer.router(x)
        d = layer.dispatcher
        for _ in range(3):
            recv = d.dispatch(x, topk.topk_ids_TK, topk.topk_weights_TK)
            y = layer.experts.forward_dispatched(recv)
            d.combine(y, recv.handle)
        torch.cuda.synchronize()
        for phase in ("dispatch", "combine"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                if phase == "dispatch":
                    recv = d.dispatch(x, topk.topk_ids_TK, topk.topk_weights_TK)
                else:
                    d.combine(y, recv.handle)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            total = sum(e.self_device_time_total for e in events)
            out.append(f"== {phase}: {len(events)} kernel kinds, {total:.0f} µs of kernel time")
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
                out.append(f"  {e.self_device_time_total:8.1f} µs  x{e.count:<3d} {e.key[:110]}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--experts", type=int, default=8, help="routed experts per GPU")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--transport", default="nccl", choices=["nccl", "symm_mem"])
    args = p.parse_args()
    with LocalRanks(torch.cuda.device_count(), device="cuda") as ranks:
        print(ranks.run(profile_rank, args.tokens, args.experts, args.fp8, args.kernels, args.transport)[0])


if __name__ == "__main__":
    main()

"""The DeepEP-compatible API's price: a low-latency dispatch + combine through
``moe_sbo.deep_ep.Buffer`` against moe-sbo's native ``low_latency`` dispatcher on the same shapes, in
one run: CUDA-graph replays (device time) and eager calls (host time per dispatch + combine pair).

Shapes: DeepSeek-V3's H 7168 and top-8 at ``--tokens`` per rank (128: decode), ``--experts-per-gpu``
routed experts per rank (E = that x EP). "Experts" are the identity, so both paths move and reduce the
same rows: native ``dispatch(x, ids, weights)`` -> ``combine(rows)``; compatible
``low_latency_dispatch`` -> ``low_latency_combine(..., weights)``. With fp8 the native path dequantises
on arrival (its fused layout kernel) and the compatible one hands out e4m3 rows and scales, as DeepEP
does (FP8 experts read them); its "experts" then return the first call's rows dequantised once, so the
timed calls hold the API's work alone, not a torch dequantisation of every packed row.

Two compatible paths: DeepEP's calls as written (one row per (token, choice) each way, weighted at
combine: ``compat``) and with the weights given at dispatch as well (moe-sbo's ``topk_weights``
keyword: one row per (token, rank), weighted on the experts' ranks: ``weighted``).

Rows (``bench="deep_ep"``) in ``OUT/deep_ep.json``, one per dispatch dtype: ``t_native_us`` /
``t_compat_us`` / ``t_weighted_us`` (median replay of one captured dispatch + combine, slowest rank;
the median of ``ROUNDS`` rounds that take the three steps in turn),
``replay_ratio`` and ``weighted_replay_ratio`` (target <= 1.10), ``host_*_us`` (median host time of
one eager pair, slowest rank) and ``host_delta_us`` / ``weighted_host_delta_us`` (target <= 20).
Ranks sharing a GPU (one-GPU machine) label the file ``wire: shared-gpu``: host cost and relative
device time, not wire speed.

Usage (GPU): ``moe-sbo bench deep-ep --out DIR`` (``benchmarks/run_gpu_deep_ep.sh``). CPU smoke (eager,
not a measurement): ``moe-sbo bench deep-ep --out DIR --device cpu --hidden 256 --top-k 4 --tokens 8 --iters 3``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import deep_ep
from ..dispatch import EPGroup, make_dispatcher
from ..launch.ranks import RankPool
from ..measure.results import ResultFile, result_meta
from ..measure.timing import line_up, time_fn

TARGETS = {"replay_ratio": 1.10, "host_delta_us": 20.0}
ROUNDS = 5  # interleaved measurement rounds; each figure is the median over them


def host_us(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median host time of ``fn()`` (issuing its work; the device is idle and the ranks lined up first)."""
    times = []
    for it in range(warmup + iters):
        line_up(device)
        start = time.perf_counter()
        fn()
        if it >= warmup:
            times.append((time.perf_counter() - start) * 1e6)
    line_up(device)
    return statistics.median(times)


def measure_rank(
    device, tokens: int, hidden: int, top_k: int, experts_per_gpu: int, use_fp8: bool, warmup: int, iters: int
) -> dict:
    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = experts_per_gpu * world
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=generator, device=device).bfloat16()
    scores = torch.rand(tokens, num_experts, generator=generator, device=device)
    topk_idx = scores.topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=generator, device=device)
    out = torch.empty_like(x)

    native = make_dispatcher("low_latency", num_experts, EPGroup.from_torch(), max_tokens_per_rank=tokens, fp8=use_fp8)
    buffer = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)

    def native_step() -> torch.Tensor:
        dispatched = native.dispatch(x, topk_idx, weights)
        return native.combine(dispatched.rows_RH(), dispatched.handle)

    experts_y: list[torch.Tensor] = []  # fp8: the packed rows of the first call, dequantised once

    def compat_step(dispatch_weights: torch.Tensor | None = None) -> torch.Tensor:
        recv, _, handle, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, tokens, num_experts, use_fp8=use_fp8, topk_weights=dispatch_weights
        )
        if use_fp8 and not experts_y:
            experts_y.append((recv[0].float() * recv[1].repeat_interleave(128, dim=-1)).bfloat16())
        return buffer.low_latency_combine(experts_y[0] if use_fp8 else recv, topk_idx, weights, handle, out=out)[0]

    def weighted_step() -> torch.Tensor:
        return compat_step(weights)

    graph = device.type == "cuda"
    with torch.no_grad():
        # Eager first calls allocate the buffers.
        native_y, compat_y, weighted_y = native_step(), compat_step().clone(), weighted_step()
        err = ((native_y.float() - compat_y.float()).abs().max() / native_y.float().abs().max()).item()
        weighted_err = ((native_y.float() - weighted_y.float()).abs().max() / native_y.float().abs().max()).item()
        # Interleaved rounds, each step's median over them: ranks sharing a GPU drift between rounds
        # (scheduling, clocks), and a drift that hits one step's whole measurement would skew a ratio.
        steps = {"native": native_step, "compat": compat_step, "weighted": weighted_step}
        replays: dict[str, list[float]] = {name: [] for name in steps}
        hosts: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(ROUNDS):
            for name, step in steps.items():
                replays[name].append(time_fn(step, device, warmup, iters, graph=graph))
                hosts[name].append(host_us(step, device, warmup, iters))
        row = {f"t_{name}_us": statistics.median(replays[name]) for name in steps}
        row.update({f"host_{name}_us": statistics.median(hosts[name]) for name in steps})
        row.update(rel_err_compat_vs_native=err, rel_err_weighted_vs_native=weighted_err)
    return row


def main(args: argparse.Namespace) -> int:
    world = args.ranks or max(2, torch.cuda.device_count())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = result_meta(args.device, world)
    meta.update(
        tokens_per_rank=args.tokens,
        hidden=args.hidden,
        top_k=args.top_k,
        experts_per_gpu=args.experts_per_gpu,
        warmup=args.warmup,
        iters=args.iters,
        targets=TARGETS,
        timing="replays: median of CUDA-graph replays of one dispatch + combine (measure.timing.time_fn); host: "
        "median perf_counter span of one eager pair after a line-up; each the median of 5 rounds taking the "
        "steps in turn; per row the slowest rank",
    )
    results = ResultFile(out_dir / "deep_ep.json", meta)
    pool = RankPool(world, args.device)
    started = time.perf_counter()
    try:
        for use_fp8 in (False, True):
            dtype_name = "fp8_e4m3" if use_fp8 else "bfloat16"
            common: dict[str, object] = {"bench": "deep_ep", "ep": world, "dispatch_dtype": dtype_name}

            def run(use_fp8: bool = use_fp8, common: dict = common) -> list[dict]:
                per_rank = pool.run(
                    measure_rank,
                    args.tokens,
                    args.hidden,
                    args.top_k,
                    args.experts_per_gpu,
                    use_fp8,
                    args.warmup,
                    args.iters,
                )
                row = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
                row["replay_ratio"] = row["t_compat_us"] / row["t_native_us"]
                row["host_delta_us"] = row["host_compat_us"] - row["host_native_us"]
                row["weighted_replay_ratio"] = row["t_weighted_us"] / row["t_native_us"]
                row["weighted_host_delta_us"] = row["host_weighted_us"] - row["host_native_us"]
                print(common["dispatch_dtype"], {k: round(v, 2) for k, v in row.items()}, flush=True)
                return [{**common, **row}]

            results.add_timed_step(dtype_name, run, common, started)
    finally:
        pool.close()
    return 0

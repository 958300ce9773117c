"""Prefill-size dispatch and combine, against the wire and the compute floor, in one run.

Model: DeepSeek-V3 dims (H 7168, I 2048, top-8, one shared expert) with ``--experts-per-gpu`` routed
experts per GPU (default 32, E = 32 x EP), bf16, tokens per rank 512-16384 (capacity = tokens).

Rows (``bench="prefill"``) in ``OUT/prefill.json``, per EP size and tokens per rank:

- ``dispatcher="low_latency"`` per path (``kernels`` triton; ``transport`` nccl, symm_mem,
  copy_engine; ``plan``: ``two_pass``, the prefill-size kernels, or ``one_pass``, the decode kernels
  forced, up to ``--one-pass-max`` tokens), each twice: ``graph=False`` (eager: phases from CUDA events
  at the dispatcher's hooks, ranks lined up before each forward; ``host_*_us`` the host's own time in
  each call; ``t_layer_b2b_us`` the mean of forwards issued back to back, as in a model, where the
  host runs ahead of the GPU) and ``graph=True``
  (dispatch alone, combine alone, the layer: three CUDA graphs replayed; and each phase's transfer
  alone, ``t_*_transfer_us``: launch, then wait for the transfer, without the receiver's expert-major
  layout or the final sum);
- ``dispatcher="alltoall"``: the variable-size dispatcher (eager only: it reads sizes on the host).

Every row carries ``ref_t_dispatch_us`` / ``ref_t_combine_us``: graph-replayed raw NCCL
``all_to_all_single`` of the same bytes, measured in the same run (``t_wire_us`` their sum), their
ratios ``dispatch_overhead`` / ``combine_overhead``, and the compute floor ``t_floor_us`` = router +
routed experts (grouped GEMM on the rows this rank received) + shared experts, each timed alone on
the same tokens (replayed from CUDA graphs on GPUs), with ``floor_ratio`` = ``t_layer_us /
t_floor_us``. Times are the slowest rank's medians. ``--plot`` draws dispatch and combine GB/s against tokens per path.

Usage (GPU): ``moe-sbo bench prefill --out DIR [--plot DIR/prefill.png]``. CPU smoke:
``moe-sbo bench prefill --out DIR --device cpu --quick --hidden-size 256 --experts-per-gpu 4
--tokens 8 16``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..dispatch.low_latency import LowLatencyDispatcher, RowFormat, kernels
from ..launch.ranks import RankPool
from ..layer import MoELayer
from ..measure.results import ResultFile, result_meta
from ..measure.timing import DISPATCHER_CALLS, dispatcher_call_host_us, line_up, time_fn, time_layer
from .ep_sweep import EpSweep
from .low_latency import (
    EAGER_SPANS,
    baseline_rank,
    bench_config,
    capture,
    low_latency_layer,
    raw_all_to_all,
    row_labels,
    summarise,
    time_back_to_back,
    time_graphs,
)
from .sweep import wire_label

TARGETS = {"tokens_per_rank": 4096, "phase_vs_wire": 1.2, "floor_ratio": 1.10}


def host_phase_us(layer: MoELayer, x_TH: torch.Tensor, iters: int) -> dict[str, float]:
    """Median host µs spent inside each of the four dispatcher calls, ranks lined up before each
    forward (the GPU is not waited for: this is what the host adds per phase, the part no overlap can
    hide)."""
    spans: dict[str, list[float]] = {k: [] for k in DISPATCHER_CALLS}
    for _ in range(iters):
        line_up(x_TH.device)
        for key, us in dispatcher_call_host_us(layer, x_TH).items():
            spans[key].append(us)
    return {f"host_{k}_us": statistics.median(v) for k, v in spans.items()}


def floor_us(layer: MoELayer, x_TH: torch.Tensor, warmup: int, iters: int) -> dict[str, float]:
    """Router, routed experts (on the rows a real dispatch brought here) and shared experts, each timed
    alone: the compute a perfect dispatcher and perfect overlap would leave."""
    device = x_TH.device
    topk = layer.router(x_TH)
    recv = layer.dispatcher.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
    # Replayed from CUDA graphs where there is a GPU: the parts' own GPU time, without launch gaps.
    graph = device.type == "cuda"
    t_route = time_fn(lambda: layer.router(x_TH), device, warmup, iters, graph=graph)
    t_routed = time_fn(lambda: layer.experts.forward_dispatched(recv), device, warmup, iters, graph=graph)
    shared = layer.shared_experts
    t_shared = time_fn(lambda: shared(x_TH), device, warmup, iters, graph=graph) if shared is not None else 0.0
    layer.dispatcher.combine(layer.experts.forward_dispatched(recv), recv.handle)  # close the round it opened
    return {
        "t_floor_route_us": t_route,
        "t_floor_routed_us": t_routed,
        "t_floor_shared_us": t_shared,
        "t_floor_us": t_route + t_routed + t_shared,
    }


def transfer_us(layer: MoELayer, x_TH: torch.Tensor, warmup: int, iters: int) -> dict[str, float]:
    """Each phase's transfer alone, replayed from CUDA graphs: launch, then wait for the transfer's
    works, without the receiver's expert-major layout (dispatch) or the final sum (combine)."""
    d, device = layer.dispatcher, x_TH.device
    topk = layer.router(x_TH)

    def dispatch_transfer() -> None:
        d.dispatch_launch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK).wait()

    recv = d.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
    expert_y_RH = layer.experts.forward_dispatched(recv)

    def combine_transfer() -> None:
        d.combine_launch(expert_y_RH, recv.handle).wait()

    # Combine first: its handle's buffers stay valid only until num_buffers more dispatches start.
    replay_combine, _ = capture(combine_transfer, device)
    t_combine = time_fn(replay_combine, device, warmup, iters, graph=False)
    replay_dispatch, _ = capture(dispatch_transfer, device)
    t_dispatch = time_fn(replay_dispatch, device, warmup, iters, graph=False)
    return {"t_dispatch_transfer_us": t_dispatch, "t_combine_transfer_us": t_combine}


def prefill_rank(
    device: torch.device,
    cfg: MoEConfig,
    tokens_list: list[int],
    transports: list[str],
    one_pass_max: int,
    warmup: int,
    iters: int,
    seed: int,
    direct_launches: bool = True,
) -> list[dict]:
    """One rank's low_latency rows at prefill sizes, every path, eager and replayed; with
    ``direct_launches`` also the first transport's eager rows with ``index_graphs=False``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    with torch.inference_mode():
        for tokens in tokens_list:
            generator = torch.Generator(device=device).manual_seed(seed * 7919 + rank * 131 + tokens)
            x_TH = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(dtype)
            fmt = RowFormat.make(cfg.hidden_size, cfg.num_experts_per_tok, dtype, False)
            refs = {}
            if world > 1:
                ref_dispatch, _ = capture(raw_all_to_all(tokens * fmt.row_bytes, device), device)
                ref_combine, _ = capture(raw_all_to_all(tokens * cfg.hidden_size * dtype.itemsize, device), device)
                refs = {
                    "ref_t_dispatch_us": time_fn(ref_dispatch, device, warmup, iters, graph=False),
                    "ref_t_combine_us": time_fn(ref_combine, device, warmup, iters, graph=False),
                }
                del ref_dispatch, ref_combine
            plans = [("two_pass", t, True) for t in transports]
            if tokens <= one_pass_max:
                plans.append(("one_pass", transports[0], True))
            if direct_launches:
                plans.append(("two_pass", transports[0], False))
            floor: dict[str, float] = {}
            for plan, transport, index_graphs in plans:
                previous = kernels.TWO_PASS_MIN_CAPACITY
                kernels.TWO_PASS_MIN_CAPACITY = 1 if plan == "two_pass" else tokens + 1
                try:
                    options = {"max_tokens_per_rank": tokens, "transport": transport, "index_graphs": index_graphs}
                    layer = low_latency_layer(cfg, dtype, device, seed, options)
                    if not floor:
                        floor = floor_us(layer, x_TH, warmup, iters)
                    fused = cast(LowLatencyDispatcher, layer.dispatcher).uses_triton(device)
                    common = {
                        "rank": rank,
                        "tokens": tokens,
                        "capacity": tokens,
                        "transport": transport,
                        "plan": plan,
                        "kernels": "triton" if fused else "torch",
                        "index_graphs": index_graphs and fused,
                        "dispatch_dtype": str(dtype).removeprefix("torch."),
                        **refs,
                        **floor,
                    }
                    eager = time_layer(layer, x_TH, warmup, iters)
                    common.update(dataclasses.asdict(layer.last_traffic))  # the four byte counts
                    host = host_phase_us(layer, x_TH, iters)
                    # Forwards issued back to back, as in a model (the host runs ahead of the GPU).
                    b2b = time_back_to_back(partial(layer, x_TH), device, iters)
                    eager_row = {**common, "graph": False, **{k: eager[k] for k in EAGER_SPANS}, **host}
                    rows.append({**eager_row, "t_layer_b2b_us": b2b})
                    if cuda and index_graphs:  # a caller's capture bypasses index_graphs: once per path
                        graphs = {**time_graphs(layer, x_TH, warmup, iters), **transfer_us(layer, x_TH, warmup, iters)}
                        rows.append({**common, "graph": True, **graphs})
                finally:
                    kernels.TWO_PASS_MIN_CAPACITY = previous
                del layer
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
    return rows


def finish(rows: list[dict], per_rank: list[list[dict]], wire: str) -> list[dict]:
    """``summarise``'s rows plus what this benchmark adds: plan, floor, wire (``wire``: the link's
    label, ``wire_label``) and host times."""
    for row, rank_rows in zip(rows, zip(*per_rank)):
        first = rank_rows[0]
        row["bench"] = "prefill"
        row["wire"] = wire
        for key in ("plan", "index_graphs"):
            if key in first:
                row[key] = first[key]
        for key in first:
            if key.startswith(("host_", "t_floor")) or key.endswith("_transfer_us"):
                row[key] = max(r[key] for r in rank_rows)
        for phase in ("dispatch", "combine"):
            if row.get(f"t_{phase}_transfer_us") and row.get(f"ref_t_{phase}_us"):
                row[f"{phase}_transfer_overhead"] = row[f"t_{phase}_transfer_us"] / row[f"ref_t_{phase}_us"]
        if row.get("ref_t_dispatch_us") is not None:
            row["t_wire_us"] = row["ref_t_dispatch_us"] + row["ref_t_combine_us"]
        if row.get("t_floor_us") and row.get("t_layer_us"):
            row["floor_ratio"] = row["t_layer_us"] / row["t_floor_us"]
            if row.get("t_layer_b2b_us"):
                row["floor_ratio_b2b"] = row["t_layer_b2b_us"] / row["t_floor_us"]
        if row.get("t_dispatch_us") and row.get("dispatch_bytes_sent"):
            row["dispatch_GBps"] = row["dispatch_bytes_sent"] / row["t_dispatch_us"] / 1e3
            row["combine_GBps"] = row["combine_bytes_sent"] / row["t_combine_us"] / 1e3
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Dispatch and combine GB/s (bytes sent per rank / phase time) against tokens, one line per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    lines: dict[str, list[dict]] = {}
    for row in rows:
        if "error" in row or not row.get("dispatch_GBps"):
            continue
        name = row["dispatcher"]
        if row["dispatcher"] == "low_latency":
            direct = "" if row.get("index_graphs", True) else " direct"
            name = f"{row['transport']} {row.get('plan', '')} {'graph' if row['graph'] else 'eager'}{direct}"
        lines.setdefault(name, []).append(row)
    for ax, phase in zip(axes, ("dispatch", "combine")):
        for name, group in sorted(lines.items()):
            group = sorted(group, key=lambda r: r["tokens_per_rank"])
            ax.plot(
                [r["tokens_per_rank"] for r in group],
                [r[f"{phase}_GBps"] for r in group],
                marker="o",
                label=name,
                linestyle="--" if "eager" in name or name == "alltoall" else "-",
            )
        ref = sorted(
            (r for r in rows if r.get("ref_t_dispatch_us") and r.get("dispatch_GBps")),
            key=lambda r: r["tokens_per_rank"],
        )
        by_tokens = {r["tokens_per_rank"]: r for r in ref}
        ax.plot(
            list(by_tokens),
            [r[f"{phase}_bytes_sent"] / r[f"ref_t_{phase}_us"] / 1e3 for r in by_tokens.values()],
            color="black",
            linewidth=2,
            label="raw NCCL all_to_all (graph)",
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_title(phase)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s sent per rank")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench prefill``: per EP size the low_latency paths, then the baselines; 1 if a step failed."""
    sweep = EpSweep.from_args(args, args.tokens)  # bad input raises here, before any rank starts
    device, warmup, iters, ep_sizes = sweep.device, sweep.warmup, sweep.iters, sweep.ep_sizes
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = result_meta(device, max(ep_sizes))
    meta.update(
        preset=args.preset,
        experts_per_gpu=args.experts_per_gpu,
        tokens_per_rank=args.tokens,
        warmup=warmup,
        iters=iters,
        targets=TARGETS,
        timing="eager: CUDA events at the dispatcher's hooks, host_*_us host time inside each call; graph: "
        "CUDA-graph replays; raw NCCL all_to_all_single graph-replayed on the same bytes; ranks lined up "
        "before every timed call; per-rank medians, slowest rank",
    )
    results = ResultFile(out_dir / "prefill.json", meta)
    started = time.perf_counter()
    for p in ep_sizes:
        cfg = bench_config(args.preset, args.experts_per_gpu, p, args.hidden_size)
        common = row_labels(args, cfg, device)
        transports = [t for t in args.transports if t == "nccl" or (device == "cuda" and p > 1)]
        pool = RankPool(p, device)
        jobs: list[tuple[str, Callable, tuple]] = [
            (
                "low_latency",
                prefill_rank,
                (cfg, args.tokens, transports, args.one_pass_max, warmup, iters, args.seed, args.direct_launches),
            )
        ]
        jobs += [(name, baseline_rank, (cfg, name, args.tokens, warmup, iters, args.seed)) for name in args.baselines]
        try:
            for name, fn, fn_args in jobs:

                def step(fn=fn, fn_args=fn_args, name=name) -> list[dict]:
                    per_rank = pool.run(fn, *fn_args)
                    return finish(summarise(per_rank, common, name), per_rank, wire_label(device, p))

                results.add_timed_step(
                    f"ep={p} {name}", step, {"bench": "prefill", **common, "ep": p, "dispatcher": name}, started
                )
        finally:
            pool.close()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    results.save()
    if args.plot:
        plot(results.rows, Path(args.plot))
    for row in results.rows:
        if "error" in row:
            continue
        print(
            f"{row['dispatcher']:11s} {row.get('transport') or '':11s} {row.get('plan') or '':8s} "
            f"{'' if row.get('index_graphs', True) else 'no-ig':5s} "
            f"{'graph' if row['graph'] else 'eager'} T={row['tokens_per_rank']:6d} "
            f"dispatch {row['t_dispatch_us']:8.0f} ({row.get('dispatch_overhead') or 0:.2f}x wire) "
            f"combine {row['t_combine_us']:8.0f} ({row.get('combine_overhead') or 0:.2f}x) "
            f"layer {row.get('t_layer_us') or 0:8.0f} floor {row.get('t_floor_us') or 0:8.0f} "
            f"b2b {row.get('floor_ratio_b2b') or 0:.2f}x "
            f"({row.get('floor_ratio') or 0:.2f}x) host d {row.get('host_dispatch_launch_us') or 0:.0f}"
            f"+{row.get('host_dispatch_wait_us') or 0:.0f} c {row.get('host_combine_launch_us') or 0:.0f}"
            f"+{row.get('host_combine_wait_us') or 0:.0f}"
        )
    return 1 if results.errors else 0

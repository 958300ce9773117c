"""``moe-sbo bench``: the sweep's command line. Without ``--tbo`` every dispatcher × overlap mode ×
token count (``bench_sbo.py``); with ``--tbo`` the decoder layer with and without two-batch overlap
(``bench_tbo.py``). Each step runs on every rank of one pool; its rows land in the result file as soon
as it ends.

The hard part is failing early: every option is checked on the launching process before any rank
starts, and a step that fails on one rank becomes an error row, not the end of the sweep.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.progress import Progress

from ..config import PRESETS, get_preset
from ..dispatch import DISPATCHERS
from ..measure.results import ResultFile, result_meta
from ..measure.trace import Span, plot_timeline, save_spans
from ..model.attention import AttentionConfig
from ..overlap import OVERLAP_MODES, make_overlap
from ..runtime import RankPool, default_world_size, resolve_device
from .bench_common import bench_config
from .bench_sbo import sbo_bench_rank, sbo_table, summarise, timeline_rank
from .bench_tbo import summarise_tbo, tbo_bench_rank, tbo_table, tbo_timeline_rank
from .options import default_dtype_name, make_console

DEFAULT_TOKENS = (128, 512, 2048, 4096, 8192)


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="overlap modes x dispatchers x token counts on N ranks (GPU)")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=None,
        help="routed experts in total, one sweep each (default: the preset's; label: experts per GPU)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS), help="tokens per rank")
    p.add_argument("--dispatcher", nargs="+", default=["all"], help=f"among {sorted(DISPATCHERS)}, or all")
    p.add_argument("--overlap", nargs="+", default=["all"], help=f"among {list(OVERLAP_MODES)}, or all")
    p.add_argument("--ranks", type=int, default=None, help="EP size (default: every GPU; 2 on CPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--sm-budget", type=int, default=None, help="SMs for the shared experts in combine_sm")
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl", "symm_mem", "copy_engine"],
        help="low_latency's transport (auto: symmetric memory on CUDA from 2 GPUs, else NCCL; copy_engine: "
        "peer copies, no SMs in flight)",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph rows")
    p.add_argument("--graph-max-tokens", type=int, default=512, help="largest tokens/rank timed as graph replays")
    p.add_argument("--out", default=None, help="JSON file for {meta, rows}")
    p.add_argument("--timeline", default=None, metavar="PNG", help="draw one forward per mode at --timeline-tokens")
    p.add_argument("--timeline-tokens", type=int, default=None, help="default: largest of --tokens up to 4096")
    p.add_argument("--trace", default=None, metavar="PREFIX", help="also keep Chrome traces PREFIX.<mode>.json")
    p.add_argument("--seed", type=int, default=0)
    tbo = p.add_argument_group("two-batch overlap (--tbo): a decoder layer, attention + MoE")
    tbo.add_argument("--tbo", action="store_true", help="bench the decoder layer without and with TBO")
    tbo.add_argument("--prefill-tokens", type=int, nargs="*", default=[4096, 8192], help="prefill tokens per rank")
    tbo.add_argument("--decode-seqs", type=int, nargs="*", default=[32, 64, 128, 256], help="decode sequences per rank")
    tbo.add_argument("--kv-len", type=int, default=2048, help="cached tokens per decode sequence")
    tbo.add_argument("--heads", type=int, default=128)
    tbo.add_argument("--kv-heads", type=int, default=8, help="GQA key/value heads (8: about MLA's cache footprint)")
    tbo.add_argument("--head-dim", type=int, default=128)
    tbo.add_argument(
        "--delay",
        type=int,
        nargs="+",
        default=[0, 1],
        help="stages micro-batch A runs before B starts; one TBO row per value",
    )


def run_bench(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    ranks = args.ranks or (default_world_size(device) if device == "cuda" else 2)
    dispatchers = _choose(args.dispatcher, sorted(DISPATCHERS), "--dispatcher")
    if ranks > 1 and args.dispatcher == ["all"]:
        dispatchers = [d for d in dispatchers if d != "local"]
    modes = _choose(args.overlap, list(OVERLAP_MODES), "--overlap")
    if args.tbo and args.overlap == ["all"]:
        modes = [m for m in modes if m != "auto"]  # auto explores per micro-batch size: give it its own run
    if "none" not in modes:
        modes = ["none", *modes]  # efficiency and speedups are measured against none
    experts_list = args.experts or [get_preset(args.preset).num_experts]
    for n in experts_list:
        bench_config(args.preset, n).experts_per_rank(ranks)  # bad sizes raise before any rank starts
    sizes = [*args.tokens, *args.prefill_tokens, *args.decode_seqs]
    if min(sizes) < 1 or args.iters < 1 or args.warmup < 0 or min(args.delay) < 0:
        raise ValueError(
            f"--tokens, --prefill-tokens and --decode-seqs must be >= 1, --iters >= 1, --warmup >= 0 "
            f"and --delay >= 0; got {sizes}, {args.iters}, {args.warmup}, {args.delay}"
        )
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(f"--ranks must be <= the {torch.cuda.device_count()} visible GPUs, got {ranks}")
    make_overlap("combine_sm", device, sm_budget=args.sm_budget)  # checks the SM budget here, once
    if args.transport in ("symm_mem", "copy_engine") and (device != "cuda" or ranks < 2):
        raise ValueError(
            f"--transport {args.transport} needs CUDA and >= 2 ranks, got {device} with {ranks}; "
            "use --transport auto or nccl"
        )
    if args.tbo:
        AttentionConfig(get_preset(args.preset).hidden_size, args.heads, args.kv_heads, args.head_dim)  # checks heads
    dtype = args.dtype or default_dtype_name(device)
    console = make_console()
    meta = result_meta(device=device, world_size=ranks)
    meta.update(
        preset=args.preset,
        warmup=args.warmup,
        iters=args.iters,
        sm_budget=args.sm_budget,
        timing="median of CUDA events (host clock on CPU); ranks lined up between forwards; "
        "times are the slowest rank's",
    )
    results = ResultFile(Path(args.out) if args.out else None, meta)
    steps = _steps(args, experts_list, dispatchers, modes, dtype, ranks)
    pool = RankPool(ranks, device)
    started = time.perf_counter()
    try:
        with Progress(console=console, transient=False) as progress:
            task = progress.add_task("sweep", total=len(steps))
            for label, fn, fn_args, summarise_fn in steps:
                progress.update(task, description=label)
                failure = results.add_step(
                    lambda: summarise_fn(pool.run(fn, *fn_args)), {"bench": "tbo" if args.tbo else "sbo", "step": label}
                )
                if failure:
                    console.print(f"[red]{label} failed[/]: {failure[-1500:]}")
                progress.advance(task)
        if args.timeline or args.trace:
            _timeline(args, pool, experts_list[0], dispatchers, modes, dtype, ranks, device, console)
    finally:
        pool.close()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    results.save()
    if args.tbo:
        console.print(tbo_table(results.rows))
    else:
        console.print(sbo_table(results.rows))
    if results.path:
        console.print(f"rows written to {results.path}")
    return 1 if results.errors else 0


def _steps(args, experts_list, dispatchers, modes, dtype, ranks) -> list[tuple]:
    """(label, rank function, its arguments, summariser) for every point of the sweep."""
    steps: list[tuple] = []
    if not args.tbo:
        for n, d, t in ((n, d, t) for n in experts_list for d in dispatchers for t in args.tokens):
            spec = _spec(args, n, d, modes, dtype)
            steps.append(
                (
                    f"E={n} {d} T={t}",
                    sbo_bench_rank,
                    (spec, t),
                    lambda per_rank, spec=spec: summarise(per_rank, spec, ranks),
                )
            )
        return steps
    sizes = [("prefill", t) for t in args.prefill_tokens] + [("decode", b) for b in args.decode_seqs]
    for n, d, (regime, size) in ((n, d, s) for n in experts_list for d in dispatchers for s in sizes):
        spec = _spec(args, n, d, modes, dtype)
        steps.append(
            (
                f"E={n} {d} {regime} {size}",
                tbo_bench_rank,
                (spec, regime, size),
                lambda per_rank, spec=spec: summarise_tbo(per_rank, spec, ranks),
            )
        )
    return steps


def _timeline(args, pool, num_experts, dispatchers, modes, dtype, ranks, device, console) -> None:
    """Profile one forward per mode (SBO) or without/with TBO, draw the lanes, keep the traces."""
    spans = {}
    if args.tbo:
        regime, size = ("prefill", args.prefill_tokens[0]) if args.prefill_tokens else ("decode", args.decode_seqs[-1])
        for dispatcher in dispatchers:
            spec = _spec(args, num_experts, dispatcher, modes, dtype)
            per_case = pool.run(tbo_timeline_rank, spec, regime, size, args.trace)[0]
            spans.update({f"{dispatcher} / {case}": s for case, s in per_case.items()})
        title = f"{args.preset} decoder layer, EP{ranks}, {regime} {size}/rank, {device}"
    else:
        size = args.timeline_tokens or max([t for t in args.tokens if t <= 4096] or [min(args.tokens)])
        for dispatcher in dispatchers:
            spec = _spec(args, num_experts, dispatcher, modes, dtype)
            per_mode = pool.run(timeline_rank, spec, size, args.trace)[0]
            spans.update({f"{dispatcher} / {mode}": s for mode, s in per_mode.items()})
        title = f"{args.preset}, EP{ranks}, {size} tokens/rank, {device}"
    if args.timeline:
        spans = {k: [Span(**s) for s in v] for k, v in spans.items()}
        save_spans(spans, Path(args.timeline).with_suffix(".spans.json"))
        plot_timeline(spans, args.timeline, title=title)
        console.print(f"timeline: {args.timeline}")


def _spec(args, num_experts, dispatcher, modes, dtype) -> dict:
    return {
        "preset": args.preset,
        "num_experts": num_experts,
        "dispatcher": dispatcher,
        "modes": list(modes),
        "dtype": dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "seed": args.seed,
        "graph": not args.no_graph,
        "graph_max_tokens": args.graph_max_tokens,
        "sm_budget": args.sm_budget,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "kv_len": args.kv_len,
        "delays": list(dict.fromkeys(args.delay)),
        "transport": args.transport,
    }


def _choose(values: list[str], allowed: list[str], flag: str) -> list[str]:
    if values == ["all"]:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{flag} must be among {allowed} or all, got {bad}")
    return list(dict.fromkeys(values))

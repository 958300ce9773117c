"""``moe-sbo bench``: single-batch overlap measured — every dispatcher × every overlap mode × token count.

For each (expert count, dispatcher, tokens per rank), on every rank of the EP group:

- ``t_shared_us``: the shared experts alone on the same tokens;
- ``t_comm_us``: dispatch + combine alone (the routed experts skipped: outputs = inputs);
- per overlap mode: the layer's median time and its phases (CUDA events recorded by dispatcher hooks,
  no sync inside a forward), and for decode sizes (<= ``--graph-max-tokens``) with a dispatcher that
  can be captured, the median of CUDA-graph replays as a second row (``graph: true``).

Per-rank medians become one row per mode: times are the slowest rank's. In each group,
``efficiency = (t_none - t_mode) / min(t_shared, t_comm)`` (1.0: the shorter side fully hidden),
``speedup_vs_none = t_none / t_mode`` and ``t_ideal_us = t_none - min(t_shared, t_comm)`` (the layer
time if the overlap were perfect and free). ``--timeline`` profiles one forward per mode at one size
and draws one lane per CUDA stream (``moe_sbo.trace``); ``--trace`` keeps the Chrome traces.

The hard part is comparing modes fairly: every mode runs on the same layer object (same weights),
the same input and the same ranks, interleaved in one run, and ``auto`` is given its exploration
forwards before it is timed, so its row is what it settled on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .attention import AttentionConfig
from .config import PRESETS, get_preset
from .dispatch import DISPATCHERS, dispatcher_option_names, options_for_tokens
from .layer import MoELayer
from .overlap import OVERLAP_MODES, AutoOverlap, make_overlap
from .overlap.sbo import bucket_of
from .timing import SPANS, line_up, time_fn, time_layer
from .trace import spans_from_trace

DEFAULT_TOKENS = (128, 512, 2048, 4096, 8192)
# Span of time_layer that is the shared experts only in mode none; in other modes it is the final add.
_PHASE_SPANS = tuple(name for name, _, _ in SPANS if name != "t_shared_us")


def _cfg(preset: str, num_experts: int | None):
    cfg = get_preset(preset)
    if num_experts and num_experts != cfg.num_experts:
        cfg = cfg.with_num_experts(num_experts).replace(name=f"{cfg.name}-e{num_experts}")
    return cfg


_CACHED: dict[tuple, object] = {}


def cached(key: tuple, make: Callable[[], object], device: torch.device):
    """The rank's object for ``key``, kept between calls (weights are costly to make); only the last
    one is kept, so sweeping over setups does not accumulate GPU memory."""
    if key not in _CACHED:
        _CACHED.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _CACHED[key] = make()
    return _CACHED[key]


def dispatcher_options(spec: dict, tokens: int) -> dict:
    """Options for ``spec``'s dispatcher: its capacity sized for ``tokens`` and ``--transport``, where
    the dispatcher takes them (``low_latency``)."""
    options = options_for_tokens(spec["dispatcher"], tokens)
    if "transport" in dispatcher_option_names(spec["dispatcher"]):
        options["transport"] = spec["transport"]
    return options


def row_head(bench: str, spec: dict, ep: int) -> dict:
    """The fields every SBO and TBO row opens with: the setup it measured."""
    cfg = _cfg(spec["preset"], spec["num_experts"])
    # transport: what --transport asked of a dispatcher that takes one (low_latency), else None.
    transport = spec["transport"] if "transport" in dispatcher_option_names(spec["dispatcher"]) else None
    return {"bench": bench, "preset": spec["preset"], "ep": ep, "num_experts": cfg.num_experts,
            "experts_per_gpu": cfg.num_experts // ep, "dispatcher": spec["dispatcher"], "transport": transport,
            "dtype": spec["dtype"]}


def _layer(device: torch.device, spec: dict, tokens: int) -> MoELayer:
    """The rank's layer for ``spec`` (its capacity sized for ``tokens`` where the dispatcher has one)."""
    options = dispatcher_options(spec, tokens)
    key = ("moe", spec["preset"], spec["num_experts"], spec["dispatcher"], spec["dtype"], spec["seed"],
           tuple(sorted(options.items())))
    return cached(key, lambda: MoELayer(_cfg(spec["preset"], spec["num_experts"]), dispatcher=spec["dispatcher"],
                                        dtype=getattr(torch, spec["dtype"]), device=device, seed=spec["seed"],
                                        dispatcher_options=options), device)


def sbo_bench_rank(device: torch.device, spec: dict, tokens: int) -> list[dict]:
    """One rank's rows for one (expert count, dispatcher, token count): every mode. Run on every rank."""
    layer = _layer(device, spec, tokens)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = getattr(torch, spec["dtype"])
    generator = torch.Generator(device=device).manual_seed(spec["seed"] * 7919 + rank * 131 + tokens)
    x_TH = torch.randn(tokens, layer.cfg.hidden_size, generator=generator, device=device).to(dtype)
    warmup, iters = spec["warmup"], spec["iters"]
    graph = (device.type == "cuda" and tokens <= spec["graph_max_tokens"] and layer.dispatcher.graph_capturable
             and spec["graph"])
    rows = []
    with torch.inference_mode():
        topk = layer.router(x_TH)

        def comm_alone() -> None:
            recv = layer.dispatcher.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
            layer.dispatcher.combine(recv.expert_x_RH, recv.handle)

        shared = layer.shared_experts
        base = {"rank": rank, "tokens": tokens}
        base["t_shared_us"] = time_fn(lambda: shared(x_TH), device, warmup, iters, False) if shared else 0.0
        base["t_comm_us"] = time_fn(comm_alone, device, warmup, iters, False)
        if graph:
            base["t_shared_graph_us"] = time_fn(lambda: shared(x_TH), device, warmup, iters, True) if shared else 0.0
            base["t_comm_graph_us"] = time_fn(comm_alone, device, warmup, iters, True)
        for mode in spec["modes"]:
            layer.overlap = make_overlap(mode, device, sm_budget=spec["sm_budget"])
            if isinstance(layer.overlap, AutoOverlap):
                explore = len(layer.overlap.candidates) * (layer.overlap.warmup + layer.overlap.trials) + 1
                for _ in range(explore):
                    line_up(device)  # as the timed forwards run: one quiet forward at a time
                    layer(x_TH)
            spans = time_layer(layer, x_TH, warmup, iters)
            row = {**base, "overlap": mode, "graph": False, **{k: spans[k] for k in _PHASE_SPANS}}
            if isinstance(layer.overlap, AutoOverlap):
                row["auto_choice"] = layer.overlap.choices.get(bucket_of(tokens), "none")
            traffic = layer.last_traffic
            row.update(bytes_sent=traffic.bytes_sent, bytes_recv=traffic.bytes_recv)
            rows.append(row)
            if graph:
                rows.append({**row, "graph": True, "t_layer_us": time_fn(lambda: layer(x_TH), device, warmup,
                                                                         iters, True),
                             "t_shared_us": base["t_shared_graph_us"], "t_comm_us": base["t_comm_graph_us"],
                             **{k: None for k in _PHASE_SPANS if k != "t_layer_us"}})
        layer.overlap = make_overlap("none", device)
    return rows


def summarise(per_rank: list[list[dict]], spec: dict, ep: int) -> list[dict]:
    """Slowest rank's times per row, then efficiency and speedup against the group's ``none`` row."""
    rows = []
    for rank_rows in zip(*per_rank):
        first = rank_rows[0]
        row = {**row_head("sbo", spec, ep), "tokens_per_rank": first["tokens"], "overlap": first["overlap"],
               "tbo": False, "graph": first["graph"]}
        for key, value in first.items():
            if key.startswith("t_") and not key.endswith("_graph_us"):
                values = [r[key] for r in rank_rows if r[key] is not None]
                row[key] = max(values) if values else None
        row["t_layer_us_per_rank"] = [round(r["t_layer_us"], 1) for r in rank_rows]
        row["bytes_sent"] = round(statistics.mean(r["bytes_sent"] for r in rank_rows))
        row["bytes_recv"] = round(statistics.mean(r["bytes_recv"] for r in rank_rows))
        if "auto_choice" in first:
            row["auto_choice"] = [r["auto_choice"] for r in rank_rows]
        rows.append(row)
    for row in rows:
        none = next(r for r in rows if r["overlap"] == "none" and r["graph"] == row["graph"])
        hideable = min(row["t_shared_us"], row["t_comm_us"])
        row["t_ideal_us"] = none["t_layer_us"] - hideable
        row["speedup_vs_none"] = none["t_layer_us"] / row["t_layer_us"]
        row["efficiency"] = (none["t_layer_us"] - row["t_layer_us"]) / hideable if hideable > 0 else None
    return rows


def profile_spans(run: Callable[[], object], device: torch.device, rank: int, trace_path: str | None) -> list[dict]:
    """Warm ``run`` up, profile one call on every rank; rank 0 returns its spans (and keeps the trace)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for _ in range(3):
        run()
    line_up(device)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if rank != 0:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or str(Path(tmp) / "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [vars(s) for s in spans_from_trace(json.load(f))]


def timeline_rank(device: torch.device, spec: dict, tokens: int, trace_prefix: str | None) -> dict:
    """Profile one forward per mode (every rank runs it; rank 0 returns its spans per mode)."""
    layer = _layer(device, spec, tokens)
    rank = dist.get_rank() if dist.is_initialized() else 0
    x_TH = torch.randn(tokens, layer.cfg.hidden_size, device=device).to(getattr(torch, spec["dtype"]))
    spans = {}
    with torch.inference_mode():
        for mode in spec["modes"]:
            if mode == "auto":
                continue  # auto runs one of the others
            layer.overlap = make_overlap(mode, device, sm_budget=spec["sm_budget"])
            spans[mode] = profile_spans(lambda: layer(x_TH), device, rank,
                                        f"{trace_prefix}.{mode}.json" if trace_prefix else None)
        layer.overlap = make_overlap("none", device)
    return spans


# ---- command line --------------------------------------------------------------------------------

def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="overlap modes x dispatchers x token counts on N ranks (GPU)")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--experts", type=int, nargs="+", default=None,
                   help="routed experts in total, one sweep each (default: the preset's; label: experts per GPU)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS), help="tokens per rank")
    p.add_argument("--dispatcher", nargs="+", default=["all"], help=f"among {sorted(DISPATCHERS)}, or all")
    p.add_argument("--overlap", nargs="+", default=["all"], help=f"among {list(OVERLAP_MODES)}, or all")
    p.add_argument("--ranks", type=int, default=None, help="EP size (default: every GPU; 2 on CPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--sm-budget", type=int, default=None, help="SMs for the shared experts in combine_sm")
    p.add_argument("--transport", default="auto", choices=["auto", "nccl", "symm_mem"],
                   help="low_latency's transport (auto: symmetric memory on CUDA from 2 GPUs, else NCCL)")
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
    tbo.add_argument("--delay", type=int, nargs="+", default=[0, 1],
                     help="stages micro-batch A runs before B starts; one TBO row per value")


def run_bench(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from .bench_meta import ResultFile, default_dtype_name, result_meta
    from .cli import make_console
    from .runtime import RankPool, default_world_size, resolve_device

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
        _cfg(args.preset, n).experts_per_rank(ranks)  # bad sizes raise before any rank starts
    sizes = [*args.tokens, *args.prefill_tokens, *args.decode_seqs]
    if min(sizes) < 1 or args.iters < 1 or args.warmup < 0 or min(args.delay) < 0:
        raise ValueError(f"--tokens, --prefill-tokens and --decode-seqs must be >= 1, --iters >= 1, --warmup >= 0 "
                         f"and --delay >= 0; got {sizes}, {args.iters}, {args.warmup}, {args.delay}")
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(f"--ranks must be <= the {torch.cuda.device_count()} visible GPUs, got {ranks}")
    make_overlap("combine_sm", device, sm_budget=args.sm_budget)  # checks the SM budget here, once
    if args.transport == "symm_mem" and (device != "cuda" or ranks < 2):
        raise ValueError(f"--transport symm_mem needs CUDA and >= 2 ranks, got {device} with {ranks}; "
                         "use --transport auto or nccl")
    if args.tbo:
        AttentionConfig(get_preset(args.preset).hidden_size, args.heads, args.kv_heads, args.head_dim)  # checks heads
    dtype = args.dtype or default_dtype_name(device)
    console = make_console()
    meta = result_meta(device=device, world_size=ranks)
    meta.update(preset=args.preset, warmup=args.warmup, iters=args.iters, sm_budget=args.sm_budget,
                timing="median of CUDA events (host clock on CPU); ranks lined up between forwards; "
                       "times are the slowest rank's")
    results = ResultFile(Path(args.out) if args.out else None, meta)
    steps = _steps(args, experts_list, dispatchers, modes, dtype, ranks)
    pool = RankPool(ranks, device)
    started = time.perf_counter()
    try:
        with Progress(console=console, transient=False) as progress:
            task = progress.add_task("sweep", total=len(steps))
            for label, fn, fn_args, summarise_fn in steps:
                progress.update(task, description=label)
                failure = results.add_step(lambda: summarise_fn(pool.run(fn, *fn_args)),
                                           {"bench": "tbo" if args.tbo else "sbo", "step": label})
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
        from .bench_tbo import tbo_table

        console.print(tbo_table(results.rows))
    else:
        console.print(_table(results.rows))
    if results.path:
        console.print(f"rows written to {results.path}")
    return 1 if results.errors else 0


def _steps(args, experts_list, dispatchers, modes, dtype, ranks) -> list[tuple]:
    """(label, rank function, its arguments, summariser) for every point of the sweep."""
    steps = []
    if not args.tbo:
        for n, d, t in ((n, d, t) for n in experts_list for d in dispatchers for t in args.tokens):
            spec = _spec(args, n, d, modes, dtype)
            steps.append((f"E={n} {d} T={t}", sbo_bench_rank, (spec, t),
                          lambda per_rank, spec=spec: summarise(per_rank, spec, ranks)))
        return steps
    from .bench_tbo import summarise_tbo, tbo_bench_rank

    sizes = [("prefill", t) for t in args.prefill_tokens] + [("decode", b) for b in args.decode_seqs]
    for n, d, (regime, size) in ((n, d, s) for n in experts_list for d in dispatchers for s in sizes):
        spec = _spec(args, n, d, modes, dtype)
        steps.append((f"E={n} {d} {regime} {size}", tbo_bench_rank, (spec, regime, size),
                      lambda per_rank, spec=spec: summarise_tbo(per_rank, spec, ranks)))
    return steps


def _timeline(args, pool, num_experts, dispatchers, modes, dtype, ranks, device, console) -> None:
    """Profile one forward per mode (SBO) or without/with TBO, draw the lanes, keep the traces."""
    from .trace import Span, plot_timeline, save_spans

    spans = {}
    if args.tbo:
        from .bench_tbo import tbo_timeline_rank

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
    return {"preset": args.preset, "num_experts": num_experts, "dispatcher": dispatcher, "modes": list(modes),
            "dtype": dtype, "warmup": args.warmup, "iters": args.iters, "seed": args.seed,
            "graph": not args.no_graph, "graph_max_tokens": args.graph_max_tokens, "sm_budget": args.sm_budget,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "kv_len": args.kv_len,
            "delays": list(dict.fromkeys(args.delay)), "transport": args.transport}


def _choose(values: list[str], allowed: list[str], flag: str) -> list[str]:
    if values == ["all"]:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{flag} must be among {allowed} or all, got {bad}")
    return list(dict.fromkeys(values))


def _table(rows: list[dict]):
    from rich.table import Table

    table = Table(title="single-batch overlap (times: slowest rank, median µs)")
    columns = [("E/GPU", "experts_per_gpu", "d"), ("tokens", "tokens_per_rank", "d"), ("dispatcher", "dispatcher", "s"),
               ("overlap", "overlap", "s"), ("graph", "graph", "s"), ("layer", "t_layer_us", ".0f"),
               ("dispatch", "t_dispatch_us", ".0f"), ("routed", "t_routed_us", ".0f"),
               ("combine", "t_combine_us", ".0f"), ("shared alone", "t_shared_us", ".0f"),
               ("comm alone", "t_comm_us", ".0f"), ("ideal", "t_ideal_us", ".0f"),
               ("× none", "speedup_vs_none", ".3f"), ("efficiency", "efficiency", ".2f")]
    for title, _, _ in columns:
        table.add_column(title, justify="left" if title in ("dispatcher", "overlap", "graph") else "right")
    for row in rows:
        if "error" in row:
            table.add_row(str(row.get("num_experts", "")), str(row.get("tokens_per_rank", "")), row["dispatcher"],
                          "[red]error[/]", *[""] * (len(columns) - 4))
            continue
        table.add_row(*("-" if row.get(key) is None else format(row[key], spec) if spec != "s" else str(row[key])
                        for _, key, spec in columns))
    return table

"""``moe-sbo bench``: the sweep's command line. Without ``--tbo`` every dispatcher × overlap mode ×
token count (``bench_sbo.py``); with ``--tbo`` the decoder layer with and without two-batch overlap
(``bench_tbo.py``); with ``--eplb`` expert load balancing on a skewed router (``bench_eplb.py``).
Each step runs on every rank of one pool; its rows land in the result file as soon as it ends.

The hard part is failing early, and only when it must: every option is checked on the launching
process before any rank starts, with a per-rank memory estimate (``memory.py``) against what the
device has; options left out take per-device defaults (``DEVICE_DEFAULTS``: a quick tiny sweep on CPU
ranks); a step that fails on one rank becomes an error row, not the end of the sweep, unless a rank
was killed or ran out of memory: then the steps after it, no smaller, are skipped and the reason said.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from ..config import get_preset
from ..decoder.attention import AttentionConfig
from ..dispatch import DISPATCHERS
from ..launch.failures import RankError
from ..launch.group import resolve_device
from ..launch.ranks import RankPool
from ..measure.results import ResultFile, result_meta, shared_gpu_note
from ..measure.trace import Span, plot_timeline, save_spans
from ..overlap import OVERLAP_MODES, make_overlap
from ..streams import check_sm_budget
from .bench_common import bench_config
from .bench_eplb import (
    FILL_FORWARDS,
    MEASURE_TOKENS,
    EplbSetup,
    eplb_bench_rank,
    eplb_notes,
    eplb_table,
    resolve_eplb,
    summarise_eplb,
)
from .bench_sbo import sbo_bench_rank, sbo_legend, sbo_table, summarise, timeline_rank
from .bench_tbo import TBO_LEGEND, summarise_tbo, tbo_bench_rank, tbo_table, tbo_timeline_rank
from .memory import check_memory, estimate_rank_bytes
from .options import (
    cpu_timing_note,
    default_dtype_name,
    in_ranks,
    make_console,
    print_notes,
    resolve_expert_dtype,
    resolve_ranks,
    write_load_file,
)
from .parsers import DEVICE_DEFAULTS, output_file

# What --wire emulated-internode changes (``parsers.WIRES``: the links a sweep runs over), for NCCL only: peer-to-peer
# (NVLink, PCIe) off, so NCCL moves data through its shared-memory transport, i.e. host memory.
# NCCL_SHM_DISABLE stays unset: it would push the traffic to the network transport (sockets or an
# HCA's loopback) instead, a different wire from the host-memory one this emulates.
EMULATED_INTERNODE_ENV = {"NCCL_P2P_DISABLE": "1"}


def resolve_defaults(args: argparse.Namespace, device: str) -> None:
    """Fill the options left out (None) with ``DEVICE_DEFAULTS`` for ``device``; keep the others."""
    for key, (gpu, cpu) in DEVICE_DEFAULTS.items():
        if getattr(args, key) is None:
            value = gpu if device == "cuda" else cpu
            setattr(args, key, list(value) if isinstance(value, list) else value)


class Step(NamedTuple):
    """One point of the sweep: a rank function, its arguments, and what makes its rows."""

    label: str
    fn: Any
    args: tuple
    summarise: Any
    fields: dict  # the setup, for the error row if the step fails


def run_bench(args: argparse.Namespace) -> int:
    out = output_file("--out", args.out)  # every command: its outputs' folders made first
    output_file("--timeline", args.timeline)
    output_file("--trace", args.trace)
    device = resolve_device(args.device)
    ranks = resolve_ranks(args.ranks, device)
    note = resolve_wire(args, device, ranks)
    resolve_defaults(args, device)
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
        args.expert_dtype = resolve_expert_dtype(args.expert_dtype, bench_config(args.preset, n))
    for flag, values, low in (
        ("--tokens", args.tokens, 1),
        ("--prefill-tokens", args.prefill_tokens, 1),
        ("--decode-seqs", args.decode_seqs, 1),
        ("--iters", [args.iters], 1),
        ("--warmup", [args.warmup], 0),
        ("--delay", args.delay, 0),
    ):
        bad = next((v for v in values if v < low), None)
        if bad is not None:
            raise ValueError(f"{flag} must be >= {low}, got {bad}; leave {flag} out for its default")
    eplb = resolve_eplb(args, ranks, experts_list)
    if args.tbo and not (args.prefill_tokens or args.decode_seqs):
        raise ValueError(
            "--prefill-tokens and --decode-seqs must give at least one size with --tbo, got neither; "
            "leave one out for its default"
        )
    make_overlap("combine_sm", device, sm_budget=args.sm_budget)  # checks the SM budget here, once
    if args.tbo and isinstance(args.tbo_gemm_sm_budget, int):
        check_sm_budget(torch.device(device), args.tbo_gemm_sm_budget)
    if args.index_rows and "low_latency" not in dispatchers:
        raise ValueError(
            f"--index-rows is an option of the low_latency dispatcher, which this run does not use "
            f"(--dispatcher {' '.join(dispatchers)}); add --dispatcher low_latency or leave --index-rows out"
        )
    if args.transport in ("symm_mem", "copy_engine") and (device != "cuda" or ranks < 2):
        raise ValueError(
            f"--transport {args.transport} needs CUDA and >= 2 ranks, got {device} with {ranks}; "
            "use --transport auto or nccl"
        )
    attention = (
        AttentionConfig(get_preset(args.preset).hidden_size, args.heads, args.kv_heads, args.head_dim)  # checks heads
        if args.tbo
        else None
    )
    dtype = args.dtype or default_dtype_name(device)
    console = make_console()
    if note:
        console.print(note, highlight=False)
    redundant = max(eplb.redundant) if eplb is not None else 0
    console.print(_memory_line(args, experts_list, ranks, dtype, attention, device, redundant), highlight=False)
    meta = result_meta(device=device, world_size=ranks, wire=args.wire)
    meta.update(
        preset=args.preset,
        warmup=args.warmup,
        iters=args.iters,
        sm_budget=args.sm_budget,
        timing="median of CUDA events (host clock on CPU); ranks lined up between forwards; "
        "times are the slowest rank's",
    )
    if eplb is not None:
        meta.update(
            policy=eplb.policy,
            redundant=eplb.redundant,
            skew=sorted({t.label for t in eplb.targets.values()}),
            eplb_window_forwards=FILL_FORWARDS,
            eplb_measure_tokens=MEASURE_TOKENS,
            timing="layer_ms: median of CUDA events (host clock on CPU) of eager forwards, ranks lined up "
            "between forwards, the slowest rank's; t_rebalance_ms: host clock, ranks lined up before and after; "
            "eplb_overhead: medians of CUDA-graph replays",
        )
    results = ResultFile(out, meta)
    loads: list[list[float]] = []  # --eplb: each step's window load, for --record-load
    steps = _steps(args, experts_list, dispatchers, modes, dtype, ranks, eplb, loads)
    # The wire's NCCL settings go to the ranks' environment only, before they make their communicator.
    pool = RankPool(ranks, device, environ=EMULATED_INTERNODE_ENV if args.wire == "emulated-internode" else None)
    started = time.perf_counter()
    try:
        stopped = run_steps(steps, pool, results, console, "tbo" if args.tbo else "eplb" if eplb else "sbo")
        if stopped:
            meta["stopped"] = stopped + ("; no timeline drawn" if args.timeline or args.trace else "")
        elif args.timeline or args.trace:
            _timeline(args, pool, experts_list[0], dispatchers, modes, dtype, ranks, device, console)
    except BaseException:
        pool.stop()  # an interrupt or a failure: stop the ranks now, not politely
        raise
    finally:
        pool.close()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    meta.update(measured_wire(results.rows))
    results.save()
    if eplb is not None:
        console.print(eplb_table(results.rows))
        print_notes(console, *eplb_notes(results.rows), cpu_timing_note(device))
        if eplb.record_load is not None:
            _record_load(eplb, loads, args, meta, console)
    elif args.tbo:
        console.print(tbo_table(results.rows))
        print_notes(console, TBO_LEGEND, cpu_timing_note(device))
    else:
        console.print(sbo_table(results.rows))
        print_notes(console, sbo_legend(results.rows), cpu_timing_note(device))
    if stopped:
        console.print(f"[red]{escape(meta['stopped'])}[/]", highlight=False)
    written = f"written to {results.path}" if results.path else "not written (no --out)"
    # soft_wrap: a path is printed whole, never broken at the console's width.
    console.print(f"{len(results.rows)} rows, {results.errors} errors; {written}", highlight=False, soft_wrap=True)
    return 1 if results.errors else 0


def resolve_wire(args: argparse.Namespace, device: str, ranks: int) -> str | None:
    """Check ``--wire`` before any rank starts; under the emulated wire, ``--transport auto`` becomes
    ``nccl``; ranks that share GPUs make the wire ``shared-gpu``, one rank ``none`` (returns the line
    saying either of the first two).
    Raises ``ValueError`` for what cannot emulate it."""
    shared = shared_gpu_note(device, ranks)
    if shared:
        if args.wire == "emulated-internode":
            raise ValueError(
                f"--wire emulated-internode needs a GPU per rank (it routes NCCL between GPUs through host "
                f"memory), got {ranks} ranks on {torch.cuda.device_count()} GPU(s); use fewer --ranks"
            )
        args.wire = "shared-gpu"
        return shared
    if args.wire != "emulated-internode":
        if ranks == 1:
            args.wire = "none"  # one rank: nothing crosses a link between ranks
        return None
    if device != "cuda":
        raise ValueError(
            f"--wire emulated-internode needs CUDA GPUs (it routes NCCL through host memory), got --device "
            f"{device}; run on GPUs or leave out --wire"
        )
    if ranks < 2:
        raise ValueError(f"--wire emulated-internode needs >= 2 ranks, got {ranks}; use --ranks 2 or more")
    if args.transport in ("symm_mem", "copy_engine"):
        raise ValueError(
            f"--transport {args.transport} writes the peer's memory over NVLink, outside NCCL, so it cannot "
            f"run on --wire emulated-internode, got both; use --transport nccl (or auto)"
        )
    if args.transport == "auto":
        args.transport = "nccl"
        return "--wire emulated-internode: low_latency uses --transport nccl (symm_mem would bypass the wire)"
    return None


def measured_wire(rows: list[dict]) -> dict:
    """The raw all-to-all bandwidth the run measured on its wire: bytes / time of the largest raw
    ``all_to_all_single`` reference among the rows (the closest to the link's bandwidth); {} without."""
    refs = [
        (row[f"{phase}_bytes_sent"], row[f"ref_t_{phase}_us"])
        for row in rows
        for phase in ("dispatch", "combine")
        if row.get(f"ref_t_{phase}_us") and row.get(f"{phase}_bytes_sent")
    ]
    if not refs:
        return {}
    size, t_us = max(refs)
    # Three significant digits: two decimals would round a slow wire (gloo on a busy CPU) to 0 GB/s.
    return {"wire_all_to_all_GBps": float(f"{size / t_us / 1e3:.3g}"), "wire_all_to_all_bytes": size}


def _record_load(eplb: EplbSetup, loads: list[list[float]], args, meta: dict, console: Console) -> None:
    """``--record-load``: the EP group's tokens per expert, every step's load window summed."""
    path = eplb.record_load
    assert path is not None, "called with --record-load"
    if not loads:
        console.print(f"[red]no load recorded[/]: every step failed; {escape(str(path))} not written", highlight=False)
        return
    load = [float(sum(column)) for column in zip(*loads)]
    file_meta = {
        **meta,
        "what": "tokens per expert routed by the EP group, summed over every step's load window "
        f"({len(loads)} steps x {meta['eplb_window_forwards']} forwards of fresh tokens)",
    }
    write_load_file(path, load, args.preset, file_meta)
    console.print(f"load of {len(load)} experts written to {path}", highlight=False, soft_wrap=True)


def _memory_line(args, experts_list, ranks, dtype, attention, device, redundant: int = 0) -> str:
    """The per-rank memory estimate of the largest setup of the sweep (``redundant``: the most
    redundant expert slots per rank it runs); raises when it cannot fit."""
    if args.tbo:
        tokens = max([*args.prefill_tokens, *args.decode_seqs])
        kv_tokens = max([*args.prefill_tokens, *(b * (args.kv_len + 1) for b in args.decode_seqs)])
    else:
        tokens, kv_tokens = max(args.tokens), 0
    # --eplb on CUDA holds two layers at once (with and without statistics, for their overhead), the
    # largest with its redundant slots.
    layers = 2 if args.eplb and device == "cuda" else 1
    estimates = [
        estimate_rank_bytes(
            bench_config(args.preset, n), ranks, dtype, tokens, attention, kv_tokens, layers=layers, redundant=redundant
        )
        for n in experts_list
    ]
    return check_memory(max(estimates, key=lambda e: e.total_B), device, ranks)


# Causes after which a sweep cannot go on: the next step, as large or larger, would fail the same way.
OUT_OF_MEMORY = ("OutOfMemoryError", "out of memory", "can't allocate memory", "MemoryError")


def fatal_cause(err: RankError) -> str | None:
    """Why the sweep must stop after ``err``: a rank was killed (the kernel's OOM killer, most often)
    or ran out of memory; None for a failure the next step may well not have."""
    for failure in err.failures:
        if failure.kind == "died":
            return f"rank {failure.rank} died ({failure.cause}), most likely out of memory"
        if any(marker in failure.cause or marker in failure.details for marker in OUT_OF_MEMORY):
            return f"rank {failure.rank} ran out of memory ({failure.cause[:200]})"
    return None


def run_steps(steps: list[Step], pool, results: ResultFile, console: Console, bench: str) -> str | None:
    """Run the sweep's steps in order, each one's rows (or error row) saved as it ends. After a step
    that killed a rank or ran out of memory, stop: returns why, naming the steps skipped."""
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task("sweep", total=len(steps))
        for done, step in enumerate(steps, start=1):
            progress.update(task, description=step.label)
            fatal: list[str] = []

            def run(step=step, fatal=fatal) -> list[dict]:
                try:
                    return step.summarise(pool.run(in_ranks(step.fn), *step.args))
                except RankError as err:
                    cause = fatal_cause(err)
                    if cause:
                        fatal.append(cause)
                    raise

            failure = results.add_step(run, {"bench": bench, "step": step.label, **step.fields})
            if failure:
                console.print(f"[red]{step.label} failed[/]: {escape(failure[-1500:])}", highlight=False)
            progress.advance(task)
            if fatal:
                skipped = len(steps) - done
                return (
                    f"sweep stopped after step {step.label}: {fatal[0]}; {skipped} remaining "
                    f"step{'s' if skipped != 1 else ''} skipped (use fewer --tokens or --experts, or more ranks)"
                )
    return None


def _steps(args, experts_list, dispatchers, modes, dtype, ranks, eplb: EplbSetup | None, loads) -> list[Step]:
    """Every point of the sweep, in order."""
    steps: list[Step] = []
    if eplb is not None:
        for n, d, t in ((n, d, t) for n in experts_list for d in dispatchers for t in args.tokens):
            spec = {
                **_spec(args, n, d, ["none"], dtype),
                "redundant": eplb.redundant,
                "policy": eplb.policy,
                "num_nodes": eplb.num_nodes,
                "target": eplb.targets[n].load,
                "skew": eplb.targets[n].label,
            }
            steps.append(
                Step(
                    f"E={n} {d} T={t}",
                    eplb_bench_rank,
                    (spec, t),
                    lambda per_rank, spec=spec: summarise_eplb(per_rank, spec, ranks, loads),
                    {"num_experts": n, "dispatcher": d, "tokens_per_rank": t, "wire": args.wire},
                )
            )
        return steps
    if not args.tbo:
        for n, d, t in ((n, d, t) for n in experts_list for d in dispatchers for t in args.tokens):
            spec = _spec(args, n, d, modes, dtype)
            steps.append(
                Step(
                    f"E={n} {d} T={t}",
                    sbo_bench_rank,
                    (spec, t),
                    lambda per_rank, spec=spec: summarise(per_rank, spec, ranks),
                    {
                        "num_experts": n,
                        "experts_per_gpu": n // ranks,
                        "dispatcher": d,
                        "tokens_per_rank": t,
                        "wire": args.wire,
                    },
                )
            )
        return steps
    sizes = [("prefill", t) for t in args.prefill_tokens] + [("decode", b) for b in args.decode_seqs]
    for n, d, (regime, size) in ((n, d, s) for n in experts_list for d in dispatchers for s in sizes):
        spec = _spec(args, n, d, modes, dtype)
        steps.append(
            Step(
                f"E={n} {d} {regime} {size}",
                tbo_bench_rank,
                (spec, regime, size),
                lambda per_rank, spec=spec: summarise_tbo(per_rank, spec, ranks),
                {"num_experts": n, "dispatcher": d, "regime": regime, "size": size, "wire": args.wire},
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
            per_case = pool.run(in_ranks(tbo_timeline_rank), spec, regime, size, args.trace)[0]
            spans.update({f"{dispatcher} / {case}": s for case, s in per_case.items()})
        title = f"{args.preset} decoder layer, EP{ranks}, {regime} {size}/rank, {device}"
    else:
        size = args.timeline_tokens or max([t for t in args.tokens if t <= 4096] or [min(args.tokens)])
        for dispatcher in dispatchers:
            spec = _spec(args, num_experts, dispatcher, modes, dtype)
            per_mode = pool.run(in_ranks(timeline_rank), spec, size, args.trace)[0]
            spans.update({f"{dispatcher} / {mode}": s for mode, s in per_mode.items()})
        title = f"{args.preset}, EP{ranks}, {size} tokens/rank, {device}"
    if args.timeline:
        spans = {k: [Span(**s) for s in v] for k, v in spans.items()}
        spans_path = Path(args.timeline).with_suffix(".spans.json")
        save_spans(spans, spans_path)
        plot_timeline(spans, args.timeline, title=title)
        console.print(f"timeline: {args.timeline} (spans: {spans_path})", highlight=False, soft_wrap=True)
    if args.trace:
        console.print(
            f"Chrome traces: {args.trace}.{'tbo.' if args.tbo else ''}<case>.json", highlight=False, soft_wrap=True
        )


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
        "auto_tbo": args.auto_tbo,
        "tbo_gemm_sm_budget": getattr(args, "tbo_gemm_sm_budget", None),
        "transport": args.transport,
        "index_rows": args.index_rows,
        "wire": args.wire,
        "expert_dtype": args.expert_dtype,
    }


def _choose(values: list[str], allowed: list[str], flag: str) -> list[str]:
    if values == ["all"]:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{flag} must be among {allowed} or all, got {bad}")
    return list(dict.fromkeys(values))

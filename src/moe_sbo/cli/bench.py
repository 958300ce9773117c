"""``moe-sbo bench``: the sweep's command line. Without ``--tbo`` every dispatcher × overlap mode ×
token count (``bench_sbo.py``); with ``--tbo`` the decoder layer with and without two-batch overlap
(``bench_tbo.py``). Each step runs on every rank of one pool; its rows land in the result file as soon
as it ends.

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

from ..config import PRESETS, get_preset
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
from .bench_sbo import sbo_bench_rank, sbo_legend, sbo_table, summarise, timeline_rank
from .bench_tbo import TBO_LEGEND, summarise_tbo, tbo_bench_rank, tbo_table, tbo_timeline_rank
from .memory import check_memory, estimate_rank_bytes
from .options import (
    RANKS_HELP,
    HelpFormatter,
    cpu_timing_note,
    default_dtype_name,
    in_ranks,
    make_console,
    print_notes,
    resolve_ranks,
)

# Defaults per device, (GPU, CPU), for options left out. The GPU ones measure; the CPU ones only show
# that the sweep works, in well under two minutes on two cores (a DeepSeek-sized layer would not even
# fit in a laptop's memory). Values given on the command line are kept as they are.
DEVICE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "preset": ("deepseek-v3", "tiny"),
    "tokens": ([128, 512, 2048, 4096, 8192], [16, 64]),
    "warmup": (5, 1),
    "iters": (20, 3),
    "prefill_tokens": ([4096, 8192], [128]),
    "decode_seqs": ([32, 64, 128, 256], [4, 16]),
    "kv_len": (2048, 64),
    "heads": (128, 4),
    "kv_heads": (8, 2),
    "head_dim": (128, 16),
}

# Links a sweep can run over (``--wire``). What emulated-internode changes, for NCCL only: peer-to-peer
# (NVLink, PCIe) off, so NCCL moves data through its shared-memory transport, i.e. host memory.
# NCCL_SHM_DISABLE stays unset: it would push the traffic to the network transport (sockets or an
# HCA's loopback) instead, a different wire from the host-memory one this emulates.
WIRES = ("nvlink", "emulated-internode")
EMULATED_INTERNODE_ENV = {"NCCL_P2P_DISABLE": "1"}

DESCRIPTION = """\
Time the MoE layer on N ranks: every overlap mode x dispatcher x token count (single-batch overlap),
or with --tbo a decoder layer (attention + MoE) without and with two-batch overlap. Rows go to --out
(JSON) after every step; a step that fails on a rank becomes an error row, and after a rank is
killed or runs out of memory the sweep stops. Each mode's efficiency and speedup are measured
against overlap none.

Defaults depend on the device: on GPUs a DeepSeek-V3 layer at realistic sizes; on CPU ranks the
tiny preset at a few tokens, a smoke run of the whole sweep (CPU times are not GPU numbers). Before
any rank starts, a per-rank memory estimate is printed and a run that cannot fit is refused."""


def gemm_sm_budget_arg(text: str) -> int | str | None:
    """``--tbo-gemm-sm-budget``: a number of SMs, ``auto`` or ``all`` (None: no budget)."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of SMs, 'auto' or 'all', got {text!r}")


def _device_default(key: str, what: str) -> str:
    gpu, cpu = (" ".join(map(str, v)) if isinstance(v, list) else v for v in DEVICE_DEFAULTS[key])
    return f"{what} (default: {gpu}; on CPU: {cpu})"


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time overlap modes x dispatchers x token counts on N ranks (GPUs; CPU: a smoke run)",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        metavar="NAME",
        help=_device_default("preset", f"model shapes, one of {', '.join(sorted(PRESETS))}"),
    )
    p.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=None,
        help="routed experts in total, one sweep each (default: the preset's; label: experts per GPU)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=_device_default("tokens", "tokens per rank"))
    p.add_argument("--dispatcher", nargs="+", default=["all"], help=f"among {sorted(DISPATCHERS)}, or all")
    p.add_argument("--overlap", nargs="+", default=["all"], help=f"among {list(OVERLAP_MODES)}, or all")
    p.add_argument("--ranks", type=int, default=None, help=f"EP size: {RANKS_HELP}")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if a GPU is visible")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument(
        "--sm-budget",
        type=int,
        default=None,
        help="SMs for the shared experts in combine_sm (default: all but the 32 left to communication)",
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl", "symm_mem", "copy_engine"],
        help="low_latency's transport (auto: symmetric memory on CUDA from 2 GPUs, else NCCL; copy_engine: "
        "peer copies, no SMs in flight)",
    )
    p.add_argument(
        "--index-rows",
        action="store_true",
        help="low_latency's index_rows: the experts read the received rows in place through the layout's "
        "index instead of a copy in expert order (rows record index_rows)",
    )
    p.add_argument(
        "--wire",
        default="nvlink",
        choices=WIRES,
        help="the link between the ranks: nvlink (the GPUs' own), or emulated-internode: NCCL with "
        "NCCL_P2P_DISABLE=1, so its traffic goes through host memory (24 GB/s all-to-all measured at "
        "236 MB on 2x H200, an inter-node-class wire on one host); CUDA and >= 2 ranks only. "
        "low_latency then uses --transport nccl: symm_mem and copy_engine write the peer's memory over "
        "NVLink, outside NCCL, so they cannot emulate the slower wire (auto becomes nccl; asking for "
        "them is refused)",
    )
    p.add_argument("--warmup", type=int, default=None, help=_device_default("warmup", "untimed calls first"))
    p.add_argument("--iters", type=int, default=None, help=_device_default("iters", "timed calls"))
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph rows")
    p.add_argument("--graph-max-tokens", type=int, default=512, help="largest tokens/rank timed as graph replays")
    p.add_argument("--out", default=None, help="JSON file for {meta, rows} (default: none written)")
    p.add_argument("--timeline", default=None, metavar="PNG", help="draw one forward per mode at --timeline-tokens")
    p.add_argument("--timeline-tokens", type=int, default=None, help="default: largest of --tokens up to 4096")
    p.add_argument("--trace", default=None, metavar="PREFIX", help="also keep Chrome traces PREFIX.<mode>.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    tbo = p.add_argument_group("two-batch overlap (--tbo): a decoder layer, attention + MoE")
    tbo.add_argument("--tbo", action="store_true", help="bench the decoder layer without and with TBO")
    tbo.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="*",
        default=None,
        help=_device_default("prefill_tokens", "prefill tokens per rank"),
    )
    tbo.add_argument(
        "--decode-seqs",
        type=int,
        nargs="*",
        default=None,
        help=_device_default("decode_seqs", "decode sequences per rank"),
    )
    tbo.add_argument(
        "--kv-len", type=int, default=None, help=_device_default("kv_len", "cached tokens per decode sequence")
    )
    tbo.add_argument("--heads", type=int, default=None, help=_device_default("heads", "attention heads"))
    tbo.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help=_device_default("kv_heads", "GQA key/value heads (8: about MLA's cache)"),
    )
    tbo.add_argument("--head-dim", type=int, default=None, help=_device_default("head_dim", "attention head dimension"))
    tbo.add_argument(
        "--delay",
        type=int,
        nargs="+",
        default=[0, 1],
        help="stages micro-batch A runs before B starts; one TBO row per value",
    )
    tbo.add_argument(
        "--auto-tbo",
        action="store_true",
        help="also a row per overlap mode where TBO is on or off as moe_sbo.overlap.tbo_auto.AutoTbo "
        "chooses after timing both (with the first --delay); its choice is in the row",
    )
    tbo.add_argument(
        "--tbo-gemm-sm-budget",
        type=gemm_sm_budget_arg,
        default="auto",
        metavar="SMS|auto|all",
        help="CUDA: the SMs every GEMM under TBO plans for, leaving the others to the other micro-batch's "
        "transfer: a number, 'all', or 'auto' (default: all but the SMs the transfer holds, "
        "moe_sbo.overlap.tbo.resolve_gemm_sm_budget); the number used is in every TBO row as tbo_gemm_sm_budget",
    )


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
    sizes = [*args.tokens, *args.prefill_tokens, *args.decode_seqs]
    if not sizes or min(sizes) < 1 or args.iters < 1 or args.warmup < 0 or min(args.delay) < 0:
        raise ValueError(
            f"--tokens, --prefill-tokens and --decode-seqs must be >= 1, --iters >= 1, --warmup >= 0 "
            f"and --delay >= 0; got {sizes}, {args.iters}, {args.warmup}, {args.delay}"
        )
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
    console.print(_memory_line(args, experts_list, ranks, dtype, attention, device), highlight=False)
    meta = result_meta(device=device, world_size=ranks, wire=args.wire)
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
    # The wire's NCCL settings go to the ranks' environment only, before they make their communicator.
    pool = RankPool(ranks, device, environ=EMULATED_INTERNODE_ENV if args.wire == "emulated-internode" else None)
    started = time.perf_counter()
    try:
        stopped = run_steps(steps, pool, results, console, "tbo" if args.tbo else "sbo")
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
    if args.tbo:
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
    ``nccl``; ranks that share GPUs make the wire ``shared-gpu`` (returns the line saying either).
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


def _memory_line(args, experts_list, ranks, dtype, attention, device) -> str:
    """The per-rank memory estimate of the largest setup of the sweep; raises when it cannot fit."""
    if args.tbo:
        tokens = max([*args.prefill_tokens, *args.decode_seqs])
        kv_tokens = max([*args.prefill_tokens, *(b * (args.kv_len + 1) for b in args.decode_seqs)])
    else:
        tokens, kv_tokens = max(args.tokens), 0
    estimates = [
        estimate_rank_bytes(bench_config(args.preset, n), ranks, dtype, tokens, attention, kv_tokens)
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


def _steps(args, experts_list, dispatchers, modes, dtype, ranks) -> list[Step]:
    """Every point of the sweep, in order."""
    steps: list[Step] = []
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
    }


def _choose(values: list[str], allowed: list[str], flag: str) -> list[str]:
    if values == ["all"]:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{flag} must be among {allowed} or all, got {bad}")
    return list(dict.fromkeys(values))

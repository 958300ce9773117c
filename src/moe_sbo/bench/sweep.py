"""The launching side of every ``moe-sbo bench`` mode: its options checked and its defaults filled
(``prepare``), then its steps run on one pool of ranks, each step's rows landing in the result file
as soon as it ends (``Sweep.run``). The modes (``sbo``, ``tbo``, ``eplb``) give the steps, the
tables and their own checks.

The hard part is failing early, and only when it must: every option is checked on the launching
process before any rank starts, with a per-rank memory estimate (``measure.memory``) against what the
device has; options left out take per-device defaults (``defaults.DEVICE_DEFAULTS``: a quick tiny
sweep on CPU ranks); a step that fails on one rank becomes an error row, not the end of the sweep,
unless a rank was killed or ran out of memory: then the steps after it, no smaller, are skipped and
the reason said.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.markup import escape

from ..config import get_preset
from ..decoder.attention import AttentionConfig
from ..dispatch import DISPATCHERS
from ..launch.failures import RankError
from ..launch.signals import signals_deferred
from ..measure.memory import check_memory, estimate_rank_bytes
from ..measure.options import default_dtype_name, in_ranks, resolve_expert_dtype
from ..measure.progress import StepBar
from ..measure.results import ResultFile, StandardOutput, result_meta, shared_gpu_note
from ..measure.run import Ranks, output_path
from ..measure.run import prepare as prepare_ranks
from ..measure.trace import Span, plot_timeline, save_spans
from ..overlap import OVERLAP_MODES, make_overlap
from .common import bench_config
from .defaults import DEVICE_DEFAULTS

# What --wire emulated-internode changes (``defaults.WIRES``: the links a sweep runs over), for NCCL only:
# peer-to-peer (NVLink, PCIe) off, so NCCL moves data through its shared-memory transport, i.e. host memory.
# NCCL_SHM_DISABLE stays unset: it would push the traffic to the network transport (sockets or an
# HCA's loopback) instead, a different wire from the host-memory one this emulates.
EMULATED_INTERNODE_ENV = {"NCCL_P2P_DISABLE": "1"}
TIMING = "median of CUDA events (host clock on CPU); ranks lined up between forwards; times are the slowest rank's"


def resolve_defaults(args: argparse.Namespace, device: str) -> None:
    """Fill the options of this mode left out (None) with ``DEVICE_DEFAULTS`` for ``device``; keep the others."""
    for key, (gpu, cpu) in DEVICE_DEFAULTS.items():
        if getattr(args, key, 0) is None:
            value = gpu if device == "cuda" else cpu
            setattr(args, key, list(value) if isinstance(value, list) else value)


class Step(NamedTuple):
    """One point of the sweep: a rank function, its arguments, and what makes its rows."""

    label: str
    fn: Any
    args: tuple
    summarise: Any
    fields: dict  # the setup, for the error row if the step fails


@dataclass
class Sweep:
    """A bench mode's setup, checked before any rank starts: ``args`` with its defaults filled, where
    it runs, the result file, the line saying how the wire changed (or None), and the dispatchers,
    overlap modes (``none`` first), expert counts and activation dtype it sweeps."""

    args: argparse.Namespace
    ranks: Ranks
    out: Path | StandardOutput | None  # --out: a file, standard output (-), or none
    note: str | None
    dispatchers: list[str]
    modes: list[str]
    experts: list[int]
    dtype: str

    def spec(self, num_experts: int, dispatcher: str, modes: list[str]) -> dict:
        """What a rank function needs of one setup of the sweep."""
        args = self.args
        return {
            "preset": args.preset,
            "num_experts": num_experts,
            "dispatcher": dispatcher,
            "modes": list(modes),
            "dtype": self.dtype,
            "warmup": args.warmup,
            "iters": args.iters,
            "seed": args.seed,
            "graph": not args.no_graph,
            "graph_max_tokens": args.graph_max_tokens,
            "sm_budget": args.sm_budget,
            "heads": getattr(args, "heads", None),
            "kv_heads": getattr(args, "kv_heads", None),
            "head_dim": getattr(args, "head_dim", None),
            "kv_len": getattr(args, "kv_len", None),
            "delays": list(dict.fromkeys(getattr(args, "delay", []))),
            "auto_tbo": getattr(args, "auto_tbo", False),
            "tbo_gemm_sm_budget": getattr(args, "tbo_gemm_sm_budget", None),
            "transport": args.transport,
            "index_rows": args.index_rows,
            "wire": args.wire,
            "expert_dtype": args.expert_dtype,
        }

    def check_memory(
        self,
        tokens: int,
        attention: AttentionConfig | None = None,
        kv_tokens: int = 0,
        layers: int = 1,
        redundant: int = 0,
    ) -> None:
        """Print the wire's note and the per-rank memory estimate of the sweep's largest setup (``redundant``:
        the most redundant expert slots per rank it runs); ``ValueError`` when it cannot fit."""
        device, ranks = self.ranks.device, self.ranks.count
        estimates = [
            estimate_rank_bytes(
                bench_config(self.args.preset, n),
                ranks,
                self.dtype,
                tokens,
                attention,
                kv_tokens,
                layers=layers,
                redundant=redundant,
            )
            for n in self.experts
        ]
        if self.note:
            self.ranks.console.print(self.note, highlight=False)
        line = check_memory(max(estimates, key=lambda e: e.total_B), device, ranks)
        if not self.args.detail:
            line = line.split("\n")[0]  # the estimate's parts: --detail
        self.ranks.console.print(line, highlight=False)

    def run(
        self,
        bench: str,
        steps: list[Step],
        report: Callable[[list[dict], dict], None],
        conclude: Callable[[list[dict]], list[str]],
        draw: Callable[[Any], None] | None = None,
        meta: dict | None = None,
    ) -> int:
        """Run ``steps`` in order on one pool of ranks, then (nothing stopped the sweep) ``draw(pool)``
        for ``--timeline`` / ``--trace``; save the rows, ``report(rows, meta)`` (tables and notes), the
        row and error counts, and last the sweep's conclusion, ``conclude(rows)`` (also the meta's
        ``summary``). Exit status: 1 if any row is an error, else 0."""
        args, console = self.args, self.ranks.console
        file_meta = result_meta(device=self.ranks.device, world_size=self.ranks.count, wire=args.wire)
        file_meta.update(preset=args.preset, warmup=args.warmup, iters=args.iters, sm_budget=args.sm_budget)
        file_meta["timing"] = TIMING
        file_meta.update(meta or {})
        # Until the sweep ends, the file (written after every step) says it holds part of the rows.
        file_meta.update(partial=True, partial_reason="running")
        results = ResultFile(self.out, file_meta)
        # The wire's NCCL settings go to the ranks' environment only, before they make their communicator.
        pool = self.ranks.pool(environ=EMULATED_INTERNODE_ENV if args.wire == "emulated-internode" else None)
        profiles = getattr(args, "timeline", None) or getattr(args, "trace", None)
        started = time.perf_counter()
        try:
            stopped = run_steps(steps, pool, results, console, bench)
            if stopped:
                file_meta["stopped"] = stopped + ("; no timeline drawn" if profiles else "")
            elif profiles and draw is not None:
                draw(pool)
        except BaseException as exc:
            pool.stop()  # an interrupt or a failure: stop the ranks now, not politely
            # Exception: a failure of the launcher; the others (Ctrl-C, SIGTERM) interrupt it.
            reason = f"failed ({type(exc).__name__})" if isinstance(exc, Exception) else "interrupted"
            file_meta.update(partial_reason=reason, wall_s=round(time.perf_counter() - started, 1))
            with signals_deferred():  # a second Ctrl-C must not cut the file short
                results.save()
            raise
        finally:
            pool.close()
        file_meta["wall_s"] = round(time.perf_counter() - started, 1)
        file_meta.update(measured_wire(results.rows))
        summary = conclude(results.rows)
        file_meta["summary"] = summary
        if stopped:
            file_meta["partial_reason"] = "stopped"  # ``stopped`` says after which step, and why
        else:
            file_meta["partial"] = False
            del file_meta["partial_reason"]
        results.save()
        report(results.rows, file_meta)
        if stopped:
            console.print(f"[red]{escape(file_meta['stopped'])}[/]", highlight=False)
        written = f"written to {results.path}" if results.path else "not written (no --out)"
        # soft_wrap: a path is printed whole, never broken at the console's width.
        console.print(f"{len(results.rows)} rows, {results.errors} errors; {written}", highlight=False, soft_wrap=True)
        for line in summary:
            console.print(line, highlight=False)
        return 1 if results.errors else 0


def prepare(args: argparse.Namespace, drop_auto: bool = False) -> Sweep:
    """A mode's shared options checked, before any rank starts (``ValueError`` naming the option and
    the fix), and its defaults filled in ``args``. ``drop_auto``: ``--overlap all`` leaves ``auto`` out."""
    ranks, (out,) = prepare_ranks(args.device, args.ranks, ("--out", args.out))
    output_path("--timeline", getattr(args, "timeline", None))  # files only: "-" is for JSON
    output_path("--trace", getattr(args, "trace", None))
    device = ranks.device
    note = resolve_wire(args, device, ranks.count)
    resolve_defaults(args, device)
    dispatchers = choose(args.dispatcher, sorted(DISPATCHERS), "--dispatcher")
    if ranks.count > 1 and args.dispatcher == ["all"]:
        dispatchers = [d for d in dispatchers if d != "local"]
    overlap = getattr(args, "overlap", ["none"])
    modes = choose(overlap, list(OVERLAP_MODES), "--overlap")
    if drop_auto and overlap == ["all"]:
        modes = [m for m in modes if m != "auto"]  # auto explores per micro-batch size: give it its own run
    if "none" not in modes:
        modes = ["none", *modes]  # efficiency and speedups are measured against none
    experts = args.experts or [get_preset(args.preset).num_experts]
    for n in experts:
        bench_config(args.preset, n).experts_per_rank(ranks.count)  # bad sizes raise before any rank starts
        args.expert_dtype = resolve_expert_dtype(args.expert_dtype, bench_config(args.preset, n))
    for flag, key, low in (
        ("--tokens", "tokens", 1),
        ("--prefill-tokens", "prefill_tokens", 1),
        ("--decode-seqs", "decode_seqs", 1),
        ("--iters", "iters", 1),
        ("--warmup", "warmup", 0),
        ("--delay", "delay", 0),
    ):
        values = getattr(args, key, [])
        bad = next((v for v in (values if isinstance(values, list) else [values]) if v < low), None)
        if bad is not None:
            raise ValueError(f"{flag} must be >= {low}, got {bad}; leave {flag} out for its default")
    make_overlap("combine_sm", device, sm_budget=args.sm_budget)  # checks the SM budget here, once
    if args.index_rows and "low_latency" not in dispatchers:
        raise ValueError(
            f"--index-rows is an option of the low_latency dispatcher, which this run does not use "
            f"(--dispatcher {' '.join(dispatchers)}); add --dispatcher low_latency or leave --index-rows out"
        )
    if args.transport in ("symm_mem", "copy_engine") and (device != "cuda" or ranks.count < 2):
        raise ValueError(
            f"--transport {args.transport} needs CUDA and >= 2 ranks, got {device} with {ranks.count}; "
            "use --transport auto or nccl"
        )
    dtype = args.dtype or default_dtype_name(device)
    return Sweep(args, ranks, out, note, dispatchers, modes, experts, dtype)


def resolve_wire(args: argparse.Namespace, device: str, ranks: int) -> str | None:
    """Check ``--wire`` before any rank starts and set ``args.wire`` to the link the run's transfers
    cross (``wire_label``), whatever was asked; under the emulated wire (``--wire emulated-internode``
    or ``NCCL_P2P_DISABLE=1`` already set) ``--transport auto`` becomes ``nccl``. Returns the line
    saying what changed (shared GPUs, the transport), or None. Raises ``ValueError`` for what cannot
    emulate the wire."""
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
        label = wire_label(device, ranks)
        if label != "emulated-internode":
            args.wire = label
            return None
    asked = "--wire emulated-internode" if args.wire == "emulated-internode" else "NCCL_P2P_DISABLE=1"
    args.wire = "emulated-internode"
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
            f"run on the emulated-internode wire, got it with {asked}; use --transport nccl (or auto)"
        )
    if args.transport == "auto":
        args.transport = "nccl"
        return f"{asked}: low_latency uses --transport nccl (symm_mem would bypass the wire)"
    return None


def wire_label(device: str, ranks: int) -> str:
    """The link the transfers of ``ranks`` ranks on ``device`` cross, as results name it
    (``defaults.WIRE_LABELS``): derived from the run, never from --wire alone."""
    if ranks == 1:
        return "none"  # nothing crosses a link between ranks
    if device != "cuda":
        return "gloo-cpu"
    if shared_gpu_note(device, ranks):
        return "shared-gpu"
    if os.environ.get("NCCL_P2P_DISABLE") == "1":  # the ranks inherit it
        return "emulated-internode"
    return "nvlink" if peer_to_peer(ranks) else "host-memory"


def peer_to_peer(ranks: int) -> bool:
    """Whether each of the first ``ranks`` GPUs (one rank each) can access every other's memory
    directly (NVLink, or PCIe peer-to-peer), the path NCCL's P2P transport takes."""
    gpus = range(ranks)
    return all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)


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
    with StepBar(len(steps)) as bar:  # on stderr, as every command's progress
        for done, step in enumerate(steps, start=1):
            bar.start(step.label)
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
            bar.advance()
            if fatal:
                skipped = len(steps) - done
                return (
                    f"sweep stopped after step {step.label}: {fatal[0]}; {skipped} remaining "
                    f"step{'s' if skipped != 1 else ''} skipped (use fewer --tokens or --experts, or more ranks)"
                )
    return None


def choose(values: list[str], allowed: list[str], flag: str) -> list[str]:
    """``values`` of ``flag`` (``all``: every one ``allowed``), checked, without repeats."""
    if values == ["all"]:
        return list(allowed)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{flag} must be among {allowed} or all, got {bad}")
    return list(dict.fromkeys(values))


def draw_timeline(args: argparse.Namespace, spans: dict, title: str, traces: str, console: Console) -> None:
    """``--timeline``: ``spans`` (case -> rank 0's spans) drawn, one lane per CUDA stream, and kept beside
    the PNG; ``--trace``: the line naming the Chrome traces (``traces``: their names after the prefix)."""
    if args.timeline:
        lanes = {k: [Span(**s) for s in v] for k, v in spans.items()}
        spans_path = Path(args.timeline).with_suffix(".spans.json")
        save_spans(lanes, spans_path)
        plot_timeline(lanes, args.timeline, title=title)
        console.print(f"timeline: {args.timeline} (spans: {spans_path})", highlight=False, soft_wrap=True)
    if args.trace:
        console.print(f"Chrome traces: {args.trace}.{traces}", highlight=False, soft_wrap=True)

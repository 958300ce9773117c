"""``moe-sbo bench sbo``: single-batch overlap measured, every dispatcher × every
overlap mode × token count.

For each (expert count, dispatcher, tokens per rank), on every rank of the EP group:

- ``t_shared_us``: the shared experts alone on the same tokens;
- ``t_comm_us``: dispatch + combine alone (the routed experts skipped: outputs = inputs);
- ``t_floor_route_us``, ``t_floor_routed_us``, ``t_floor_shared_us`` (``t_floor_us`` their sum): the
  router, the routed experts on the rows one dispatch brought and the shared experts, each timed
  alone (CUDA-graph replays on GPUs): the compute a perfect dispatcher and perfect overlap would leave;
- ``ref_t_dispatch_us``, ``ref_t_combine_us`` (``t_wire_us`` their sum), with two ranks or more: a raw
  ``all_to_all_single`` of each phase's bytes (``dispatch_bytes_sent``, ``combine_bytes_sent``) on the
  same wire, the physical reference ``--wire`` is about; ``t_limit_us`` = max(``t_floor_us``,
  ``t_wire_us``), the least any overlap can reach, and ``limit_ratio`` = ``t_layer_us / t_limit_us``;
- per overlap mode: the layer's median time and its phases (CUDA events recorded by dispatcher hooks,
  no sync inside a forward), and for decode sizes (<= ``--graph-max-tokens``) with a dispatcher that
  can be captured, the median of CUDA-graph replays as a second row (``graph: true``).

Per-rank medians become one row per mode: times are the slowest rank's. In each group,
``efficiency = (t_none - t_mode) / min(t_shared, t_comm)`` (1.0: the shorter side fully hidden),
``speedup_vs_none = t_none / t_mode`` and ``t_ideal_us = t_none - min(t_shared, t_comm)`` (the layer
time if the overlap were perfect and free). ``--timeline`` profiles one forward per mode at one size
and draws one lane per CUDA stream (``moe_sbo.measure.trace``); ``--trace`` keeps the Chrome traces.

The hard part is comparing modes fairly: every mode runs on the same layer object (same weights),
the same input and the same ranks, interleaved in one run, and ``auto`` is given its exploration
forwards before it is timed, so its row is what it settled on.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.distributed as dist
from rich.table import Table

from ..layer import MoELayer
from ..measure.options import compact, cpu_timing_note, in_ranks, make_table, print_notes
from ..measure.timing import SPANS, line_up, time_fn, time_layer
from ..overlap import AutoOverlap, make_overlap
from ..overlap.auto import bucket_of
from .common import (
    bandwidth,
    cached,
    dispatcher_options,
    floor_and_wire,
    layer_key,
    make_layer,
    physical_limit,
    profile_spans,
    resolved_path,
    row_head,
)
from .sweep import Step, Sweep, draw_timeline, prepare

# Span of time_layer that is the shared experts only in mode none; in other modes it is the final add.
PHASE_SPANS = tuple(name for name, _, _ in SPANS if name != "t_shared_us")


def _layer(device: torch.device, spec: dict, tokens: int) -> MoELayer:
    """The rank's layer for ``spec`` (its capacity sized for ``tokens`` where the dispatcher has one)."""
    options = dispatcher_options(spec, tokens)
    return cached(layer_key("moe", spec, options), lambda: make_layer(device, spec, options), device)


def sbo_bench_rank(device: torch.device, spec: dict, tokens: int) -> list[dict]:
    """One rank's rows for one (expert count, dispatcher, token count): every mode. Run on every rank."""
    layer = _layer(device, spec, tokens)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = getattr(torch, spec["dtype"])
    generator = torch.Generator(device=device).manual_seed(spec["seed"] * 7919 + rank * 131 + tokens)
    x_TH = torch.randn(tokens, layer.cfg.hidden_size, generator=generator, device=device).to(dtype)
    warmup, iters = spec["warmup"], spec["iters"]
    graph = (
        device.type == "cuda"
        and tokens <= spec["graph_max_tokens"]
        and layer.dispatcher.graph_capturable
        and spec["graph"]
    )
    rows = []
    with torch.inference_mode():
        topk = layer.router(x_TH)

        def comm_alone() -> None:
            recv = layer.dispatcher.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
            layer.dispatcher.combine(recv.rows_RH(), recv.handle)  # identity experts

        shared = layer.shared_experts
        base: dict = {"rank": rank, "tokens": tokens, **resolved_path(layer.dispatcher, device)}
        base["t_shared_us"] = time_fn(lambda: shared(x_TH), device, warmup, iters, False) if shared else 0.0
        base["t_comm_us"] = time_fn(comm_alone, device, warmup, iters, False)
        base.update(floor_and_wire(layer, x_TH, topk, warmup, iters, spec["seed"]))
        if graph:
            base["t_shared_graph_us"] = base["t_floor_shared_us"]  # timed from a graph there too (CUDA)
            base["t_comm_graph_us"] = time_fn(comm_alone, device, warmup, iters, True)
        for mode in spec["modes"]:
            layer.overlap = make_overlap(mode, device, sm_budget=spec["sm_budget"])
            if isinstance(layer.overlap, AutoOverlap):
                explore = len(layer.overlap.candidates) * (layer.overlap.warmup + layer.overlap.trials) + 1
                for _ in range(explore):
                    line_up(device)  # as the timed forwards run: one quiet forward at a time
                    layer(x_TH)
            spans = time_layer(layer, x_TH, warmup, iters)
            row = {**base, "overlap": mode, "graph": False, **{k: spans[k] for k in PHASE_SPANS}}
            if isinstance(layer.overlap, AutoOverlap):
                row["auto_choice"] = layer.overlap.choices.get(bucket_of(tokens), "none")
            traffic = layer.last_traffic
            row.update(
                dispatch_bytes_sent=traffic.dispatch_bytes_sent,
                combine_bytes_sent=traffic.combine_bytes_sent,
                bytes_sent=traffic.bytes_sent,
                bytes_recv=traffic.bytes_recv,
                inter_node_bytes=traffic.inter_node_bytes,
                intra_node_bytes=traffic.intra_node_bytes,
            )
            rows.append(row)
            if graph:
                graph_choice = {}
                if isinstance(layer.overlap, AutoOverlap):
                    # Replays pick their own mode: eager timings do not carry over to them.
                    mode_replayed = layer.overlap.choose_for_graphs(lambda: layer(x_TH), tokens, layer.dispatcher.ep)
                    graph_choice = {"auto_choice": mode_replayed}
                rows.append(
                    {
                        **row,
                        **graph_choice,
                        "graph": True,
                        "t_layer_us": time_fn(lambda: layer(x_TH), device, warmup, iters, True),
                        "t_shared_us": base["t_shared_graph_us"],
                        "t_comm_us": base["t_comm_graph_us"],
                        **{k: None for k in PHASE_SPANS if k != "t_layer_us"},
                    }
                )
        layer.overlap = make_overlap("none", device)
    return rows


def summarise(per_rank: list[list[dict]], spec: dict, ep: int) -> list[dict]:
    """Slowest rank's times per row, then efficiency and speedup against the group's ``none`` row."""
    rows = []
    for rank_rows in zip(*per_rank):
        first = rank_rows[0]
        row = {
            **row_head("sbo", spec, ep),
            **{k: first[k] for k in ("kernels", "transport_used") if k in first},
            "tokens_per_rank": first["tokens"],
            "overlap": first["overlap"],
            "tbo": False,
            "graph": first["graph"],
        }
        for key in first:
            if key.startswith(("t_", "ref_t_")) and not key.endswith("_graph_us"):
                values = [r[key] for r in rank_rows if r[key] is not None]
                row[key] = max(values) if values else None
            elif key.endswith("_bytes_sent"):
                row[key] = round(statistics.mean(r[key] for r in rank_rows))
        row.update(physical_limit(row))
        row.update(bandwidth(row))
        row["t_layer_us_per_rank"] = [round(r["t_layer_us"], 1) for r in rank_rows]
        for key in ("bytes_sent", "bytes_recv", "inter_node_bytes", "intra_node_bytes"):
            row[key] = round(statistics.mean(r[key] for r in rank_rows))
        if "auto_choice" in first:
            row["auto_choice"] = [r["auto_choice"] for r in rank_rows]
        paths = {r.get("expert_path") for r in rank_rows}
        if len(paths) == 1 and None not in paths:  # ranks with other row counts may run other GEMMs
            row["expert_path"] = paths.pop()
        rows.append(row)
    for row in rows:
        none = next(r for r in rows if r["overlap"] == "none" and r["graph"] == row["graph"])
        hideable = min(row["t_shared_us"], row["t_comm_us"])
        row["t_ideal_us"] = none["t_layer_us"] - hideable
        row["speedup_vs_none"] = none["t_layer_us"] / row["t_layer_us"]
        row["efficiency"] = (none["t_layer_us"] - row["t_layer_us"]) / hideable if hideable > 0 else None
    return rows


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
            spans[mode] = profile_spans(
                lambda: layer(x_TH), device, rank, f"{trace_prefix}.{mode}.json" if trace_prefix else None
            )
        layer.overlap = make_overlap("none", device)
    return spans


# ---- command line --------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench sbo``: every expert count x dispatcher x token count, each mode's rows."""
    sweep = prepare(args)
    ranks = sweep.ranks.count
    sweep.check_memory(max(args.tokens))
    steps = []
    for n, d, t in ((n, d, t) for n in sweep.experts for d in sweep.dispatchers for t in args.tokens):
        spec = sweep.spec(n, d, sweep.modes)
        fields = {"num_experts": n, "experts_per_gpu": n // ranks, "dispatcher": d, "tokens_per_rank": t}
        summary = functools.partial(summarise, spec=spec, ep=ranks)
        steps.append(Step(f"E={n} {d} T={t}", sbo_bench_rank, (spec, t), summary, {**fields, "wire": args.wire}))

    def report(rows: list[dict], meta: dict) -> None:
        console = sweep.ranks.console
        console.print(sbo_summary_table(rows))
        print_notes(console, *summary_legend(rows))
        if args.detail:
            console.print(sbo_table(rows))
            print_notes(console, sbo_legend(rows))
        print_notes(console, cpu_timing_note(sweep.ranks.device))

    return sweep.run("sbo", steps, report, best_modes, draw=functools.partial(_timeline, sweep))


def _timeline(sweep: Sweep, pool) -> None:
    """Profile one forward per mode of the first expert count, per dispatcher; draw the lanes, keep the traces."""
    args = sweep.args
    size = args.timeline_tokens or max([t for t in args.tokens if t <= 4096] or [min(args.tokens)])
    spans = {}
    for dispatcher in sweep.dispatchers:
        spec = sweep.spec(sweep.experts[0], dispatcher, sweep.modes)
        per_mode = pool.run(in_ranks(timeline_rank), spec, size, args.trace)[0]
        spans.update({f"{dispatcher} / {mode}": s for mode, s in per_mode.items()})
    title = f"{args.preset}, EP{sweep.ranks.count}, {size} tokens/rank, {sweep.ranks.device}"
    draw_timeline(args, spans, title, "<case>.json", sweep.ranks.console)


def sbo_table(rows: list[dict]) -> Table:
    """The SBO rows as a table that fits 100 columns: ``t_ideal_us`` is left out (it is
    ``t_none - min(shared, comm)``), and CUDA-graph rows are marked ``*`` after the mode."""
    columns = [("E/GPU", "right"), ("tokens", "right"), ("dispatcher", "left"), ("overlap", "left")]
    columns += [(title, "right") for title, _ in TIMES] + [("× none", "right"), ("efficiency", "right")]
    table = make_table("single-batch overlap (µs: slowest rank, median)", columns, optional=("shared", "comm"))
    for row in rows:
        head = (str(row.get("experts_per_gpu", "")), str(row.get("tokens_per_rank", "")), row.get("dispatcher", ""))
        if "error" in row:
            table.add_row(*head, "[red]error[/]", *[""] * (len(columns) - 4))
            continue
        efficiency = row["efficiency"]
        table.add_row(
            *head,
            row["overlap"] + ("*" if row["graph"] else ""),
            *(compact(row[key]) for _, key in TIMES),
            f"{row['speedup_vs_none']:.2f}",
            "-" if efficiency is None else f"{efficiency:.2f}",
        )
    return table


# (header, field) of the time columns; "shared" and "comm" are each alone, without the rest of the layer.
TIMES = [
    ("layer", "t_layer_us"),
    ("dispatch", "t_dispatch_us"),
    ("routed", "t_routed_us"),
    ("combine", "t_combine_us"),
    ("shared", "t_shared_us"),
    ("comm", "t_comm_us"),
]


def sbo_legend(rows: list[dict]) -> str:
    """The line under the table: what the derived columns mean."""
    legend = "× none: t(none)/t; efficiency: (t(none) - t)/min(shared, comm); shared, comm: alone"
    if any(row.get("graph") for row in rows):
        legend += "; *: CUDA graph"
    return legend


def summary_legend(rows: list[dict]) -> list[str]:
    """The lines under the summary table: what its columns mean."""
    graph = "; *: CUDA-graph replays" if any(row.get("graph") for row in rows) else ""
    return [
        f"each mode: t(none)/t, > 1 is faster than none{graph}; every phase: --detail",
        "GB/s: bytes a rank sent / its dispatch + combine time, overlap none",
    ]


def gbps(value: float | None) -> str:
    """A bandwidth in at most 6 characters: 3 significant digits, 2 under 1 GB/s ("-" for None)."""
    if value is None:
        return "-"
    return f"{value:.3g}" if value >= 1 else f"{value:.2g}"


def sbo_summary_table(rows: list[dict]) -> Table:
    """One line per expert count, token count and dispatcher (and CUDA graph or not, marked ``*``): the
    layer time with overlap ``none``, each other mode's speedup over it, and the algorithmic GB/s of
    its dispatch and combine. Narrow: about 80 columns with every mode."""
    modes = list(dict.fromkeys(r["overlap"] for r in rows if "error" not in r and r["overlap"] != "none"))
    columns = [("E/GPU", "right"), ("tokens", "right"), ("dispatcher", "left"), ("none µs", "right")]
    columns += [(mode, "right") for mode in modes] + [("GB/s", "right")]
    table = make_table("single-batch overlap: layer time and speedup over none (slowest rank)", columns)
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = (row.get("experts_per_gpu", ""), row.get("tokens_per_rank", ""), row.get("dispatcher", ""))
        groups.setdefault((*key, bool(row.get("graph"))), {})[row.get("overlap", "error")] = row
    for (experts, tokens, dispatcher, graph), by_mode in groups.items():
        head = (str(experts), str(tokens), dispatcher + ("*" if graph else ""))
        none = by_mode.get("none")
        if none is None or "error" in none:
            table.add_row(*head, "[red]error[/]", *[""] * (len(columns) - 4))
            continue
        speedups = [f"{by_mode[m]['speedup_vs_none']:.2f}" if m in by_mode else "-" for m in modes]
        table.add_row(*head, compact(none["t_layer_us"]), *speedups, gbps(none.get("comm_GBps")))
    return table


def best_modes(rows: list[dict]) -> list[str]:
    """The sweep's conclusion, a line per expert count: at each token count, the fastest dispatcher and
    overlap mode (``dispatcher/mode``), and that mode's gain over ``none`` with the same dispatcher."""
    fastest: dict[int, dict[int, dict]] = {}
    for row in rows:
        if "error" in row:
            continue
        at = fastest.setdefault(row["experts_per_gpu"], {})
        tokens = row["tokens_per_rank"]
        if tokens not in at or row["t_layer_us"] < at[tokens]["t_layer_us"]:
            at[tokens] = row
    lines = []
    for experts, at in fastest.items():
        parts = []
        for tokens, row in at.items():
            what = f"{row['dispatcher']}/{row['overlap']}{'*' if row['graph'] else ''}"
            gain = f"{row['speedup_vs_none']:.2f}x none" if row["overlap"] != "none" else "no mode beats none"
            parts.append(f"{tokens} tokens {what} {gain}")
        head = "best" if len(fastest) == 1 else f"best at {experts} experts/GPU"
        lines.append(f"{head}: {'; '.join(parts)}")
    return lines or ["best: nothing measured (every step failed)"]

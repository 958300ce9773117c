"""``moe-sbo bench eplb``: expert load balancing measured on a skewed router.

Per (expert count, dispatcher, tokens per rank), on every rank of the EP group, for each
``--redundant`` count (extra expert slots per rank), on one layer with ``eplb=EPLBOptions(...)``:

1. the router is skewed to the ``--skew`` load (``routing.skew``: a gate-logit bias calibrated on a
   sample batch drawn alike on every rank; rank 0's bias is broadcast, so every rank routes alike);
2. ``layer_ms_before``: the layer's median eager time on this rank's tokens (overlap none);
3. ``load_max_over_mean_before``: the rank load measured from the physical slot ids the routing
   produces on held-out tokens: expert rows per destination rank, summed over the ranks, max / mean;
4. ``FILL_FORWARDS`` forwards of fresh tokens fill the load window, then ``rebalance`` computes the
   policy's placement from it and moves the experts (``t_rebalance_ms``: the group's time, the ranks
   lined up before and after), and ``moved_slots`` / ``moved_bytes`` say what travelled;
5. the same measurements after: ``load_max_over_mean_after``, ``layer_ms_after``.

Beside each measured balance the predicted one, ``Placement.balance`` of the window's load under the
placement before and after (``predicted_max_over_mean_before`` / ``_after``). On CUDA with a dispatcher
a graph can capture (``low_latency``, or ``local`` on one rank), ``eplb_overhead``: the layer replayed
from a CUDA graph with ``eplb=EPLBOptions()`` over the same layer without, minus 1: what counting the
load and mapping logical ids to replicas costs (the target is <= 1 % at 128 tokens per rank). Beside
it, measured directly because two layer timings on ranks sharing a GPU differ by more than the
statistics cost: ``t_stats_graph_us``, the statistics step alone (``route_to_slots``: counting and
replica choice), ``STATS_REPEAT`` of them captured in one graph, per step (one step per replay would
time the graph's launch latency instead), and ``stats_share`` = that / the plain layer's time.

The hard part is measuring balance honestly: the placement is fitted to the window's tokens, so
measuring on those would flatter it. The balance is measured on held-out tokens of the same
distribution, the same ones before and after; the fit's own view is the predicted column.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import MoEConfig
from ..dispatch import DISPATCHERS
from ..eplb import placement_for
from ..eplb.runtime import EPLBOptions, route_to_slots
from ..eplb.transfer import all_reduce_load
from ..layer import MoELayer
from ..measure.options import TargetLoad, cpu_timing_note, make_table, print_notes, target_load, write_load_file
from ..measure.run import output_path
from ..measure.timing import line_up, time_fn
from ..planner import nodes_for
from ..routing.skew import SkewFit, skew_router
from .common import bench_config, dispatcher_options, make_layer, row_head
from .sweep import Step, prepare

FILL_FORWARDS = 32  # forwards of fresh tokens that fill the load window before a rebalance
MEASURE_TOKENS = 4096  # held-out tokens per rank the rank load is measured on, in batches of the case's size
CALIBRATION_TOKENS = 4096  # the sample batch the router's skew is calibrated on (the same on every rank)
# The statistics' cost, in each row (None off CUDA or for a dispatcher no graph captures).
OVERHEAD_FIELDS = (
    "t_layer_graph_us_plain",
    "t_layer_graph_us_eplb",
    "t_stats_graph_us",
    "eplb_overhead",
    "stats_share",
)
STATS_REPEAT = 32  # statistics steps in the graph that times them alone
OVERHEAD_ROUNDS = 5  # alternating graph timings of the layer without and with eplb; the medians are compared
DEFAULT_SKEW = "zipf:1"


@dataclass(frozen=True)
class EplbSetup:
    """``bench eplb``'s options, resolved and checked before any rank starts: the redundant counts, the
    policy, the nodes hierarchical placement assumes, the load per expert count, the load file to write."""

    redundant: list[int]
    policy: str
    num_nodes: int
    targets: dict[int, TargetLoad]
    record_load: Path | None


def resolve_eplb(args: argparse.Namespace, ranks: int, experts_list: list[int]) -> EplbSetup:
    """The mode's own options checked (``ValueError`` naming the option and the fix)."""
    policy = args.policy or "global"
    if args.redundant is not None:
        redundant = args.redundant
    else:  # replicas need a load to choose them (trivial) and another rank to live on
        redundant = [0] if policy == "trivial" or ranks == 1 else [0, 1, 2]
    bad = next((r for r in redundant if r < 0), None)
    if bad is not None:
        raise ValueError(f"--redundant must be >= 0 (extra expert slots per rank), got {bad}; e.g. --redundant 0 1 2")
    if args.record_load and len(experts_list) > 1:
        raise ValueError(
            f"--record-load writes the load of one expert count, got --experts {' '.join(map(str, experts_list))}; "
            "give one --experts value"
        )
    num_nodes = nodes_for(ranks)
    targets = {}
    for num_experts in experts_list:
        cfg = bench_config(args.preset, num_experts)
        targets[num_experts] = target_load(args.skew or DEFAULT_SKEW, num_experts, cfg.name)
        ones_E = torch.ones(num_experts, dtype=torch.float64)
        for extra in dict.fromkeys(redundant):
            try:  # the placements a rebalance may compute must exist for these sizes
                placement_for(policy, ones_E, ranks, extra, num_nodes=num_nodes, num_groups=cfg.n_group)
            except ValueError as err:
                raise ValueError(
                    f"--redundant {extra} with --policy {policy} on {ranks} ranks and {num_experts} experts cannot "
                    f"be placed: {err}"
                ) from None
    return EplbSetup(
        list(dict.fromkeys(redundant)), policy, num_nodes, targets, output_path("--record-load", args.record_load)
    )


# ---- on every rank -------------------------------------------------------------------------------


def _batch(cfg: MoEConfig, tokens: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(dtype)


def received_rows(layer: MoELayer, batches) -> torch.Tensor:
    """``[P]`` int64: the expert rows each rank of the EP group receives when every rank routes its
    ``batches`` (an iterable of ``[T, H]``): the router's picks mapped to physical slots as the layer
    maps them, counted by the slot's rank, summed over the ranks (a collective)."""
    placement = layer.placement
    assert placement is not None, "a layer built with eplb"
    slots, world = placement.slots_per_rank, placement.num_ranks
    counts_P = torch.zeros(world, dtype=torch.int64, device=layer.router.weight.device)
    for x_TH in batches:
        slot_ids_TK = layer.replicas.to_physical(layer.router(x_TH).topk_ids_TK)
        destination = (slot_ids_TK // slots).flatten()
        counts_P.index_add_(0, destination, torch.ones_like(destination))
    return all_reduce_load(counts_P, layer.dispatcher.ep.group)


def max_over_mean(counts: torch.Tensor) -> float:
    mean = float(counts.double().mean())
    return float(counts.max()) / mean if mean > 0 else 1.0


def skew_alike(layer: MoELayer, target: list[float], seed: int) -> tuple[SkewFit, torch.Tensor]:
    """Calibrate ``layer``'s router to ``target`` (a load per expert) on ``CALIBRATION_TOKENS`` tokens
    drawn from ``seed`` alike on every rank; rank 0's bias is broadcast (every rank must route alike,
    and a GPU's reductions may differ from another's) -> (the fit, the bias). A collective."""
    device = layer.router.weight.device
    sample_TH = _batch(layer.cfg, CALIBRATION_TOKENS, seed * 7919 + 104_729, device, torch.float32)
    fit = skew_router(layer.router, sample_TH, torch.tensor(target, dtype=torch.float64))
    bias_E = layer.router.logit_bias
    assert bias_E is not None, "skew_router sets the logit bias"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(bias_E, src=0)
    return fit, bias_E.clone()


def _captures(spec: dict, world: int) -> bool:
    """Whether ``spec``'s dispatcher can be replayed from a CUDA graph on ``world`` ranks."""
    return DISPATCHERS[spec["dispatcher"]].graph_capturable or (spec["dispatcher"] == "local" and world == 1)


def statistics_overhead(make, spec: dict, x_TH: torch.Tensor) -> tuple[SkewFit, torch.Tensor, dict]:
    """What the load statistics cost: the layer replayed from a CUDA graph with ``eplb=EPLBOptions()``
    and without (``make(eplb)`` builds one), skewed alike, ``OVERHEAD_ROUNDS`` alternating medians
    each -> (the skew's fit, its bias, the timings and ``eplb_overhead`` = with / without - 1), and the
    statistics step alone replayed (``t_stats_graph_us`` per step, ``stats_share`` of the plain layer)."""
    device, warmup, iters = x_TH.device, spec["warmup"], spec["iters"]
    layers = {"plain": make(None), "eplb": make(EPLBOptions())}
    fit, bias_E = skew_alike(layers["plain"], spec["target"], spec["seed"])
    with_eplb = layers["eplb"]
    with_eplb.router.logit_bias = bias_E.clone()
    ids_TK = with_eplb.router(x_TH).topk_ids_TK

    def stats_steps() -> torch.Tensor:
        for _ in range(STATS_REPEAT - 1):
            route_to_slots(ids_TK, with_eplb.load_window, with_eplb.replicas)
        return route_to_slots(ids_TK, with_eplb.load_window, with_eplb.replicas)

    times: dict[str, list[float]] = {"plain": [], "eplb": [], "stats": []}
    for _ in range(OVERHEAD_ROUNDS):
        for name, layer in layers.items():
            times[name].append(time_fn(functools.partial(layer, x_TH), device, warmup, iters, True))
        times["stats"].append(time_fn(stats_steps, device, warmup, iters, True) / STATS_REPEAT)
    plain_us, eplb_us, stats_us = (statistics.median(times[name]) for name in ("plain", "eplb", "stats"))
    overhead = {"t_layer_graph_us_plain": plain_us, "t_layer_graph_us_eplb": eplb_us, "t_stats_graph_us": stats_us}
    return fit, bias_E, {**overhead, "eplb_overhead": eplb_us / plain_us - 1, "stats_share": stats_us / plain_us}


def eplb_bench_rank(device: torch.device, spec: dict, tokens: int) -> list[dict]:
    """One rank's rows for one (expert count, dispatcher, tokens per rank): one per redundant count.
    Run on every rank."""
    cfg = bench_config(spec["preset"], spec["num_experts"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype = getattr(torch, spec["dtype"])
    warmup, iters = spec["warmup"], spec["iters"]
    base_seed = spec["seed"] * 7919 + rank * 131 + tokens
    x_TH = _batch(cfg, tokens, base_seed, device, dtype)
    held_out = max(1, -(-MEASURE_TOKENS // tokens))

    def held_out_batches():
        return (_batch(cfg, tokens, base_seed + 1_000_003 * (i + 1), device, dtype) for i in range(held_out))

    def make(eplb: EPLBOptions | None) -> MoELayer:
        return make_layer(device, spec, dispatcher_options(spec, tokens), eplb=eplb)

    rows = []
    fit: SkewFit | None = None
    bias_E: torch.Tensor | None = None
    overhead: dict = dict.fromkeys(OVERHEAD_FIELDS)
    graph = device.type == "cuda" and spec["graph"] and tokens <= spec["graph_max_tokens"] and _captures(spec, world)
    with torch.no_grad():
        if graph:
            try:
                fit, bias_E, overhead = statistics_overhead(make, spec, x_TH)
            except RuntimeError as err:
                if world > 1:  # the peers met the same capture: the step fails as one
                    raise
                # One rank (local): its capture is not the dispatcher's promise; keep the eager rows.
                overhead["eplb_overhead_error"] = f"{type(err).__name__}: {str(err)[:300]}"
            torch.cuda.empty_cache()
        for redundant in spec["redundant"]:
            eplb = EPLBOptions(
                redundant_per_rank=redundant, policy=spec["policy"], window=FILL_FORWARDS, num_nodes=spec["num_nodes"]
            )
            layer = make(eplb)
            if bias_E is None:
                fit, bias_E = skew_alike(layer, spec["target"], spec["seed"])
            else:
                layer.router.logit_bias = bias_E.clone()
            assert fit is not None
            layer_us_before = time_fn(functools.partial(layer, x_TH), device, warmup, iters, False)
            before = received_rows(layer, held_out_batches())
            for i in range(FILL_FORWARDS):  # every row of the window: the timed forwards' counts are gone
                layer(_batch(cfg, tokens, base_seed + 7 * (i + 1), device, dtype))
            load_E = layer.expert_load(all_ranks=True).double().cpu()
            placement_before = layer.placement
            assert placement_before is not None, "a layer built with eplb"
            line_up(device)
            started = time.perf_counter()
            report = layer.rebalance()
            line_up(device)  # the whole group's time: the slowest rank's transfer and writes included
            t_rebalance_ms = (time.perf_counter() - started) * 1e3
            after = received_rows(layer, held_out_batches())
            placement_after = layer.placement
            assert placement_after is not None, "a layer built with eplb"
            layer_us_after = time_fn(functools.partial(layer, x_TH), device, warmup, iters, False)
            rows.append(
                {
                    "rank": rank,
                    "tokens": tokens,
                    "redundant_per_rank": redundant,
                    "slots_per_rank": placement_after.slots_per_rank,
                    "load_max_over_mean_before": max_over_mean(before),
                    "load_max_over_mean_after": max_over_mean(after),
                    "predicted_max_over_mean_before": placement_before.balance(load_E),
                    "predicted_max_over_mean_after": placement_after.balance(load_E),
                    "received_rows_before": before.tolist(),
                    "received_rows_after": after.tolist(),
                    "moved_slots": report.moved_slots,
                    "moved_bytes": report.moved_bytes,
                    "sent_bytes": report.sent_bytes,
                    "local_copies": report.local_copies,
                    "t_rebalance_ms": t_rebalance_ms,
                    "layer_ms_before": layer_us_before / 1e3,
                    "layer_ms_after": layer_us_after / 1e3,
                    "skew_reached": fit.reached,
                    "skew_target_max_over_mean": fit.target_max_over_mean,
                    "skew_measured_max_over_mean": fit.measured_max_over_mean,
                    "skew_most_reachable_max_over_mean": fit.most_reachable_share * cfg.num_experts,
                    "window_load": load_E.tolist(),
                    **overhead,
                }
            )
            del layer
    return rows


# ---- rows and table ------------------------------------------------------------------------------


def summarise_eplb(per_rank: list[list[dict]], spec: dict, ep: int, loads: list[list[float]]) -> list[dict]:
    """One row per redundant count: the group's balance (every rank measured the same all-reduced
    counts), the slowest rank's times, what moved. Appends the step's window load (one per step: every
    redundant count saw the same tokens) to ``loads``, for ``--record-load``."""
    rows: list[dict] = []
    for rank_rows in zip(*per_rank):
        first = rank_rows[0]
        if not rows:
            loads.append(first["window_load"])
        rows.append(
            {
                **row_head("eplb", spec, ep),
                "tokens_per_rank": first["tokens"],
                "policy": spec["policy"],
                "num_nodes": spec["num_nodes"],
                "skew": spec["skew"],
                "redundant_per_rank": first["redundant_per_rank"],
                "slots_per_rank": first["slots_per_rank"],
                **{k: first[k] for k in first if k.startswith(("load_max", "predicted_", "received_rows", "skew_"))},
                "moved_slots": first["moved_slots"],
                "moved_bytes": first["moved_bytes"],
                "sent_bytes_per_rank": [r["sent_bytes"] for r in rank_rows],
                "local_copies": sum(r["local_copies"] for r in rank_rows),
                "t_rebalance_ms": max(r["t_rebalance_ms"] for r in rank_rows),
                "layer_ms_before": max(r["layer_ms_before"] for r in rank_rows),
                "layer_ms_after": max(r["layer_ms_after"] for r in rank_rows),
                "layer_ms_before_per_rank": [round(r["layer_ms_before"], 3) for r in rank_rows],
                "layer_ms_after_per_rank": [round(r["layer_ms_after"], 3) for r in rank_rows],
                "window_forwards": FILL_FORWARDS,
                "measure_tokens_per_rank": max(1, -(-MEASURE_TOKENS // first["tokens"])) * first["tokens"],
                **_slowest_overhead(rank_rows),
            }
        )
        if "eplb_overhead_error" in first:  # one rank, a capture that failed: why the column is empty
            rows[-1]["eplb_overhead_error"] = first["eplb_overhead_error"]
        rows[-1]["speedup_layer"] = rows[-1]["layer_ms_before"] / rows[-1]["layer_ms_after"]
        # Algorithmic GB/s of the rebalance: the most bytes a rank sent / the group's time.
        sent = max(rows[-1]["sent_bytes_per_rank"])
        rows[-1]["rebalance_GBps"] = sent / rows[-1]["t_rebalance_ms"] / 1e6 if sent else None
    return rows


def _slowest_overhead(rank_rows: tuple[dict, ...]) -> dict:
    """The graph timings of the slowest rank (None off CUDA or for a dispatcher no graph captures)."""
    if rank_rows[0]["t_layer_graph_us_plain"] is None:
        return dict.fromkeys(OVERHEAD_FIELDS)
    plain = max(r["t_layer_graph_us_plain"] for r in rank_rows)
    with_eplb = max(r["t_layer_graph_us_eplb"] for r in rank_rows)
    stats_us = max(r["t_stats_graph_us"] for r in rank_rows)
    return {
        "t_layer_graph_us_plain": plain,
        "t_layer_graph_us_eplb": with_eplb,
        "t_stats_graph_us": stats_us,
        "eplb_overhead": with_eplb / plain - 1,
        "stats_share": stats_us / plain,
    }


def eplb_table(rows: list[dict]) -> Table:
    """The rows as a table that fits 100 columns."""
    columns = [("E/GPU", "right"), ("dispatcher", "left"), ("tokens", "right"), ("+slots", "right")]
    columns += [("before", "right"), ("after", "right"), ("pred.", "right"), ("moved", "right"), ("MB", "right")]
    columns += [("rebal. ms", "right"), ("layer ms", "right"), ("after", "right"), ("stats", "right")]
    first = next((r for r in rows if "error" not in r), {})
    title = "expert load balancing: rank load max/mean, measured (slowest rank's times, median)"
    if first:
        title = f"expert load balancing, {first['policy']}, skew {first['skew']}: rank load max/mean, measured"
    table = make_table(title, columns)
    for r in rows:
        head = (str(r.get("experts_per_gpu", "")), r.get("dispatcher", ""), str(r.get("tokens_per_rank", "")))
        if "error" in r:
            table.add_row(*head, "[red]error[/]", *[""] * (len(columns) - 4))
            continue
        overhead, share = r["eplb_overhead"], r.get("stats_share")
        table.add_row(
            *head,
            str(r["redundant_per_rank"]),
            f"{r['load_max_over_mean_before']:.2f}",
            f"{r['load_max_over_mean_after']:.2f}",
            f"{r['predicted_max_over_mean_after']:.2f}",
            str(r["moved_slots"]),
            f"{r['moved_bytes'] / 1e6:.3g}",
            f"{r['t_rebalance_ms']:.3g}",
            f"{r['layer_ms_before']:.3g}",
            f"{r['layer_ms_after']:.3g}",
            "-" if overhead is None else f"{overhead:+.1%}" + ("" if share is None else f" ({share:.1%})"),
        )
    return table


def eplb_notes(rows: list[dict]) -> list[str]:
    """The lines under the table: the columns, then how close the router came to the skew asked for."""
    notes = [
        "before, after: max/mean of the expert rows each rank receives (held-out tokens); pred.: the",
        "placement's balance on the window's load; moved: slots that changed rank; MB: their bytes;",
        "stats: CUDA-graph layer with eplb=EPLBOptions() / without - 1 (CUDA, graph-capturable dispatchers);",
        "in brackets the statistics step alone, replayed, as a share of the layer without",
    ]
    seen = set()
    for r in rows:
        if "error" in r or (r["num_experts"], r["skew"]) in seen:
            continue
        seen.add((r["num_experts"], r["skew"]))
        notes.append(
            f"skew {r['skew']} on {r['num_experts']} experts: {r['skew_reached']:.0%} reached; hottest expert "
            f"{r['skew_measured_max_over_mean']:.2f}x the mean (asked {r['skew_target_max_over_mean']:.2f}x, "
            f"at most {r['skew_most_reachable_max_over_mean']:.3g}x)"
        )
    return notes


# ---- command line --------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench eplb``: every expert count x dispatcher x token count, a row per redundant count."""
    sweep = prepare(args)
    device, ranks = sweep.ranks.device, sweep.ranks.count
    eplb = resolve_eplb(args, ranks, sweep.experts)
    # On CUDA a rank holds two layers at once (with and without statistics, for their overhead), the
    # largest with its redundant slots.
    sweep.check_memory(max(args.tokens), layers=2 if device == "cuda" else 1, redundant=max(eplb.redundant))
    loads: list[list[float]] = []  # each step's window load, for --record-load
    steps = []
    for n, d, t in ((n, d, t) for n in sweep.experts for d in sweep.dispatchers for t in args.tokens):
        spec = {
            **sweep.spec(n, d, ["none"]),
            "redundant": eplb.redundant,
            "policy": eplb.policy,
            "num_nodes": eplb.num_nodes,
            "target": eplb.targets[n].load,
            "skew": eplb.targets[n].label,
        }
        fields = {"num_experts": n, "dispatcher": d, "tokens_per_rank": t, "wire": args.wire}
        summary = functools.partial(summarise_eplb, spec=spec, ep=ranks, loads=loads)
        steps.append(Step(f"E={n} {d} T={t}", eplb_bench_rank, (spec, t), summary, fields))
    meta = {
        "policy": eplb.policy,
        "redundant": eplb.redundant,
        "skew": sorted({t.label for t in eplb.targets.values()}),
        "eplb_window_forwards": FILL_FORWARDS,
        "eplb_measure_tokens": MEASURE_TOKENS,
        "timing": "layer_ms: median of CUDA events (host clock on CPU) of eager forwards, ranks lined up "
        "between forwards, the slowest rank's; t_rebalance_ms: host clock, ranks lined up before and after; "
        "eplb_overhead: medians of CUDA-graph replays",
    }

    def report(rows: list[dict], file_meta: dict) -> None:
        sweep.ranks.console.print(eplb_table(rows))
        print_notes(sweep.ranks.console, *eplb_notes(rows), cpu_timing_note(device))
        if eplb.record_load is not None:
            _record_load(eplb, loads, args, file_meta, sweep.ranks.console)

    return sweep.run("eplb", steps, report, best_balance, meta=meta)


def best_balance(rows: list[dict]) -> list[str]:
    """The sweep's conclusion, a line per expert count: at each token count, the best balance a
    rebalance reached (rank load max/mean before and after, the redundant slots and dispatcher that
    reached it) and the layer's speedup there."""
    best: dict[int, dict[int, dict]] = {}
    for row in rows:
        if "error" in row:
            continue
        at = best.setdefault(row["experts_per_gpu"], {})
        tokens = row["tokens_per_rank"]
        if tokens not in at or row["load_max_over_mean_after"] < at[tokens]["load_max_over_mean_after"]:
            at[tokens] = row
    lines = []
    for experts, at in best.items():
        parts = [
            f"{tokens} tokens {r['dispatcher']} +{r['redundant_per_rank']} slots: load max/mean "
            f"{r['load_max_over_mean_before']:.2f} -> {r['load_max_over_mean_after']:.2f}, "
            f"layer {r['speedup_layer']:.2f}x"
            for tokens, r in at.items()
        ]
        head = "best balance" if len(best) == 1 else f"best balance at {experts} experts/GPU"
        lines.append(f"{head}: {'; '.join(parts)}")
    return lines or ["best balance: nothing measured (every step failed)"]


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

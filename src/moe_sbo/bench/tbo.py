"""``moe-sbo bench tbo``: the decoder layer (attention + MoE) with and without two-batch overlap.

Per regime and size, on every rank, the same layer and inputs run as: every SBO mode asked for,
each without TBO and with TBO at every stage delay of ``--delay`` (``none`` without TBO is the
baseline). Prefill: packed sequences of
1024-4096 tokens (drawn from the seed) filling ``--prefill-tokens`` per rank. Decode: ``--decode-seqs``
sequences per rank, one new token each, attending to ``--kv-len`` cached tokens; timed as CUDA-graph
replays when the dispatcher can be captured. Times are the slowest rank's medians;
``speedup_vs_none`` is against the baseline of the same size.

Every row also carries the size's physical references, measured once per size on the layer without
TBO: ``t_floor_us`` (attention, router, routed experts and shared experts of the whole batch, each
alone), ``t_wire_us`` (raw NCCL ``all_to_all_single`` of each phase's bytes, with peers), and
``limit_ratio`` = ``t_layer_us`` / max(the two): how far the row is from what any overlap could reach.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from rich.table import Table

from ..config import get_preset
from ..decoder.attention import AttentionConfig, Batch, KVCache
from ..decoder.decoder_layer import DecoderLayer
from ..decoder.micro_batches import split_batch
from ..dispatch import Dispatcher
from ..measure.options import compact, cpu_timing_note, in_ranks, make_table, print_notes
from ..measure.timing import time_fn
from ..overlap import make_overlap
from ..overlap.auto import bucket_of
from ..overlap.tbo import resolve_gemm_sm_budget, tbo_forward
from ..overlap.tbo_auto import AutoTbo
from ..streams import check_sm_budget
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


def prefill_lengths(tokens: int, seed: int, shortest: int = 1024, longest: int = 4096) -> list[int]:
    """Sequence lengths in ``[shortest, longest]`` summing to ``tokens`` (the last one takes the rest)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(shortest, longest), tokens - sum(lengths)))
    return lengths


def _decoder(device: torch.device, spec: dict, capacity: int) -> DecoderLayer:
    options = dispatcher_options(spec, capacity)
    key = (*layer_key("decoder", spec, options), spec["heads"], spec["kv_heads"], spec["head_dim"])

    def make() -> DecoderLayer:
        moe = make_layer(device, spec, options)
        attn = AttentionConfig(moe.cfg.hidden_size, spec["heads"], spec["kv_heads"], spec["head_dim"])
        return DecoderLayer(attn, moe, seed=spec["seed"])

    return cached(key, make, device)


def _tbo_dispatcher(layer: DecoderLayer, spec: dict, batch: Batch) -> tuple[Dispatcher | None, int | None]:
    """The dispatcher two-batch overlap runs ``batch``'s micro-batches with, on ``layer``'s weights ->
    (dispatcher, its capacity); (None, None) when the scheme has no fixed capacity (the layer's own
    serves). A fixed-capacity one is sized for the larger micro-batch of any rank, as a deployment
    sizes it: its blocks are capacity-sized on the wire, so a whole-batch capacity would send each
    half the whole batch's bytes."""
    split = split_batch(batch)
    half = max(split.a.stop - split.a.start, split.b.stop - split.b.start)
    options = dispatcher_options(spec, half)
    if "max_tokens_per_rank" not in options:
        return None, None
    if dist.is_initialized():  # every rank's buffers must be alike: the largest micro-batch of any rank
        larger = torch.tensor([half], device=layer.moe.router.weight.device)
        dist.all_reduce(larger, op=dist.ReduceOp.MAX)
        half = int(larger.item())
        options = dispatcher_options(spec, half)
    return layer.moe.sibling_dispatcher(**options), half


def _forward(
    layer: DecoderLayer, x_TH: torch.Tensor, batch: Batch, cache: KVCache, spec: dict, tbo_dispatcher, delay
) -> torch.Tensor:
    """One forward of ``layer`` as the bench runs it: without TBO (``delay`` None), or with TBO at
    ``delay`` on ``tbo_dispatcher`` (``_tbo_dispatcher``'s) and ``--tbo-gemm-sm-budget``."""
    if delay is None:
        return layer(x_TH, batch, cache)
    gemm_sm_budget = spec.get("tbo_gemm_sm_budget", "auto")
    return tbo_forward(layer, x_TH, batch, cache, delay=delay, gemm_sm_budget=gemm_sm_budget, dispatcher=tbo_dispatcher)


def decoder_floor_and_wire(
    layer: DecoderLayer, x_TH: torch.Tensor, batch: Batch, cache: KVCache, spec: dict
) -> dict[str, float]:
    """The decoder layer's physical references on one rank: ``t_floor_attention_us`` (norm and
    attention alone, a CUDA-graph replay on GPUs) and the MoE's ``floor_and_wire`` on the tokens
    attention hands it (router, routed experts, shared experts, each alone; raw NCCL on each phase's
    bytes, with peers). Whole-batch work: what two micro-batches must do between them."""
    device, warmup, iters = x_TH.device, spec["warmup"], spec["iters"]

    def attention() -> torch.Tensor:
        return layer.attention(layer.input_norm(x_TH), batch, cache)

    out = {"t_floor_attention_us": time_fn(attention, device, warmup, iters, device.type == "cuda")}
    moe_x_TH = layer.post_attention_norm(x_TH + attention())
    moe = floor_and_wire(layer.moe, moe_x_TH, layer.moe.router(moe_x_TH), warmup, iters, spec["seed"])
    # Not the whole batch's ``expert_path``: TBO's micro-batches hand the experts other row counts and
    # may run other GEMMs, so the rows do not record one path for both.
    out.update({key: float(value) for key, value in moe.items() if key != "expert_path"})
    return out


def tbo_bench_rank(device: torch.device, spec: dict, regime: str, size: int) -> list[dict]:
    """One rank's rows for one (regime, size): every SBO mode without and with TBO."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if regime == "prefill":
        lengths = prefill_lengths(size, spec["seed"] + rank)
        batch = Batch.prefill(lengths, device=device)
        layer = _decoder(device, spec, size)
        cache = layer.make_cache(len(lengths), max(lengths))
        graph = False
    else:
        positions = torch.full((size,), spec["kv_len"], dtype=torch.int64, device=device)
        batch = Batch.decode_step(0, positions)
        layer = _decoder(device, spec, size)
        cache = layer.make_cache(size, spec["kv_len"] + 1)
        graph = device.type == "cuda" and spec["graph"] and layer.moe.dispatcher.graph_capturable
    tbo_dispatcher, half = _tbo_dispatcher(layer, spec, batch)
    # The SMs TBO's GEMMs plan for, as tbo_forward resolves --tbo-gemm-sm-budget (recorded in TBO rows).
    gemm_sm_budget = resolve_gemm_sm_budget(
        spec.get("tbo_gemm_sm_budget", "auto"), tbo_dispatcher or layer.moe.dispatcher, device
    )
    dtype = getattr(torch, spec["dtype"])
    generator = torch.Generator(device=device).manual_seed(spec["seed"] * 31 + rank)
    x_TH = torch.randn(batch.num_tokens, layer.attn_cfg.hidden_size, generator=generator, device=device).to(dtype)
    rows = []
    with torch.inference_mode():
        limits = decoder_floor_and_wire(layer, x_TH, batch, cache, spec)
        for mode in spec["modes"]:
            layer.moe.overlap = make_overlap(mode, device, sm_budget=spec["sm_budget"])

            # Without TBO once, then with TBO at every stage delay asked for (delay None: no TBO), then
            # (--auto-tbo) as AutoTbo chooses, once it has timed both: the first delay, each candidate
            # with the dispatcher its fixed row uses.
            def forward(use_tbo: bool, delay: int | None = spec["delays"][0]) -> torch.Tensor:
                return _forward(layer, x_TH, batch, cache, spec, tbo_dispatcher, delay if use_tbo else None)

            auto = AutoTbo() if spec.get("auto_tbo") else None
            for delay in (None, *spec["delays"], *(("auto",) if auto else ())):
                step: Callable[[], torch.Tensor]
                if delay == "auto":
                    assert auto is not None
                    # Every rank runs `size` tokens: an agreed count. Explore first, untimed.
                    step = functools.partial(
                        auto.run, forward, agreed_tokens=batch.num_tokens, ep=layer.moe.dispatcher.ep, device=device
                    )
                    while not auto.decided(batch.num_tokens):
                        step()
                    chosen = spec["delays"][0] if auto.choices[bucket_of(batch.num_tokens)] else None
                else:
                    step = functools.partial(forward, delay is not None, delay)
                    chosen = delay
                t = time_fn(step, device, spec["warmup"], spec["iters"], graph)
                rows.append(
                    {
                        "rank": rank,
                        **resolved_path(layer.moe.dispatcher, device),
                        "regime": regime,
                        "size": size,
                        "tokens": batch.num_tokens,
                        "sequences": len(batch.lengths),
                        "overlap": mode,
                        "tbo": chosen is not None,
                        "delay": chosen,
                        "tbo_policy": "auto" if delay == "auto" else "fixed",
                        "tbo_gemm_sm_budget": gemm_sm_budget if chosen is not None else None,
                        "capacity": (batch.num_tokens if chosen is None else half) if half else None,
                        "graph": graph,
                        "t_layer_us": t,
                        **limits,
                    }
                )
        layer.moe.overlap = make_overlap("none", device)
    return rows


def summarise_tbo(per_rank: list[list[dict]], spec: dict, ep: int) -> list[dict]:
    rows = []
    for rank_rows in zip(*per_rank):
        first = rank_rows[0]
        rows.append(
            {
                **row_head("tbo", spec, ep),
                **{k: first[k] for k in ("kernels", "transport_used") if k in first},
                "regime": first["regime"],
                "tokens_per_rank": first["tokens"],
                "sequences_per_rank": first["sequences"],
                "kv_len": spec["kv_len"] if first["regime"] == "decode" else None,
                "attention": f"{spec['heads']}x{spec['head_dim']} heads, {spec['kv_heads']} kv heads",
                "overlap": first["overlap"],
                "tbo": first["tbo"],
                "delay": first["delay"],
                "tbo_policy": first["tbo_policy"],
                "tbo_gemm_sm_budget": first["tbo_gemm_sm_budget"],
                "capacity": first["capacity"],
                "graph": first["graph"],
                "t_layer_us": max(r["t_layer_us"] for r in rank_rows),
                "t_layer_us_per_rank": [round(r["t_layer_us"], 1) for r in rank_rows],
                # The slowest rank's floor parts and raw transfers; the bytes each rank sent, averaged.
                **{k: max(r[k] for r in rank_rows) for k in first if k.startswith(("t_floor_", "ref_t_"))},
                **{k: round(statistics.mean(r[k] for r in rank_rows)) for k in first if k.endswith("_bytes_sent")},
            }
        )
        rows[-1].update(physical_limit(rows[-1]))
        rows[-1].update(bandwidth(rows[-1]))
    baseline = next(r for r in rows if r["overlap"] == "none" and not r["tbo"] and r["tbo_policy"] == "fixed")
    for row in rows:
        row["speedup_vs_none"] = baseline["t_layer_us"] / row["t_layer_us"]
    return rows


TBO_LEGEND = (
    "× none: the same size's layer time without TBO and with overlap none / this row's; "
    "× limit: this row's / max(compute floor, raw wire)"
)


TBO_SUMMARY_LEGEND = (
    "SBO: best overlap mode alone; TBO: overlap none; TBO+SBO: best of both",
    "each t(no TBO, none)/t, > 1 faster; d: stage delay; every row: --detail",
)


def tbo_summary_table(rows: list[dict]) -> Table:
    """One line per expert count, size and dispatcher: the layer time without TBO and overlap, and the
    best speedup over it of each kind (an overlap mode alone, TBO alone, TBO with an overlap mode)."""
    columns = [("E/GPU", "right"), ("size", "left"), ("dispatcher", "left")]
    columns += [("none µs", "right"), ("SBO", "right"), ("TBO", "right"), ("TBO+SBO", "right")]
    table = make_table("decoder layer: two-batch overlap, best speedup of each kind (slowest rank)", columns)
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row.get("experts_per_gpu", ""), row.get("regime", ""), row.get("tokens_per_rank", row.get("size", "")))
        groups.setdefault((*key, row.get("dispatcher", "")), []).append(row)
    for (experts, regime, tokens, dispatcher), group in groups.items():
        head = (str(experts), f"{regime} {tokens}", dispatcher)
        fixed = [r for r in group if "error" not in r and r["tbo_policy"] == "fixed"]
        base = next((r for r in fixed if r["overlap"] == "none" and not r["tbo"]), None)
        if base is None:
            table.add_row(*head, "[red]error[/]", "", "", "")
            continue

        def best(rows_of_kind: list[dict], name: bool) -> str:
            if not rows_of_kind:
                return "-"
            top = max(rows_of_kind, key=lambda r: r["speedup_vs_none"])
            delay = f" d{top['delay']}" if top["tbo"] else ""
            return f"{top['overlap'] + ' ' if name else ''}{top['speedup_vs_none']:.2f}{delay}"

        sbo = [r for r in fixed if not r["tbo"] and r["overlap"] != "none"]
        tbo = [r for r in fixed if r["tbo"] and r["overlap"] == "none"]
        both = [r for r in fixed if r["tbo"] and r["overlap"] != "none"]
        table.add_row(*head, compact(base["t_layer_us"]), best(sbo, True), best(tbo, False), best(both, True))
    return table


def best_tbo(rows: list[dict]) -> list[str]:
    """The sweep's conclusion, a line per expert count: at each regime and size, the fastest row (its
    ``dispatcher/mode``, TBO at its stage delay or not) and its speedup over the same size without TBO
    and overlap (1.00x: nothing beat it)."""
    fastest: dict[int, dict[tuple[str, int], dict]] = {}
    for row in rows:
        if "error" in row:
            continue
        at = fastest.setdefault(row["experts_per_gpu"], {})
        size = (row["regime"], row["tokens_per_rank"])
        if size not in at or row["t_layer_us"] < at[size]["t_layer_us"]:
            at[size] = row
    lines = []
    for experts, at in fastest.items():
        parts = []
        for (regime, tokens), row in at.items():
            tbo = f"TBO d{row['delay']}" if row["tbo"] else "no TBO"
            parts.append(f"{regime} {tokens} {row['dispatcher']}/{row['overlap']} {tbo} {row['speedup_vs_none']:.2f}x")
        head = "best" if len(fastest) == 1 else f"best at {experts} experts/GPU"
        lines.append(f"{head}: {'; '.join(parts)}")
    return lines or ["best: nothing measured (every step failed)"]


def tbo_table(rows: list[dict]) -> Table:
    """The TBO rows as a table that fits 100 columns."""
    columns = [("regime", "left"), ("tokens", "right"), ("seqs", "right"), ("dispatcher", "left")]
    columns += [("overlap", "left"), ("tbo (delay)", "left"), ("graph", "left"), ("layer µs", "right")]
    columns += [("× none", "right"), ("× limit", "right")]
    table = make_table("decoder layer: two-batch overlap (slowest rank, median)", columns)
    for r in rows:
        if "error" in r:
            table.add_row(
                r.get("regime", ""),
                str(r.get("size", "")),
                "",
                r.get("dispatcher", ""),
                "[red]error[/]",
                *[""] * (len(columns) - 5),
            )
            continue
        table.add_row(
            r["regime"],
            str(r["tokens_per_rank"]),
            str(r["sequences_per_rank"]),
            r["dispatcher"],
            r["overlap"],
            ("auto: " if r.get("tbo_policy") == "auto" else "") + (f"yes ({r['delay']})" if r["tbo"] else "no"),
            "yes" if r["graph"] else "no",
            compact(r["t_layer_us"]),
            f"{r['speedup_vs_none']:.2f}",
            "-" if r.get("limit_ratio") is None else f"{r['limit_ratio']:.2f}",
        )
    return table


def tbo_timeline_rank(device: torch.device, spec: dict, regime: str, size: int, trace_prefix: str | None) -> dict:
    """Profile one forward without and with TBO (``none``, and TBO with the last SBO mode asked for)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lengths = prefill_lengths(size, spec["seed"] + rank) if regime == "prefill" else None
    batch = (
        Batch.prefill(lengths, device=device)
        if lengths
        else Batch.decode_step(0, torch.full((size,), spec["kv_len"], dtype=torch.int64, device=device))
    )
    layer = _decoder(device, spec, size)
    cache = layer.make_cache(len(batch.lengths), max(lengths) if lengths else spec["kv_len"] + 1)
    x_TH = torch.randn(batch.num_tokens, layer.attn_cfg.hidden_size, device=device).to(getattr(torch, spec["dtype"]))
    cases = {"no TBO": ("none", False), "TBO": ("none", True)}
    if spec["modes"][-1] != "none":
        cases[f"TBO + SBO {spec['modes'][-1]}"] = (spec["modes"][-1], True)
    tbo_dispatcher = _tbo_dispatcher(layer, spec, batch)[0]  # sized as the bench's TBO rows
    spans = {}
    with torch.inference_mode():
        for title, (mode, tbo) in cases.items():
            layer.moe.overlap = make_overlap(mode, device, sm_budget=spec["sm_budget"])
            delay = spec["delays"][0] if tbo else None
            run = functools.partial(_forward, layer, x_TH, batch, cache, spec, tbo_dispatcher, delay)
            spans[title] = profile_spans(
                run, device, rank, f"{trace_prefix}.tbo.{title.replace(' ', '_')}.json" if trace_prefix else None
            )
        layer.moe.overlap = make_overlap("none", device)
    return spans


# ---- command line --------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench tbo``: every expert count x dispatcher x prefill or decode size, each case's rows."""
    sweep = prepare(args, drop_auto=True)
    if not (args.prefill_tokens or args.decode_seqs):
        raise ValueError(
            "--prefill-tokens and --decode-seqs must give at least one size, got neither; leave one out for its default"
        )
    if isinstance(args.tbo_gemm_sm_budget, int):
        check_sm_budget(torch.device(sweep.ranks.device), args.tbo_gemm_sm_budget)
    attention = AttentionConfig(get_preset(args.preset).hidden_size, args.heads, args.kv_heads, args.head_dim)
    tokens = max([*args.prefill_tokens, *args.decode_seqs])
    kv_tokens = max([*args.prefill_tokens, *(b * (args.kv_len + 1) for b in args.decode_seqs)])
    sweep.check_memory(tokens, attention, kv_tokens)
    ranks, steps = sweep.ranks.count, []
    sizes = [("prefill", t) for t in args.prefill_tokens] + [("decode", b) for b in args.decode_seqs]
    for n, d, (regime, size) in ((n, d, s) for n in sweep.experts for d in sweep.dispatchers for s in sizes):
        spec = sweep.spec(n, d, sweep.modes)
        fields = {"num_experts": n, "dispatcher": d, "regime": regime, "size": size, "wire": args.wire}
        summary = functools.partial(summarise_tbo, spec=spec, ep=ranks)
        steps.append(Step(f"E={n} {d} {regime} {size}", tbo_bench_rank, (spec, regime, size), summary, fields))

    def report(rows: list[dict], meta: dict) -> None:
        console = sweep.ranks.console
        console.print(tbo_summary_table(rows))
        print_notes(console, *TBO_SUMMARY_LEGEND)
        if args.detail:
            console.print(tbo_table(rows))
            print_notes(console, TBO_LEGEND)
        print_notes(console, cpu_timing_note(sweep.ranks.device))

    return sweep.run("tbo", steps, report, best_tbo, draw=functools.partial(_timeline, sweep))


def _timeline(sweep: Sweep, pool) -> None:
    """Profile one forward without and with TBO of the first expert count, per dispatcher; draw the
    lanes, keep the traces."""
    args = sweep.args
    regime, size = ("prefill", args.prefill_tokens[0]) if args.prefill_tokens else ("decode", args.decode_seqs[-1])
    spans = {}
    for dispatcher in sweep.dispatchers:
        spec = sweep.spec(sweep.experts[0], dispatcher, sweep.modes)
        per_case = pool.run(in_ranks(tbo_timeline_rank), spec, regime, size, args.trace)[0]
        spans.update({f"{dispatcher} / {case}": s for case, s in per_case.items()})
    title = f"{args.preset} decoder layer, EP{sweep.ranks.count}, {regime} {size}/rank, {sweep.ranks.device}"
    draw_timeline(args, spans, title, "tbo.<case>.json", sweep.ranks.console)

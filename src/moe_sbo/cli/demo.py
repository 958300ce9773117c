"""``moe-sbo demo``: every dispatcher against the single-rank reference, on N local ranks.

Each rank builds the reference layer (``local``: all experts, same seed, so the same weights) and one
layer per dispatcher, runs its own random tokens through both, and reports the error, the bytes it
moved and the time of each phase. Phase times come from hooks on the dispatcher: the demo measures
itself with the same mechanism overlap strategies use, without touching the layer.

With ``--eplb`` every router (the reference's too) is skewed to a Zipf(1) load and each dispatcher's
layer balances it (``eplb=``, one redundant slot per rank): after the timed forwards fill its load
window it rebalances, and its output is checked against the reference before and after.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from rich.markup import escape

from ..bench.eplb import max_over_mean, received_rows, skew_alike
from ..config import PRESETS, get_preset
from ..decoder.attention import AttentionConfig, Batch
from ..decoder.decoder_layer import DecoderLayer
from ..dispatch import DISPATCHERS, options_for_tokens
from ..eplb.runtime import EPLBOptions
from ..hf.checkpoint import Checkpoint, LayerLoader
from ..layer import MoELayer
from ..measure.memory import check_memory, estimate_rank_bytes, memory_fix
from ..measure.options import (
    cpu_timing_note,
    default_dtype_name,
    print_notes,
    resolve_expert_dtype,
    target_load,
)
from ..measure.progress import rank_progress
from ..measure.results import result_meta
from ..measure.run import prepare, write_json
from ..overlap import OVERLAP_MODES
from ..overlap.tbo import tbo_forward
from .demo_elastic import run_elastic_demo
from .demo_report import demo_table, eplb_demo_table, node_count, nodes_note, verdict

# Relative L2 error allowed against the reference, per dtype: float32 differs only by summation
# order; bf16 by rounding of the activations that cross the wire and of the GEMM outputs.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# With FP8 experts, whatever the dtype: the reference's experts are FP8 too, with the same e4m3
# weights, but a summation-order difference before one of the experts' two e4m3 activation
# quantisations can move a value to the neighbouring e4m3 step (2^-4 relative), a few values per run.
FP8_TOLERANCE = 2e-2
DEMO_SKEW = "zipf:1"  # --eplb: the load every router is skewed to


def demo_tolerance(dtype: torch.dtype, expert_dtype: str | None) -> float:
    """The relative L2 error a run may differ from the single-rank reference by."""
    return FP8_TOLERANCE if expert_dtype == "fp8" else TOLERANCE[dtype]


@dataclass(frozen=True)
class DemoRow:
    dispatcher: str
    overlap: str
    tbo: bool
    same_as_none: bool  # bitwise equal to this dispatcher's output with the first overlap mode ("none")
    rank: int
    tokens: int
    max_abs_err: float
    rel_err: float
    ok: bool
    bytes_sent: int
    bytes_recv: int
    inter_node_bytes: int  # of bytes_sent, those to other nodes (MOE_SBO_RANKS_PER_NODE)
    ranks_per_node: int  # the node size the dispatcher assumed (the whole group: one node)
    nodes: int  # nodes its group spans (local: 1, every rank on its own)
    t_route_us: float
    t_dispatch_us: float
    t_experts_us: float
    t_combine_us: float
    t_layer_us: float
    # --eplb: the rank load (max/mean of the expert rows each rank receives) on the demo's tokens before
    # and after the rebalance, what moved, and the error after it (the fields above: before it).
    load_max_over_mean_before: float | None = None
    load_max_over_mean_after: float | None = None
    moved_slots: int | None = None
    moved_bytes: int | None = None
    rel_err_after_rebalance: float | None = None


class PhaseClock:
    """Hooks that timestamp the four phase boundaries (synchronising CUDA so times are real)."""

    def __init__(self, layer: MoELayer):
        self.stamps: dict[str, float] = {}
        self._cuda = layer.router.weight.is_cuda
        for event in ("pre_dispatch", "post_dispatch", "pre_combine", "post_combine"):
            layer.dispatcher.hooks.register(event, self._stamper(event))

    def now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _stamper(self, event: str):
        def stamp(dispatcher, payload):
            self.stamps[event] = self.now()

        return stamp


def run_demo_rank(
    device: torch.device,
    preset: str,
    dispatchers: list[str],
    tokens: int,
    seed: int,
    dtype_name: str,
    iters: int,
    overlaps: tuple[str, ...] = ("none",),
    *,
    checkpoint: str | None = None,
    layer_index: int | None = None,
    tbo: bool = False,
    expert_dtype: str | None = None,
    eplb: bool = False,
) -> list[dict]:
    """One rank's share of the demo (called on every rank by ``LocalRanks.run``): one row per
    dispatcher and overlap mode. With ``checkpoint`` (a model directory) the model and weights are
    MoE layer ``layer_index`` of it instead of ``preset`` and ``seed``: each dispatcher's layer reads only
    this rank's experts; the ``local`` reference reads them all. With ``tbo`` each MoE layer sits in a
    decoder layer (attention + MoE) run with two-batch overlap on packed sequences, against the
    ``local`` decoder layer without it; phase times are then micro-batch A's. ``expert_dtype``: of
    every layer's routed experts, the reference's included (``MoELayer``'s option: None or "fp8").
    ``eplb``: every router skewed to ``DEMO_SKEW``, each layer with load balancing (one redundant slot per
    rank when there are several), rebalanced after the timed forwards and checked again."""
    load: Callable[[MoELayer], MoELayer]
    if checkpoint:
        if layer_index is None:
            raise ValueError(
                f"layer_index must be given with checkpoint {checkpoint!r}, got None; "
                "pass Checkpoint(checkpoint).validate_layer(None) for the first MoE layer"
            )
        loader = LayerLoader(Checkpoint(checkpoint), layer_index)
        load, cfg = loader, loader.checkpoint.moe_config
    else:
        load, cfg = (lambda moe: moe), get_preset(preset)
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x_TH = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(dtype)
    model, run, run_reference = _models(tbo, tokens, cfg.hidden_size, seed, device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    balance = EPLBOptions(redundant_per_rank=1 if world > 1 else 0, window=iters + 1) if eplb else None
    with torch.inference_mode():
        reference = MoELayer(cfg, dispatcher="local", dtype=dtype, device=device, seed=seed, expert_dtype=expert_dtype)
        logit_bias_E = None
        if eplb:
            _, logit_bias_E = skew_alike(reference, target_load(DEMO_SKEW, cfg.num_experts, cfg.name).load, seed)
        reference_TH = run_reference(model(load(reference)), x_TH)
        rows = []
        progress = rank_progress(rank, len(dispatchers) * len(overlaps), "demo")
        for name, overlap in itertools.product(dispatchers, overlaps):
            layer = load(
                MoELayer(
                    cfg,
                    dispatcher=name,
                    dtype=dtype,
                    device=device,
                    seed=seed,
                    overlap=overlap,
                    dispatcher_options=options_for_tokens(name, tokens),
                    expert_dtype=expert_dtype,
                    eplb=balance,
                )
            )
            if logit_bias_E is not None:
                layer.router.logit_bias = logit_bias_E.clone()
            clock = PhaseClock(layer)
            wrapped = model(layer)
            samples = []
            for _ in range(iters + 1):  # the first forward warms up and is not timed
                start = clock.now()
                y_TH = run(wrapped, x_TH)
                end = clock.now()
                s = clock.stamps
                samples.append(
                    (
                        s["pre_dispatch"] - start,
                        s["post_dispatch"] - s["pre_dispatch"],
                        s["pre_combine"] - s["post_dispatch"],
                        s["post_combine"] - s["pre_combine"],
                        end - start,
                    )
                )
            medians = [statistics.median(col) * 1e6 for col in zip(*samples[1:])]
            if overlap == overlaps[0]:
                first_mode_y_TH = y_TH
            diff = y_TH.float() - reference_TH.float()
            rel = _rel_err(y_TH, reference_TH)
            traffic = layer.last_traffic
            balanced = _rebalanced(layer, x_TH, lambda: run(wrapped, x_TH), reference_TH) if eplb else {}
            tolerance = demo_tolerance(dtype, expert_dtype)
            ok = rel <= tolerance and balanced.get("rel_err_after_rebalance", 0.0) <= tolerance
            if progress:
                progress(f"{name} / {overlap}")
            rows.append(
                asdict(
                    DemoRow(
                        dispatcher=name,
                        overlap=overlap,
                        tbo=tbo,
                        same_as_none=torch.equal(y_TH, first_mode_y_TH),
                        rank=rank,
                        tokens=tokens,
                        max_abs_err=diff.abs().max().item() if diff.numel() else 0.0,
                        rel_err=rel,
                        ok=ok,
                        bytes_sent=traffic.bytes_sent,
                        bytes_recv=traffic.bytes_recv,
                        inter_node_bytes=traffic.inter_node_bytes,
                        ranks_per_node=layer.dispatcher.ep.node_size,
                        nodes=layer.dispatcher.ep.size // layer.dispatcher.ep.node_size,
                        t_route_us=medians[0],
                        t_dispatch_us=medians[1],
                        t_experts_us=medians[2],
                        t_combine_us=medians[3],
                        t_layer_us=medians[4],
                        **balanced,
                    )
                )
            )
    return rows


def _rel_err(y_TH: torch.Tensor, reference_TH: torch.Tensor) -> float:
    """Relative L2 error of ``y_TH`` against ``reference_TH`` (absolute when the reference is 0)."""
    diff = y_TH.float() - reference_TH.float()
    ref_norm = reference_TH.float().norm().item()
    return diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()


def _rebalanced(layer: MoELayer, x_TH: torch.Tensor, forward: Callable[[], torch.Tensor], reference_TH) -> dict:
    """Rebalance ``layer`` from the forwards its window counted, on every rank: the rank load on
    ``x_TH`` before and after, what moved, and the error of ``forward()`` after it. A collective."""
    before = received_rows(layer, [x_TH])
    report = layer.rebalance()
    after = received_rows(layer, [x_TH])
    return {
        "load_max_over_mean_before": max_over_mean(before),
        "load_max_over_mean_after": max_over_mean(after),
        "moved_slots": report.moved_slots,
        "moved_bytes": report.moved_bytes,
        "rel_err_after_rebalance": _rel_err(forward(), reference_TH),
    }


def _models(tbo: bool, tokens: int, hidden_size: int, seed: int, device: torch.device):
    """(wrap a MoE layer, run it, run the reference): the MoE layer alone, or with ``tbo`` a decoder
    layer on packed sequences of up to 48 tokens, run with two-batch overlap (reference: without)."""
    if not tbo:
        return (lambda moe: moe), (lambda layer, x: layer(x)), (lambda layer, x: layer(x))
    head_dim = 16 if hidden_size < 1024 else 128
    heads = hidden_size // head_dim
    attn = AttentionConfig(hidden_size, heads, max(1, heads // 4), head_dim)
    lengths = [min(48, tokens - start) for start in range(0, tokens, 48)]
    batch = Batch.prefill(lengths, device=device)

    def cache(layer):
        return layer.make_cache(max(1, len(lengths)), 48)

    return (
        (lambda moe: DecoderLayer(attn, moe, seed=seed)),
        (lambda layer, x: tbo_forward(layer, x, batch, cache(layer))),
        (lambda layer, x: layer(x, batch, cache(layer))),
    )


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """One row per dispatcher: worst error over ranks, mean bytes per rank, slowest rank's times."""
    summary = []
    for rows in zip(*per_rank):
        first = rows[0]
        summary.append(
            {
                "bench": "demo",
                "dispatcher": first["dispatcher"],
                "overlap": first["overlap"],
                "tbo": first["tbo"],
                "same_as_none": all(r["same_as_none"] for r in rows),
                "ranks": len(rows),
                "tokens_per_rank": first["tokens"],
                "max_abs_err": max(r["max_abs_err"] for r in rows),
                "rel_err": max(r["rel_err"] for r in rows),
                "ok": all(r["ok"] for r in rows),
                "bytes_sent": round(statistics.mean(r["bytes_sent"] for r in rows)),
                "bytes_recv": round(statistics.mean(r["bytes_recv"] for r in rows)),
                "inter_node_bytes": round(statistics.mean(r["inter_node_bytes"] for r in rows)),
                "ranks_per_node": first["ranks_per_node"],
                "nodes": first["nodes"],
                "intra_node_bytes": round(statistics.mean(r["bytes_sent"] - r["inter_node_bytes"] for r in rows)),
                **{
                    key: max(r[key] for r in rows)
                    for key in ("t_route_us", "t_dispatch_us", "t_experts_us", "t_combine_us", "t_layer_us")
                },
            }
        )
        if first["moved_slots"] is not None:  # --eplb: the group's balance (all-reduced, alike on every rank)
            summary[-1].update(
                {k: first[k] for k in ("load_max_over_mean_before", "load_max_over_mean_after", "moved_slots")}
                | {"moved_bytes": first["moved_bytes"]}
                | {"rel_err_after_rebalance": max(r["rel_err_after_rebalance"] for r in rows)}
            )
    return summary


# ---- the subcommand ------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    run, (json_path,) = prepare(args.device, args.ranks, ("--json", args.json))
    device, ranks, console = run.device, run.count, run.console
    names = sorted(DISPATCHERS) if args.dispatcher == "all" else [args.dispatcher]
    for name in names:
        if name not in DISPATCHERS:
            raise ValueError(f"--dispatcher must be one of {sorted(DISPATCHERS)} or all, got {name!r}")
    if args.tokens < 0:
        raise ValueError(f"--tokens must be >= 0, got {args.tokens}")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if args.elastic:
        return run_elastic_demo(args, device, ranks, names, console, json_path)
    overlaps = _overlap_modes(args.overlap)
    if args.eplb:
        _check_eplb(args, names, ranks)
        if args.dispatcher == "all" and ranks > 1:
            names = [n for n in names if n != "local"]  # local holds every expert on each rank: nothing to balance
    if args.layer is not None and not args.checkpoint:
        raise ValueError(
            f"--layer picks a layer of --checkpoint, got --layer {args.layer} without one; add --checkpoint DIR "
            "or leave --layer out (--preset has one layer)"
        )
    model = PRESETS[args.preset]
    if args.checkpoint:  # checked before any rank starts: config.json, the layer, every tensor header
        checkpoint = Checkpoint(args.checkpoint)
        args.layer, model = checkpoint.validate_layer(args.layer), checkpoint.moe_config
    model.experts_per_rank(ranks)  # raises before any rank starts if they do not divide
    expert_dtype = resolve_expert_dtype(args.expert_dtype, model)  # sizes checked before any rank starts
    dtype = args.dtype or default_dtype_name(device)
    # Each rank holds the reference (every expert) beside one dispatcher's layer at a time.
    estimate = estimate_rank_bytes(model, ranks, dtype, args.tokens, reference=True)
    memory = check_memory(
        estimate, device, ranks, fix=memory_fix(device, "--preset tiny, a smaller --checkpoint or fewer --tokens")
    )

    source = f"{args.checkpoint} layer {args.layer}" if args.checkpoint else f"preset {args.preset}"
    experts = ", fp8 experts" if expert_dtype else ""
    console.print(
        f"[bold]moe-sbo demo[/]: {escape(source)}, {ranks} {device} ranks, {args.tokens} tokens/rank, {dtype}"
        + experts,
        soft_wrap=True,  # a checkpoint's path is printed whole
    )
    console.print(memory, highlight=False)
    if args.tbo:
        console.print("  each MoE layer in a decoder layer (attention + MoE), run with two-batch overlap")
    if args.eplb:
        console.print(
            f"  eplb: routers skewed to {DEMO_SKEW}, {1 if ranks > 1 else 0} redundant slot(s) per rank, "
            "a rebalance after the timed forwards",
            highlight=False,
        )
    per_rank = run.run(
        run_demo_rank,
        args.preset,
        names,
        args.tokens,
        args.seed,
        dtype,
        args.iters,
        overlaps,
        checkpoint=args.checkpoint,
        layer_index=args.layer,
        tbo=args.tbo,
        expert_dtype=expert_dtype,
        eplb=args.eplb,
    )
    rows = summarise(per_rank)
    tolerance = demo_tolerance(getattr(torch, dtype), expert_dtype)
    console.print(demo_table(rows))
    print_notes(
        console,
        f"ok: rel L2 <= {tolerance:g}"
        + (" before and after the rebalance" if args.eplb else "")
        + "; = none: bitwise equal to overlap none",
        "B/rank: mean bytes sent (= received)" + ("; inter B: of them, to other nodes" if node_count(rows) > 1 else ""),
        nodes_note(rows, ranks),
        cpu_timing_note(device),
    )
    if args.eplb:
        console.print(eplb_demo_table(rows))
        print_notes(
            console,
            "before, after: max/mean of the expert rows each rank receives, on the demo's tokens (which the "
            "rebalance's load window counted); moved: expert slots that changed rank; rel L2 after: vs reference",
        )
    if json_path:
        meta = {**result_meta(device=device, world_size=ranks), "expert_dtype": expert_dtype or dtype}
        write_json(json_path, {"meta": meta, "rows": rows}, console, f"rows written to {json_path}")
    console.print(verdict(rows, device), highlight=False, soft_wrap=True)  # one line, for scripts
    # On CPU every mode must equal none bitwise; on GPU the SM budget may pick other GEMM kernels.
    return 0 if all(r["ok"] and (r["same_as_none"] or device == "cuda") for r in rows) else 1


def _check_eplb(args: argparse.Namespace, names: list[str], ranks: int) -> None:
    """``--eplb``'s combinations, refused before any rank starts (``ValueError`` naming the fix)."""
    if args.tbo:
        raise ValueError("--eplb and --tbo are separate demos, got both; run one, then the other")
    if args.checkpoint:
        raise ValueError(
            "--eplb runs --preset's random weights skewed to a Zipf load, got --checkpoint; leave one of them out"
        )
    if args.dispatcher == "local" and ranks > 1:
        raise ValueError(
            f"--eplb moves experts between ranks, but --dispatcher local holds every expert on each of the {ranks} "
            "ranks; choose another --dispatcher, or --ranks 1"
        )


def _overlap_modes(choice: str) -> tuple[str, ...]:
    """``--overlap`` -> the modes to run, ``none`` first (the others are compared with it)."""
    if choice == "all":
        return OVERLAP_MODES
    if choice not in OVERLAP_MODES:
        raise ValueError(f"--overlap must be one of {list(OVERLAP_MODES)} or all, got {choice!r}")
    return ("none",) if choice == "none" else ("none", choice)

"""Foundation benchmark: the expert-parallel MoE layer per phase, and the routed-expert GEMM.

Two measurements, both written to ``OUT/foundation.json`` as ``{"meta", "rows"}`` result files:

1. ``bench="moe_layer"``: for each EP size P (one process per GPU, NCCL), each dispatcher
   (``allgather``, ``alltoall``) and each token count per rank: median time of the router, dispatch,
   routed experts, combine, shared experts and the whole layer; bytes each rank sent and received; the
   achieved bandwidth of dispatch + combine, and, in the same run on the same ranks, raw
   ``all_to_all_single`` (equal splits) moving the same bytes per rank -> ``ref_algbw_GBps`` and the
   ratio. At P = 1 the "dispatch" is a local copy: the row is timed but moves no bytes (``ep=1``).
2. ``bench="grouped_gemm"`` (rank 0 only): ``RoutedExperts`` forward (gate_up grouped GEMM, SiLU·mul,
   down grouped GEMM) at realistic rows per expert, against dense GEMMs measured in the same run (an
   8192³ ``torch.mm`` and two dense GEMMs of exactly the same FLOPs).

The hard part is timing without perturbing what is timed. Phase boundaries are CUDA events recorded
by hooks on the dispatcher (``pre_dispatch`` ... ``post_combine``) on the current stream; nothing
synchronises inside a timed forward, so a phase's time is its span on the GPU timeline, including
any idle gap the layer's own host syncs leave. Ranks are lined up (synchronize + barrier) before each
timed forward, outside the timed region, so one rank's late start is not billed to another's
dispatch. Per-rank medians are aggregated as the slowest rank (the layer is as fast as its slowest
rank); bytes are the mean over ranks, and both bandwidths divide the same byte count, so
``ratio = (t_ref_dispatch + t_ref_combine) / (t_dispatch + t_combine)``.

Usage (GPU): ``moe-sbo bench foundation --out DIR [--ranks 4] [--tokens 128 4096]``.
CPU smoke: ``moe-sbo bench foundation --out DIR --device cpu --preset tiny --quick --ranks 2``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from ..config import MoEConfig, get_preset
from ..experts.conditions import Conditions
from ..experts.routed import RoutedExperts
from ..experts.routes import GROUPED_MM
from ..launch.ranks import RankPool
from ..layer import MoELayer
from ..measure.options import default_dtype_name
from ..measure.results import ResultFile, result_meta
from ..measure.timing import SPANS, KernelTimer, time_layer, time_raw_all_to_all
from .ep_sweep import EpSweep

# ---- the layer benchmark (runs on every rank) -------------------------------------------------------


def layer_bench_rank(
    device: torch.device,
    cfg: MoEConfig,
    dispatcher: str,
    tokens_list: list[int],
    dtype_name: str | None,
    warmup: int,
    iters: int,
    seed: int,
) -> list[dict]:
    """One rank's eager rows for one dispatcher, every token count: each phase's median from hook
    events, the four byte counts, and raw ``all_to_all_single`` on the mean bytes beside
    (``ref_t_*_us``, ``ref_bytes``). ``dtype_name`` None: the device's default. Called on every rank
    by ``RankPool.run``."""
    dtype = getattr(torch, dtype_name or default_dtype_name(device.type))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    with torch.inference_mode():
        layer = MoELayer(cfg, dispatcher=dispatcher, dtype=dtype, device=device, seed=seed)
        for tokens in tokens_list:
            generator = torch.Generator(device=device).manual_seed(seed * 7919 + rank * 131 + tokens)
            x_TH = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(dtype)
            times = time_layer(layer, x_TH, warmup, iters)
            traffic = layer.last_traffic
            row = {
                "rank": rank,
                "tokens": tokens,
                **times,
                "dispatch_bytes_sent": traffic.dispatch_bytes_sent,
                "dispatch_bytes_recv": traffic.dispatch_bytes_recv,
                "combine_bytes_sent": traffic.combine_bytes_sent,
                "combine_bytes_recv": traffic.combine_bytes_recv,
            }
            if world > 1:
                # Raw NCCL (gloo on CPU) on the same bytes, the mean over ranks of each phase.
                sent = (traffic.dispatch_bytes_sent, traffic.combine_bytes_sent)
                ref_times, chunks = time_raw_all_to_all(sent, dtype, device, warmup, iters, seed, rule="mean")
                row["ref_t_dispatch_us"], row["ref_t_combine_us"] = ref_times
                row["ref_bytes"] = sum(chunks) * (world - 1) * dtype.itemsize
            rows.append(row)
        del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def summarise_layer(per_rank: list[list[dict]], preset: str, dispatcher: str, dtype_name: str) -> list[dict]:
    """One row per token count: slowest rank's medians, mean bytes per rank, bandwidths and ratio."""
    world = len(per_rank)
    out = []
    for rank_rows in zip(*per_rank):
        first = rank_rows[0]
        row = {
            "bench": "moe_layer",
            "preset": preset,
            "ep": world,
            "tokens_per_rank": first["tokens"],
            "dispatcher": dispatcher,
            "overlap": "none",
            "tbo": False,
            "dtype": dtype_name,
            "graph": False,
        }
        for name, _, _ in SPANS:
            row[name] = max(r[name] for r in rank_rows)
        row["t_layer_us_per_rank"] = [round(r["t_layer_us"], 1) for r in rank_rows]
        for key in ("dispatch_bytes_sent", "dispatch_bytes_recv", "combine_bytes_sent", "combine_bytes_recv"):
            row[key] = round(statistics.mean(r[key] for r in rank_rows))
        row["bytes_sent"] = row["dispatch_bytes_sent"] + row["combine_bytes_sent"]
        row["bytes_recv"] = row["dispatch_bytes_recv"] + row["combine_bytes_recv"]
        row["t_comm_us"] = row["t_dispatch_us"] + row["t_combine_us"]
        if world == 1:
            row["note"] = "ep=1: dispatch/combine are local copies, nothing on the wire"
            row.update(algbw_GBps=None, ref_algbw_GBps=None, ratio_vs_ref=None)
        else:
            row["ref_t_dispatch_us"] = max(r["ref_t_dispatch_us"] for r in rank_rows)
            row["ref_t_combine_us"] = max(r["ref_t_combine_us"] for r in rank_rows)
            row["ref_bytes"] = first["ref_bytes"]
            t_ref = row["ref_t_dispatch_us"] + row["ref_t_combine_us"]
            row["algbw_GBps"] = row["bytes_sent"] / row["t_comm_us"] / 1e3
            row["ref_algbw_GBps"] = row["ref_bytes"] / t_ref / 1e3
            row["ratio_vs_ref"] = row["algbw_GBps"] / row["ref_algbw_GBps"]
        out.append(row)
    return out


# ---- the grouped-GEMM benchmark (rank 0 only) ------------------------------------------------------


def gemm_cases(preset: str, gemm_ep: int, max_tokens: int) -> list[tuple[str, int, int]]:
    """(regime, experts per GPU, rows per expert) at the preset's dims, balanced routing assumed.

    Each rank receives T·K (token, expert) rows on average whatever P is, so rows per expert = T·K/L.
    ``decode_deploy``: 128 tokens/GPU with 8 experts per GPU (EP32-like), the expert count real decode
    deployments keep per GPU (2-9 routed experts), rather than 64.
    """
    cfg = get_preset(preset)
    experts = cfg.experts_per_rank(gemm_ep)
    k = cfg.num_experts_per_tok
    deploy = min(8, cfg.num_experts)
    return [
        ("prefill", experts, max(1, max_tokens * k // experts)),
        ("decode", experts, 16),
        ("decode_deploy", deploy, max(1, 128 * k // deploy)),
    ]


def grouped_gemm_rank(
    device: torch.device, preset: str, cases: list[tuple[str, int, int]], dtype_name: str, quick: bool, seed: int
) -> list[dict]:
    """Rows for every case on rank 0 (other ranks return nothing at once)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    cfg = get_preset(preset)
    dtype = getattr(torch, dtype_name)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    timer = KernelTimer(device, quick)
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * std).to(dtype)

    rows: list[dict] = []
    with torch.inference_mode():
        n = 512 if (quick or device.type == "cpu") else 8192
        a, b = randn(n, n), randn(n, n)
        t_square = timer(lambda: torch.mm(a, b))
        square_tflops = 2 * n**3 / t_square / 1e6
        del a, b
        experts: RoutedExperts | None = None
        for regime, num_experts, rows_per_expert in cases:
            row: dict[str, Any] = {
                "bench": "grouped_gemm",
                "preset": preset,
                "regime": regime,
                "dtype": dtype_name,
                "graph": False,
                "experts_per_gpu": num_experts,
                "rows_per_expert": rows_per_expert,
                "timer": timer.name,
                "dense_shape": f"{n}x{n}x{n}",
            }
            try:
                if experts is None or experts.num_local_experts != num_experts:
                    experts = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    experts = RoutedExperts(num_experts, h, i, dtype=dtype, device=device)
                    # In place, in the weights' dtype: no float32 copy of ~5.6 GB of V3 experts.
                    experts.gate_up_proj.normal_(0.0, h**-0.5, generator=generator)
                    experts.down_proj.normal_(0.0, i**-0.5, generator=generator)
                rows_total = num_experts * rows_per_expert
                x_RH = randn(rows_total, h)
                counts_L = torch.full((num_experts,), rows_per_expert, dtype=torch.int64, device=device)
                use_grouped_mm = GROUPED_MM.supports(Conditions.of(x_RH, False, rows_per_expert)) is None
                t_experts = timer(lambda: experts(x_RH, counts_L))
                flops = 2 * rows_total * 3 * h * i  # gate_up (2I·H) + down (H·I) per row
                # Dense GEMMs of exactly the same FLOPs: [rows, H]x[H, 2I] and [rows, I]x[I, H].
                w1_H2I, w2_IH, act_RI = randn(h, 2 * i, std=h**-0.5), randn(i, h, std=i**-0.5), randn(rows_total, i)
                t_same = timer(lambda: (torch.mm(x_RH, w1_H2I), torch.mm(act_RI, w2_IH)))
                weight_bytes = 3 * num_experts * h * i * x_RH.element_size()
                row.update(
                    grouped_mm=use_grouped_mm,
                    rows_total=rows_total,
                    t_routed_us=t_experts,
                    tflops=flops / t_experts / 1e6,
                    dense_tflops=square_tflops,
                    dense_same_flops_tflops=flops / t_same / 1e6,
                    t_dense_same_flops_us=t_same,
                    weight_read_GBps=weight_bytes / t_experts / 1e3,
                )
                row["ratio"] = row["tflops"] / square_tflops
                row["ratio_same_flops"] = row["tflops"] / row["dense_same_flops_tflops"]
                if use_grouped_mm:
                    offsets_L = counts_L.to(torch.int32).cumsum(0, dtype=torch.int32)
                    act_grouped = randn(rows_total, i)
                    t_mm = timer(
                        lambda: (
                            torch._grouped_mm(x_RH, experts.gate_up_proj.transpose(-2, -1), offs=offsets_L),
                            torch._grouped_mm(act_grouped, experts.down_proj.transpose(-2, -1), offs=offsets_L),
                        )
                    )
                    row["t_grouped_mm_only_us"] = t_mm
                    row["tflops_grouped_mm_only"] = flops / t_mm / 1e6
                if device.type == "cpu":
                    row["note"] = "CPU smoke: rates are not GPU numbers"
                del x_RH, w1_H2I, w2_IH, act_RI
            except Exception as exc:  # noqa: BLE001 - one case failing (say OOM) must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            rows.append(row)
        del experts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- driver -----------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench foundation``: the layer per phase per EP size, then the grouped GEMM; 1 if a step failed."""
    # Bad input raises here, before any rank starts.
    sweep = EpSweep.from_args(args, args.tokens)
    device, warmup, iters, ep_sizes = sweep.device, sweep.warmup, sweep.iters, sweep.ep_sizes
    dtype_name = args.dtype or default_dtype_name(device)
    cfg = get_preset(args.preset)
    for p in ep_sizes:
        cfg.experts_per_rank(p)
    cases = gemm_cases(args.preset, args.gemm_ep, max(args.tokens))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "foundation.json"
    meta = result_meta(device, max(ep_sizes))
    meta.update(
        preset=args.preset,
        ep_sizes=ep_sizes,
        tokens_per_rank=args.tokens,
        warmup=warmup,
        iters=iters,
        quick=args.quick,
        timing="CUDA events from dispatcher hooks, no sync inside a forward; ranks "
        "lined up (synchronize + barrier) between forwards"
        if device == "cuda"
        else "host clock",
        aggregation="per-rank medians; times: slowest rank; bytes: mean per rank; "
        "ratio_vs_ref = algbw / ref_algbw on the same bytes (raw all_to_all_single, equal splits)",
    )
    results = ResultFile(out_path, meta)
    started = time.perf_counter()
    for index, p in enumerate(ep_sizes):
        pool = RankPool(p, device)
        try:
            if "layer" not in args.skip:
                for name in args.dispatchers:
                    results.add_timed_step(
                        f"ep={p} {name}",
                        lambda: summarise_layer(
                            pool.run(layer_bench_rank, cfg, name, args.tokens, dtype_name, warmup, iters, args.seed),
                            args.preset,
                            name,
                            dtype_name,
                        ),
                        {"bench": "moe_layer", "preset": args.preset, "ep": p, "dispatcher": name},
                        started,
                    )
            if "gemm" not in args.skip and index == 0:
                results.add_timed_step(
                    "grouped GEMM",
                    lambda: pool.run(grouped_gemm_rank, args.preset, cases, dtype_name, args.quick, args.seed)[0],
                    {"bench": "grouped_gemm", "preset": args.preset},
                    started,
                )
        finally:
            pool.close()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    results.save()
    print_tables(results.rows, meta)
    print(f"wrote {out_path}")
    return 1 if results.errors else 0


def fmt(value: float | None, spec: str = ".0f") -> str:
    """``value`` in ``spec``, "-" for None."""
    return "-" if value is None else format(value, spec)


def bench_console(width: int) -> Console:
    """A console as wide as the terminal, or ``width`` columns when piped (a log keeps whole rows)."""
    return Console(width=None if sys.stdout.isatty() else width)


def bench_table(title: str, columns: str, left: tuple[str, ...]) -> Table:
    """A borderless table of ``columns`` (names separated by ", "): those in ``left`` left-justified,
    the others (numbers) right-justified."""
    table = Table(title=title, box=None)
    for col in columns.split(", "):
        table.add_column(col, justify="left" if col in left else "right")
    return table


def print_tables(rows: list[dict], meta: dict) -> None:
    console = bench_console(150)
    console.print(
        f"{meta.get('gpu') or meta['device']} ×{meta['world_size']}, torch {meta['torch']}, "
        f"nccl {meta['nccl']}, {meta['preset']}, {meta['iters']} iters (median)"
    )
    layer = bench_table(
        "MoE layer per phase, µs (slowest rank); algbw = dispatch+combine bytes/time",
        "ep, T/rank, disp, route, dispatch, experts, combine, shared, layer, MB sent, GB/s, ref GB/s, ratio",
        left=("disp",),
    )
    for r in rows:
        if r["bench"] != "moe_layer":
            continue
        if "error" in r:
            layer.add_row(str(r["ep"]), "-", r["dispatcher"], "[red]error[/]")
            continue
        ratio = r["ratio_vs_ref"]
        layer.add_row(
            str(r["ep"]),
            str(r["tokens_per_rank"]),
            r["dispatcher"],
            *(
                fmt(r[k])
                for k in ("t_route_us", "t_dispatch_us", "t_routed_us", "t_combine_us", "t_shared_us", "t_layer_us")
            ),
            f"{r['bytes_sent'] / 1e6:.2f}",
            fmt(r["algbw_GBps"], ".3g"),
            fmt(r["ref_algbw_GBps"], ".3g"),
            "-" if ratio is None else f"[{'green' if ratio >= 0.85 else 'red'}]{ratio:.2f}[/]",
        )
    console.print(layer)
    gemm = bench_table(
        "routed experts (grouped GEMM) vs dense GEMM, same run",
        "regime, L, rows/exp, µs, TFLOP/s, mm-only, dense, same-FLOPs, ratio, wt GB/s",
        left=("regime",),
    )
    for r in rows:
        if r["bench"] != "grouped_gemm":
            continue
        if "error" in r:
            gemm.add_row(r.get("regime", "-"), str(r.get("experts_per_gpu", "-")), "-", f"[red]{r['error'][:60]}[/]")
            continue
        ratio = r["ratio"]
        gemm.add_row(
            r["regime"],
            str(r["experts_per_gpu"]),
            str(r["rows_per_expert"]),
            fmt(r["t_routed_us"]),
            fmt(r["tflops"], ".3g"),
            fmt(r.get("tflops_grouped_mm_only"), ".3g"),
            fmt(r["dense_tflops"], ".3g"),
            fmt(r["dense_same_flops_tflops"], ".3g"),
            f"[{'green' if ratio >= 0.7 else 'red'}]{ratio:.2f}[/]",
            fmt(r["weight_read_GBps"], ".3g"),
        )
    console.print(gemm)

"""Low-latency benchmark: the ``low_latency`` dispatcher at decode sizes, replayed from CUDA
graphs, beside raw NCCL on the same bytes and the ``allgather``/``alltoall`` dispatchers, in one run.

Model: DeepSeek-V3 dims (H 7168, I 2048, top-8, one shared expert) with ``--experts-per-gpu`` routed
experts per GPU (default 8, so E = 8 * EP: real decode deployments keep 2-9 per GPU;
every row says ``experts_per_gpu``), noaux_tc routing with the group counts adjusted to that E.

Rows (``bench="low_latency"``) in ``OUT/low_latency.json`` (result-file format), per EP size and tokens
per rank (capacity = tokens unless ``--capacity``):

- ``dispatcher="low_latency"``, ``graph=True``, once per ``dispatch_dtype`` (bfloat16, fp8 e4m3) and
  per path (``kernels``: fused ``triton`` or the ``torch`` reference; ``transport``: ``nccl`` or, from
  two GPUs, ``symm_mem``, the fused kernels writing straight into the peers' symmetric buffers):
  ``t_dispatch_us`` / ``t_combine_us`` / ``t_layer_us`` are replays of three CUDA graphs (dispatch
  alone, combine alone, the whole MoE layer); ``ref_t_dispatch_us`` / ``ref_t_combine_us`` are
  graph-replayed raw ``all_to_all_single`` calls moving exactly the same fixed blocks;
  ``dispatch_overhead`` / ``combine_overhead`` are the ratios (target <= 1.2); ``t_layer_b2b_us`` is
  the mean of back-to-back layer replays (decode throughput rather than isolated latency).
- ``dispatcher="low_latency"``, ``graph=False``: the same layer run eagerly, phases from hook events.
- Each once per ``--expert-kernels`` choice (``expert_kernels``, default ``auto``), and ``expert_path``:
  dense experts' GEMMs at the row's P x C x K rows (``RoutedExperts.route``; FP8 rows have none).
- ``dispatcher="allgather"`` / ``"alltoall"``, ``graph=False``: those read sizes on the host, so they
  run eagerly (phases from hook events), with raw ``all_to_all_single`` on their mean bytes beside.

Timing: every timed call is preceded by a line-up (synchronize + barrier) outside the timed span, and
spans are CUDA events on the current stream (host clock on CPU); medians over ``--iters``; the row
holds the slowest rank's median. On CPU (``--device cpu``, gloo) nothing is captured: a smoke run.

Usage (GPU): ``moe-sbo bench low-latency --out DIR [--ranks 4]``.
CPU smoke: ``moe-sbo bench low-latency --out DIR --device cpu --preset tiny --hidden-size 128
--experts-per-gpu 4 --quick --tokens 4 16``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from ..config import MoEConfig, get_preset
from ..dispatch.low_latency import LowLatencyDispatcher, RowFormat
from ..env import triton_interpreting
from ..launch.ranks import RankPool
from ..layer import MoELayer
from ..measure.options import default_dtype_name
from ..measure.results import ResultFile, result_meta
from ..measure.timing import Stamps, line_up, time_fn, time_layer
from ..streams import capture_graph
from .ep_sweep import EpSweep
from .foundation import bench_console, bench_table, fmt, layer_bench_rank

TARGETS = {"tokens_per_rank": 128, "t_dispatch_us": 60.0, "t_combine_us": 80.0, "overhead_vs_nccl": 1.2}
FP8_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
EAGER_SPANS = ("t_route_us", "t_dispatch_us", "t_routed_us", "t_combine_us", "t_layer_us")


def bench_config(preset: str, experts_per_gpu: int, ep: int, hidden_size: int | None) -> MoEConfig:
    """``preset`` with E = experts_per_gpu * ep routed experts and groups that still route top-k."""
    cfg = get_preset(preset)
    if cfg.num_experts_per_tok > experts_per_gpu * ep:
        raise ValueError(
            f"--experts-per-gpu x EP must be >= top-k {cfg.num_experts_per_tok}, got "
            f"{experts_per_gpu * ep}; raise --experts-per-gpu"
        )
    cfg = cfg.with_num_experts(experts_per_gpu * ep)
    return cfg if hidden_size is None else cfg.replace(hidden_size=hidden_size)


def row_labels(args: argparse.Namespace, cfg: MoEConfig, device: str) -> dict[str, Any]:
    """What every row of one EP size says about its model: preset, experts per GPU and in all, H, dtype."""
    return {
        "preset": args.preset,
        "experts_per_gpu": args.experts_per_gpu,
        "num_experts": cfg.num_experts,
        "hidden_size": cfg.hidden_size,
        "dtype": default_dtype_name(device),
    }


def low_latency_layer(
    cfg: MoEConfig, dtype: torch.dtype, device: torch.device, seed: int, options: dict[str, Any]
) -> MoELayer:
    """The MoE layer of ``cfg`` on the ``low_latency`` dispatcher, ``options`` its dispatcher options."""
    return MoELayer(cfg, dispatcher="low_latency", dtype=dtype, device=device, seed=seed, dispatcher_options=options)


# ---- timing ------------------------------------------------------------------------------------------


def capture(fn: Callable[[], object], device: torch.device) -> tuple[Callable[[], object], Any]:
    """``fn`` as a CUDA graph (warmed up off the capture stream first) -> (replay, its static output).
    On CPU nothing is captured: the replay is ``fn`` itself."""
    if device.type != "cuda":
        return fn, fn()
    graph, out = capture_graph(fn)
    return graph.replay, out


def time_back_to_back(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean µs of ``iters`` calls issued back to back (no line-up between them)."""
    line_up(device)
    stamps = Stamps(device, 1, ("start", "end"))
    stamps.iteration = 0
    stamps.record("start")
    for _ in range(iters):
        fn()
    stamps.record("end")
    return stamps.span_us("start", "end")[0] / iters


def raw_all_to_all(bytes_per_rank: int, device: torch.device) -> Callable[[], None]:
    """A fixed-size ``all_to_all_single`` of ``bytes_per_rank`` bytes to each rank (uint8 buffers)."""
    world = dist.get_world_size()
    send = torch.randint(0, 255, (world * bytes_per_rank,), dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    return lambda: dist.all_to_all_single(recv, send)


# ---- per rank ----------------------------------------------------------------------------------------


def low_latency_rank(
    device: torch.device,
    cfg: MoEConfig,
    tokens_list: list[int],
    capacity: int | None,
    fp8_modes: tuple[bool, ...],
    paths: list[tuple[str, str]],
    warmup: int,
    iters: int,
    seed: int,
    index_graphs: tuple[str, ...] = ("on",),
    expert_kernels: tuple[str, ...] = ("auto",),
) -> list[dict]:
    """One rank's ``low_latency`` rows, per (kernels, transport) path, ``index_graphs`` setting
    (``on``, ``off``, ``fixed_rows``: on, with ``fixed_expert_rows``, or ``index_rows``: on, with
    ``index_rows``, replayed too: its graphs hold other kernels) and routed experts' kernels
    (``RoutedExperts.kernels``; the row's ``expert_path`` names the GEMMs that ran):
    graph-replayed phases (CUDA, once per path: a caller's capture bypasses ``index_graphs``), the
    eager layer's phases, and raw ``all_to_all_single`` on the same fixed blocks beside both."""
    rank = dist.get_rank()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    with torch.inference_mode():
        for tokens in tokens_list:
            cap = capacity or max(tokens, 1)
            generator = torch.Generator(device=device).manual_seed(seed * 7919 + rank * 131 + tokens)
            x_TH = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(dtype)
            settings = itertools.product(fp8_modes, paths, index_graphs, expert_kernels)
            for fp8, (kernels, transport), setting, experts_kernels in settings:
                graphs, fixed_rows, index_rows = setting != "off", setting == "fixed_rows", setting == "index_rows"
                options = dict(
                    max_tokens_per_rank=cap, fp8=fp8, kernels=kernels, transport=transport, index_graphs=graphs
                )
                options.update(fixed_expert_rows=fixed_rows, index_rows=index_rows)
                layer = low_latency_layer(cfg, dtype, device, seed, options)
                layer.experts.kernels = experts_kernels
                dispatcher = cast(LowLatencyDispatcher, layer.dispatcher)
                fused = dispatcher.uses_triton(device)
                fmt = RowFormat.make(cfg.hidden_size, cfg.num_experts_per_tok, dtype, fp8)
                expert_rows = dist.get_world_size() * cap * cfg.num_experts_per_tok  # P x C x K, padding included
                common: dict[str, Any] = {
                    "rank": rank,
                    "tokens": tokens,
                    "capacity": cap,
                    "transport": transport,
                    "kernels": "triton" if fused else "torch",
                    "index_graphs": graphs and fused,
                    **({"fixed_expert_rows": True} if fixed_rows and fused else {}),
                    **({"index_rows": True} if index_rows and fused else {}),
                    "dispatch_dtype": "float8_e4m3fn" if fp8 else str(dtype).removeprefix("torch."),
                    "expert_kernels": experts_kernels,
                }
                if not layer.experts.fp8:  # FP8 experts choose by graph capture too: no one path for both
                    rows_like = torch.empty(expert_rows, 0, dtype=dtype, device=device)
                    common["expert_path"] = layer.experts.route(
                        rows_like, cap * cfg.num_experts_per_tok, indexed=dispatcher.rows_in_place(device)
                    ).name
                # One rank: nothing on the wire. CUDA ranks sharing a GPU talk over gloo, whose all-to-all a
                # CUDA graph cannot capture: no raw reference either (its fields stay None).
                if dist.get_world_size() > 1 and (device.type != "cuda" or dist.get_backend() == "nccl"):
                    ref_dispatch, _ = capture(raw_all_to_all(cap * fmt.row_bytes, device), device)
                    ref_combine, _ = capture(raw_all_to_all(cap * cfg.hidden_size * dtype.itemsize, device), device)
                    common["ref_t_dispatch_us"] = time_fn(ref_dispatch, device, warmup, iters, graph=False)
                    common["ref_t_combine_us"] = time_fn(ref_combine, device, warmup, iters, graph=False)
                    del ref_dispatch, ref_combine
                eager = time_layer(layer, x_TH, warmup, iters)
                common.update(dataclasses.asdict(layer.last_traffic))  # the four byte counts
                rows.append({**common, "graph": False, **{k: eager[k] for k in EAGER_SPANS}})
                if cuda and (setting == index_graphs[0] or index_rows):
                    rows.append({**common, "graph": True, **time_graphs(layer, x_TH, warmup, iters)})
                del layer
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def time_graphs(layer: MoELayer, x_TH: torch.Tensor, warmup: int, iters: int) -> dict[str, float]:
    """Dispatch alone, combine alone and the whole layer, each captured in its own CUDA graph and replayed.

    The combine graph reads the dispatch graph's static outputs (its handle), so it replays what the
    last dispatch replay laid out; the three graphs share the dispatcher's buffer sets.
    """
    d, device = layer.dispatcher, x_TH.device
    topk = layer.router(x_TH)
    replay_dispatch, recv = capture(lambda: d.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK), device)
    expert_y_RH = layer.experts.forward_dispatched(recv)
    replay_combine, _ = capture(lambda: d.combine(expert_y_RH, recv.handle), device)
    replay_layer, _ = capture(lambda: layer(x_TH), device)
    return {
        "t_dispatch_us": time_fn(replay_dispatch, device, warmup, iters, graph=False),
        "t_combine_us": time_fn(replay_combine, device, warmup, iters, graph=False),
        "t_layer_us": time_fn(replay_layer, device, warmup, iters, graph=False),
        "t_layer_b2b_us": time_back_to_back(replay_layer, device, iters),
    }


def baseline_rank(
    device: torch.device, cfg: MoEConfig, dispatcher: str, tokens_list: list[int], warmup: int, iters: int, seed: int
) -> list[dict]:
    """One rank's eager rows for a variable-size dispatcher, raw all-to-all on its mean bytes beside
    (``foundation.layer_bench_rank``'s rows in the device's dtype, labelled as this benchmark's)."""
    rows = layer_bench_rank(device, cfg, dispatcher, tokens_list, None, warmup, iters, seed)
    dtype_name = default_dtype_name(device.type)
    return [{**row, "dispatch_dtype": dtype_name, "graph": False} for row in rows]


# ---- summary -----------------------------------------------------------------------------------------


def summarise(per_rank: list[list[dict]], common: dict, dispatcher: str) -> list[dict]:
    """One row per (tokens, mode): slowest rank's medians, mean bytes per rank, ratios to raw NCCL."""
    world = len(per_rank)
    out = []
    for rank_rows in zip(*per_rank):
        first = rank_rows[0]
        row = {
            "bench": "low_latency",
            **common,
            "ep": world,
            "tokens_per_rank": first["tokens"],
            "dispatcher": dispatcher,
            "overlap": "none",
            "tbo": False,
            "graph": first["graph"],
            "dispatch_dtype": first["dispatch_dtype"],
        }
        for key in (
            "capacity",
            "kernels",
            "transport",
            "index_graphs",
            "fixed_expert_rows",
            "index_rows",
            "expert_kernels",
            "expert_path",
        ):
            if key in first:
                row[key] = first[key]
        for key in (
            "t_dispatch_us",
            "t_combine_us",
            "t_layer_us",
            "t_layer_b2b_us",
            "t_routed_us",
            "t_route_us",
            "ref_t_dispatch_us",
            "ref_t_combine_us",
        ):
            values = [r.get(key) for r in rank_rows]
            row[key] = max(values) if all(v is not None for v in values) else None
        for key in ("dispatch_bytes_sent", "dispatch_bytes_recv", "combine_bytes_sent", "combine_bytes_recv"):
            row[key] = round(statistics.mean(r[key] for r in rank_rows))
        row["bytes_sent"] = row["dispatch_bytes_sent"] + row["combine_bytes_sent"]
        row["bytes_recv"] = row["dispatch_bytes_recv"] + row["combine_bytes_recv"]
        row["t_comm_us"] = row["t_dispatch_us"] + row["t_combine_us"]
        if row["ref_t_dispatch_us"] is not None:
            t_ref = row["ref_t_dispatch_us"] + row["ref_t_combine_us"]
            row["dispatch_overhead"] = row["t_dispatch_us"] / row["ref_t_dispatch_us"]
            row["combine_overhead"] = row["t_combine_us"] / row["ref_t_combine_us"]
            row["ratio_vs_ref"] = t_ref / row["t_comm_us"]
            if row["bytes_sent"]:
                row["algbw_GBps"] = row["bytes_sent"] / row["t_comm_us"] / 1e3
                row["ref_algbw_GBps"] = row["bytes_sent"] / t_ref / 1e3
        if world == 1:
            row["note"] = "ep=1: nothing on the wire (the all-to-all's one block stays local)"
        out.append(row)
    return out


# ---- driver ------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench low-latency``: per EP size the low_latency rows, then the baselines'; 1 if a step failed."""
    # Bad input raises here, before any rank starts.
    sweep = EpSweep.from_args(args, args.tokens)
    device, warmup, iters, ep_sizes = sweep.device, sweep.warmup, sweep.iters, sweep.ep_sizes
    if args.capacity is not None and args.capacity < max(args.tokens):
        raise ValueError(f"--capacity must be >= the largest --tokens {max(args.tokens)}, got {args.capacity}")
    configs = {p: bench_config(args.preset, args.experts_per_gpu, p, args.hidden_size) for p in ep_sizes}
    fp8_modes = FP8_CHOICES[args.fp8]
    if True in fp8_modes and configs[ep_sizes[0]].hidden_size % 128:
        raise ValueError(
            f"fp8 dispatch needs H a multiple of 128, got {configs[ep_sizes[0]].hidden_size}; "
            "use --fp8 off or --hidden-size"
        )

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "low_latency.json"
    meta = result_meta(device, max(ep_sizes))
    meta.update(
        preset=args.preset,
        experts_per_gpu=args.experts_per_gpu,
        ep_sizes=ep_sizes,
        tokens_per_rank=args.tokens,
        warmup=warmup,
        iters=iters,
        quick=args.quick,
        targets=TARGETS,
        model_note=f"{args.preset} dims with {args.experts_per_gpu} routed experts per GPU (E = "
        f"{args.experts_per_gpu} x EP), as real decode deployments keep (2-9 per GPU), not all of "
        "the model's experts",
        timing="low_latency: CUDA-graph replays (dispatch, combine, layer: three graphs) and graph-replayed "
        "raw all_to_all_single of the same fixed blocks; baselines: eager, CUDA events from hooks; "
        "ranks lined up (synchronize + barrier) before every timed call"
        if device == "cuda"
        else "host clock, eager (CPU smoke: not a measurement)",
        aggregation="per-rank medians; times: slowest rank; bytes: mean per rank",
    )
    results = ResultFile(out_path, meta)
    started = time.perf_counter()
    for p in ep_sizes:
        cfg = configs[p]
        common = row_labels(args, cfg, device)
        pool = RankPool(p, device)
        # Paths that cannot run here are left out, not failed: no Triton kernels on CPU (unless Triton's
        # interpreter runs them, TRITON_INTERPRET=1: a smoke run). At EP 1 symm_mem writes the rank's
        # own symmetric buffer (no wire: its host time and kernels alone).
        kernels = [k for k in args.kernels if device == "cuda" or k == "torch" or triton_interpreting()] or ["torch"]
        paths = [
            (k, t) for k in kernels for t in args.transports if t == "nccl" or (k == "triton" and device == "cuda")
        ]
        jobs: list[tuple[str, Callable[..., list[dict]], tuple]] = [
            (
                "low_latency",
                low_latency_rank,
                (
                    cfg,
                    args.tokens,
                    args.capacity,
                    fp8_modes,
                    paths,
                    warmup,
                    iters,
                    args.seed,
                    tuple(args.index_graphs),
                    tuple(args.expert_kernels),
                ),
            )
        ]
        jobs += [(name, baseline_rank, (cfg, name, args.tokens, warmup, iters, args.seed)) for name in args.baselines]
        try:
            for name, fn, fn_args in jobs:
                results.add_timed_step(
                    f"ep={p} {name}",
                    lambda: summarise(pool.run(fn, *fn_args), common, name),
                    {"bench": "low_latency", **common, "ep": p, "dispatcher": name},
                    started,
                )
        finally:
            pool.close()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    results.save()
    print_table(results.rows, meta)
    print(f"wrote {out_path}")
    return 1 if results.errors else 0


def _setting_label(row: dict) -> str:
    """How a row's eager forward ran its index work: '' (index graphs), '/no-ig', '/fixed-rows'; and
    '/experts-K' where the routed experts' kernels were not left to "auto"."""
    experts = "" if row.get("expert_kernels", "auto") == "auto" else f"/experts-{row['expert_kernels']}"
    if not row.get("index_graphs", True):
        return "/no-ig" + experts
    return ("/fixed-rows" if row.get("fixed_expert_rows") else "") + experts


def print_table(rows: list[dict], meta: dict) -> None:
    console = bench_console(170)
    console.print(
        f"{meta.get('gpu') or meta['device']} x{meta['world_size']}, torch {meta['torch']}, nccl "
        f"{meta['nccl']}; {meta['model_note']}; {meta['iters']} iters (median, slowest rank)"
    )
    table = bench_table(
        "low-latency decode: µs per phase; ref = raw all_to_all_single on the same bytes",
        "ep, T, dispatcher, path, wire, graph, dispatch, ref, x, combine, ref, x, layer, b2b, KB sent",
        left=("dispatcher", "path", "wire"),
    )
    for r in rows:
        if "error" in r:
            table.add_row(str(r["ep"]), "-", r["dispatcher"], "[red]error[/]")
            continue
        at_target = r["tokens_per_rank"] == TARGETS["tokens_per_rank"] and r["graph"]

        def mark(value, key, limit):
            text = fmt(r.get(key), ".2f" if key.endswith("overhead") else ".0f")
            if not at_target or value is None:
                return text
            return f"[{'green' if value <= limit else 'red'}]{text}[/]"

        table.add_row(
            str(r["ep"]),
            str(r["tokens_per_rank"]),
            r["dispatcher"],
            f"{r['kernels']}/{r['transport']}{_setting_label(r)}" if "kernels" in r else "",
            r["dispatch_dtype"],
            "y" if r["graph"] else "n",
            mark(r["t_dispatch_us"], "t_dispatch_us", TARGETS["t_dispatch_us"]),
            fmt(r.get("ref_t_dispatch_us")),
            mark(r.get("dispatch_overhead"), "dispatch_overhead", TARGETS["overhead_vs_nccl"]),
            mark(r["t_combine_us"], "t_combine_us", TARGETS["t_combine_us"]),
            fmt(r.get("ref_t_combine_us")),
            mark(r.get("combine_overhead"), "combine_overhead", TARGETS["overhead_vs_nccl"]),
            fmt(r["t_layer_us"]),
            fmt(r.get("t_layer_b2b_us")),
            f"{r['bytes_sent'] / 1e3:.1f}",
        )
    console.print(table)

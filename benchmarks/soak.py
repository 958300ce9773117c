"""Soak: thousands of forwards per dispatcher x overlap mode with fixed shapes. Nothing may grow.

Per (dispatcher, overlap mode) every rank builds one layer, runs ``--warmup`` forwards, then
``--forwards`` more on the same input, and reports (the row holds the worst rank):

- host memory: resident set size (``/proc/self/statm``) after warm-up and after the soak, and at 11
  checkpoints (after the first forward, then every tenth; ``rss_kib_checkpoints_rank0``; its
  file-backed part, mostly library code paged in as it first runs, ``rss_file_kib_*``), and at the
  same checkpoints the C heap's bytes in use and held (glibc ``mallinfo2``, ``malloc_in_use_kib_*``,
  ``malloc_held_kib_*``: a native leak grows the first, fragmentation the second only), and the
  three mappings whose resident pages grew most from the first checkpoint to the last
  (``rss_growth_by_mapping_rank0``: ``[heap]``, a library, ``[anon]`` of a size); the garbage
  collector's object count at the same checkpoints (a list that grows per forward shows up here first:
  without a leak it never rises, and is usually exactly equal);
- device memory (CUDA): ``torch.cuda.memory_allocated`` before/after and the peak during the soak;
- hooks registered on the layer's dispatchers before/after (strategies register per forward and
  must leave nothing behind);
- outputs: how many forwards differ bitwise from the first (same input, fixed shapes), and by how much;
- CUDA-graph replays (``--graph-replays``, GPU only, for dispatchers that declare
  ``graph_capturable``): the whole layer captured once, replayed N times, same checks (row ``graph``).

Flat means: device memory and hook count exactly equal from the first checkpoint to the last; the
Python object count at the last checkpoint at most ``--objects-tolerance`` above its lowest one (a
leak of one object per forward is thousands over a soak; a transient object or two, a gloo thread's
or one freed early, is not a leak); host RSS within ``--rss-tolerance-kib`` (the C allocator may still
settle a few pages).
``--check`` makes any violation the exit status (1).
Before the first case the ranks run ``--settle`` unmeasured forwards (a fresh process's allocator
grows for a few thousand forwards whatever it runs; ``meta.settle`` records by how much).
Rows are result-file JSON (``bench="soak"``), rewritten after every case so a cut-off run keeps them.

Usage (repo root):
  CPU:  python benchmarks/soak.py --device cpu --ranks 2 --forwards 2000 --out benchmarks/results/soak_cpu.json
  GPU:  python benchmarks/soak.py --device cuda --forwards 10000 --graph-replays 10000 --out $OUT/soak_gpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch import DISPATCHERS
from moe_sbo.launch.failures import RankError
from moe_sbo.launch.group import resolve_device
from moe_sbo.launch.ranks import RankPool
from moe_sbo.layer import MoELayer
from moe_sbo.measure.options import add_rank_args, default_dtype_name, resolve_ranks, result_path
from moe_sbo.measure.results import result_meta
from moe_sbo.measure.timing import line_up
from moe_sbo.overlap import OVERLAP_MODES
from moe_sbo.overlap.stages import run_interleaved
from moe_sbo.overlap.tbo import dispatcher_for
from moe_sbo.streams import capture_graph

CHECKPOINTS = 10


def host_rss_kib() -> int:
    """This process's resident set size in KiB (``/proc``; elsewhere the peak RSS, the best available)."""
    try:
        return _statm_kib()[0]
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak // 1024 if sys.platform == "darwin" else peak


def _statm_kib() -> tuple[int, int]:
    """(resident, resident and file-backed) in KiB from ``/proc/self/statm``. File-backed pages are
    mostly the code of the libraries the process runs: they grow as code runs that had not run yet,
    and are no allocation of the process's."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    return int(fields[1]) * page_kib, int(fields[2]) * page_kib


def rss_file_kib() -> int:
    """The file-backed part of ``host_rss_kib`` (-1 without ``/proc``)."""
    try:
        return _statm_kib()[1]
    except OSError:
        return -1


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc(name: str):
    """The C library's function ``name`` in this process, or None (another C library, an older glibc)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


MALLINFO2 = _libc("mallinfo2")  # glibc 2.33+
if MALLINFO2 is not None:
    MALLINFO2.restype = _Mallinfo2
MALLOC_TRIM = _libc("malloc_trim")


def rss_by_mapping() -> dict[tuple[str, str], tuple[int, int]]:
    """Resident KiB of each mapping of this process (``/proc/self/smaps``): (start address, name) ->
    (size KiB, resident KiB); {} without ``/proc``. The heap is keyed by name alone (it grows at
    its end)."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    key, size = ("", ""), 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:  # line by line: reading it whole would itself grow the heap being measured
                if line.startswith("Rss:"):
                    out[key] = (size, int(line.split()[1]))
                elif not line.split(maxsplit=1)[0].endswith(":"):  # a header: range perms offset dev inode [name]
                    fields = line.split()
                    start, end = (int(v, 16) for v in fields[0].split("-"))
                    name = fields[5] if len(fields) > 5 else "[anon]"
                    key, size = (("", name) if name == "[heap]" else (hex(start), name)), (end - start) // 1024
    except OSError:
        return {}
    return out


def top_growth(before: dict, after: dict, most: int = 3) -> list[dict]:
    """The mappings whose resident KiB grew most between two ``rss_by_mapping`` readings."""
    grown = []
    for key, (size, rss) in after.items():
        growth = rss - before.get(key, (0, 0))[1]
        if growth > 0:
            grown.append({"mapping": key[1], "size_kib": size, "growth_kib": growth})
    return sorted(grown, key=lambda g: -g["growth_kib"])[:most]


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: give free heap pages back to the system (the top of the heap, and
    whole free pages inside it), so that RSS counts the pages in use, not the allocator's slack.
    False where unavailable. It cannot release memory in use: a leak survives it."""
    if MALLOC_TRIM is None:
        return False
    MALLOC_TRIM(0)
    return True


def malloc_kib() -> tuple[int, int]:
    """The C heap in KiB (glibc's ``mallinfo2``, over every arena): (in use: ``uordblks`` +
    ``hblkhd``, what it has handed out and not had back; held: ``arena`` + ``hblkhd``, what it has
    taken from the system). (-1, -1) where unavailable. A native leak grows "in use"; fragmentation
    grows "held" but not "in use"; RSS that grows with neither is memory outside the C heap
    (Python's own object arenas, a library's own mappings)."""
    if MALLINFO2 is None:
        return -1, -1
    info = MALLINFO2()
    return (info.uordblks + info.hblkhd) // 1024, (info.arena + info.hblkhd) // 1024


def _hook_count(layer: MoELayer, tbo: bool) -> int:
    """Hooks on the dispatchers the soak uses (micro-batch 1's twin too under two-batch overlap)."""
    return sum(dispatcher_for(layer, mb).hooks.count() for mb in ((0, 1) if tbo else (0,)))


def _forward(layer: MoELayer, x_TH: torch.Tensor, tbo: bool) -> torch.Tensor:
    if not tbo:
        return layer(x_TH)
    half = x_TH.shape[0] // 2
    return torch.cat(
        run_interleaved(
            layer.stages(x_TH[:half], dispatcher=dispatcher_for(layer, 0)),
            layer.stages(x_TH[half:], dispatcher=dispatcher_for(layer, 1)),
            delay=0,
        )
    )


class _Watch:
    """Memory and hooks when a soak phase starts (after warm-up), and the same when it ends."""

    def __init__(self, layer: MoELayer, device: torch.device, tbo: bool):
        self.layer, self.device, self.tbo = layer, device, tbo
        gc.collect()
        self.rss_kib = host_rss_kib()
        self.hooks = _hook_count(layer, tbo)
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.allocated = torch.cuda.memory_allocated(device)

    def report(self, soaked: dict) -> dict:
        gc.collect()
        out = {
            **soaked,
            "rss_kib_before": self.rss_kib,
            "rss_kib_after": host_rss_kib(),
            "hooks_before": self.hooks,
            "hooks_after": _hook_count(self.layer, self.tbo),
        }
        if self.cuda:
            torch.cuda.synchronize(self.device)
            out.update(
                cuda_allocated_before=self.allocated,
                cuda_allocated_after=torch.cuda.memory_allocated(self.device),
                cuda_peak_allocated=torch.cuda.max_memory_allocated(self.device),
            )
        return out


def _soak(run, y_first: torch.Tensor, count: int, trim: bool = False) -> dict:
    """``count`` calls of ``run()``, each output compared with ``y_first``.

    Host RSS and the garbage collector's object count are read after the first call and then after
    every tenth of the calls, at the same point of this loop, so without a leak the object count
    stays where it was, give or take a transient object. ``trim``: at each checkpoint, after those
    readings, ``malloc_trim`` and the RSS once more (``rss_trimmed_kib_checkpoints``).
    """
    rss_kib, file_kib, in_use_kib, held_kib, objects, trimmed_kib = [], [], [], [], [], []
    differing, max_abs_diff = 0, 0.0
    every = max(count // CHECKPOINTS, 1)
    start = time.perf_counter()
    mappings_first: dict = {}
    for i in range(count):
        y = run()
        if not torch.equal(y, y_first):
            differing += 1
            max_abs_diff = max(max_abs_diff, (y.float() - y_first.float()).abs().max().item())
        if i == 0 or (i + 1) % every == 0:
            gc.collect()
            objects.append(len(gc.get_objects()))
            rss_kib.append(host_rss_kib())
            file_kib.append(rss_file_kib())
            in_use, held = malloc_kib()
            in_use_kib.append(in_use)
            held_kib.append(held)
            if trim and malloc_trim():
                trimmed_kib.append(host_rss_kib())
            if i == 0:
                mappings_first = rss_by_mapping()
    return {
        "rss_growth_by_mapping": top_growth(mappings_first, rss_by_mapping()),
        "forwards": count,
        "t_forward_us": (time.perf_counter() - start) / max(count, 1) * 1e6,
        "outputs_differing": differing,
        "max_abs_diff": max_abs_diff,
        "rss_kib_checkpoints": rss_kib,
        "rss_file_kib_checkpoints": file_kib,
        "malloc_in_use_kib_checkpoints": in_use_kib,
        "malloc_held_kib_checkpoints": held_kib,
        "rss_trimmed_kib_checkpoints": trimmed_kib,
        "py_objects_checkpoints": objects,
    }


def soak_rank(device: torch.device, spec: dict) -> list[dict]:
    """One rank's soak of one (dispatcher, overlap mode): the eager row, and the graph row if any."""
    cfg = get_preset(spec["preset"])
    dtype = getattr(torch, spec["dtype"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    options = (
        {"max_tokens_per_rank": spec["tokens"], "kernels": spec["kernels"], "transport": spec["transport"]}
        if spec["dispatcher"] == "low_latency"
        else None
    )
    layer = MoELayer(
        cfg,
        dispatcher=spec["dispatcher"],
        overlap=spec["overlap"],
        dtype=dtype,
        device=device,
        seed=spec["seed"],
        dispatcher_options=options,
    )
    generator = torch.Generator(device=device).manual_seed(spec["seed"] * 1000 + rank)
    x_TH = torch.randn(spec["tokens"], cfg.hidden_size, generator=generator, device=device).to(dtype)
    rows = []
    # What low_latency resolved "auto" to on this device and group (the same on every rank).
    path = (
        {
            "kernels": "triton" if layer.dispatcher.uses_triton(device) else "torch",
            "transport": layer.dispatcher.transport_for(device),
        }
        if spec["dispatcher"] == "low_latency"
        else {}
    )
    with torch.inference_mode():
        y_first = _forward(layer, x_TH, spec["tbo"]).clone()
        for _ in range(spec["warmup"]):
            _forward(layer, x_TH, spec["tbo"])
        watch = _Watch(layer, device, spec["tbo"])
        soaked = _soak(lambda: _forward(layer, x_TH, spec["tbo"]), y_first, spec["forwards"], spec["trim"])
        rows.append({"graph": False, **path, **watch.report(soaked)})

        capturable = getattr(type(layer.dispatcher), "graph_capturable", False)
        if device.type == "cuda" and capturable and spec["graph_replays"] and not spec["tbo"]:
            x_static = x_TH.clone()
            line_up(device)  # every rank captures (and warms up) its collectives together
            graph, y_static = capture_graph(lambda: layer(x_static))
            graph.replay()
            y_graph_first = y_static.clone()

            def replay() -> torch.Tensor:
                graph.replay()
                return y_static

            watch = _Watch(layer, device, False)
            row = watch.report(_soak(replay, y_graph_first, spec["graph_replays"], spec["trim"]))
            # The replays compute what the eager forward did (same kernels, same input).
            row["graph_vs_eager_max_abs_diff"] = (y_graph_first.float() - y_first.float()).abs().max().item()
            rows.append({"graph": True, **path, **row})
            del graph
    return rows


# ---- the parent: one pool call per case, rows with the worst rank --------------------------------------


def _rise_at_end(checkpoints: list[int]) -> int:
    """How far a count ends above its lowest checkpoint: an early fall (something made before the
    soak freed) must not hide a later rise, and a transient rise in the middle is not growth."""
    return checkpoints[-1] - min(checkpoints)


def summarise(per_rank: list[list[dict]], spec: dict, ep: int) -> list[dict]:
    rows = []
    for variant in zip(*per_rank):  # eager row, then graph row, each across ranks
        row = {
            "bench": "soak",
            "preset": spec["preset"],
            "ep": ep,
            "tokens_per_rank": spec["tokens"],
            "dispatcher": spec["dispatcher"],
            "overlap": spec["overlap"],
            "tbo": spec["tbo"],
            "dtype": spec["dtype"],
            "graph": variant[0]["graph"],
            "warmup": spec["warmup"],
            "forwards": variant[0]["forwards"],
        }
        # Flat after warm-up: from the soak's first checkpoint to its last (the warm-up ended before it).
        row["rss_growth_kib"] = max(r["rss_kib_checkpoints"][-1] - r["rss_kib_checkpoints"][0] for r in variant)
        row["rss_kib_before"] = [r["rss_kib_before"] for r in variant]
        row["rss_kib_after"] = [r["rss_kib_after"] for r in variant]
        row["rss_kib_checkpoints_rank0"] = variant[0]["rss_kib_checkpoints"]
        row["rss_file_kib_checkpoints_rank0"] = variant[0]["rss_file_kib_checkpoints"]
        row["rss_growth_by_mapping_rank0"] = variant[0]["rss_growth_by_mapping"]
        row["malloc_in_use_kib_checkpoints_rank0"] = variant[0]["malloc_in_use_kib_checkpoints"]
        row["malloc_held_kib_checkpoints_rank0"] = variant[0]["malloc_held_kib_checkpoints"]
        row["malloc_in_use_growth_kib"] = max(
            r["malloc_in_use_kib_checkpoints"][-1] - r["malloc_in_use_kib_checkpoints"][0] for r in variant
        )
        if all(r["rss_trimmed_kib_checkpoints"] for r in variant):
            row["rss_trimmed_kib_checkpoints_rank0"] = variant[0]["rss_trimmed_kib_checkpoints"]
            row["rss_trimmed_growth_kib"] = max(
                r["rss_trimmed_kib_checkpoints"][-1] - r["rss_trimmed_kib_checkpoints"][0] for r in variant
            )
        row["py_objects_checkpoints_rank0"] = variant[0]["py_objects_checkpoints"]
        row["py_objects_growth"] = max(_rise_at_end(r["py_objects_checkpoints"]) for r in variant)
        row["hooks_growth"] = max(r["hooks_after"] - r["hooks_before"] for r in variant)
        row["hooks_after"] = max(r["hooks_after"] for r in variant)
        for key in ("kernels", "transport"):  # low_latency only: the path that ran
            if key in variant[0]:
                row[key] = variant[0][key]
        for key in ("outputs_differing", "max_abs_diff", "t_forward_us", "graph_vs_eager_max_abs_diff"):
            if key in variant[0]:
                row[key] = max(r[key] for r in variant)
        if "cuda_allocated_before" in variant[0]:
            row["cuda_allocated_growth"] = max(r["cuda_allocated_after"] - r["cuda_allocated_before"] for r in variant)
            row["cuda_allocated_before"] = max(r["cuda_allocated_before"] for r in variant)
            row["cuda_peak_allocated"] = max(r["cuda_peak_allocated"] for r in variant)
        rows.append(row)
    return rows


def violations(row: dict, rss_tolerance_kib: int, objects_tolerance: int = 8) -> list[str]:
    """What is not flat (or not stable) in a summary row; empty when the case passed."""
    bad = []
    if row.get("error"):
        return [f"failed: {row['error'][:200]}"]
    if row["hooks_growth"] or row["hooks_after"]:
        bad.append(f"hooks grew by {row['hooks_growth']} ({row['hooks_after']} left)")
    if row["py_objects_growth"] > objects_tolerance:
        bad.append(f"{row['py_objects_growth']} more Python objects")
    if row["rss_growth_kib"] > rss_tolerance_kib:
        bad.append(f"host RSS grew by {row['rss_growth_kib']} KiB")
    if row.get("cuda_allocated_growth"):
        bad.append(f"CUDA memory grew by {row['cuda_allocated_growth']} B")
    # On CUDA drift is reported, not failed: combine_sm's SM budget (and auto, which may settle on it
    # after the first forward) can pick another cuBLAS kernel than the first forward did.
    if row["outputs_differing"] and row.get("device") == "cpu":
        bad.append(f"{row['outputs_differing']} outputs differ bitwise (CPU is deterministic)")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_args(parser)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank (fixed shapes)")
    parser.add_argument("--forwards", type=int, default=None, help="per case (default: 10000 GPU, 2000 CPU)")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--graph-replays", type=int, default=None, help="GPU: CUDA-graph replays (default --forwards)")
    parser.add_argument("--dispatchers", nargs="+", default=["all"])
    parser.add_argument("--overlaps", nargs="+", default=["all"])
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="low_latency: its kernel path (rows say which ran)",
    )
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl", "symm_mem", "copy_engine"],
        help="low_latency: its transport (rows say which ran; symm_mem and copy_engine need CUDA)",
    )
    parser.add_argument("--tbo", action="store_true", help="also soak two-batch overlap (micro-batches 0 and 1)")
    parser.add_argument(
        "--settle",
        type=int,
        default=3000,
        help="forwards run once before any case, unmeasured, so the ranks' allocator settles",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-tolerance-kib", type=int, default=1024)
    parser.add_argument(
        "--trim",
        action="store_true",
        help="at each checkpoint also read the RSS after glibc's malloc_trim (rss_trimmed_*): the pages "
        "in use without the allocator's free slack (this changes the later raw readings too)",
    )
    parser.add_argument(
        "--objects-tolerance", type=int, default=8, help="Python objects the count may end above its lowest checkpoint"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when any case is not flat or not stable")
    parser.add_argument("--out", required=True, help="JSON file (a directory gets soak_<device>.json)")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    ranks = resolve_ranks(args.ranks, device)
    forwards = args.forwards or (10_000 if device == "cuda" else 2_000)
    dispatchers = sorted(DISPATCHERS) if args.dispatchers == ["all"] else args.dispatchers
    overlaps = list(OVERLAP_MODES) if args.overlaps == ["all"] else args.overlaps
    for name in dispatchers:
        if name not in DISPATCHERS:
            raise SystemExit(f"--dispatchers must be among {sorted(DISPATCHERS)}, got {name!r}")
    for mode in overlaps:
        if mode not in OVERLAP_MODES:
            raise SystemExit(f"--overlaps must be among {list(OVERLAP_MODES)}, got {mode!r}")
    get_preset(args.preset).experts_per_rank(ranks)
    out = result_path(args.out, "soak", device)
    dtype = args.dtype or default_dtype_name(device)
    meta = result_meta(device=device, world_size=ranks)
    meta.update(
        preset=args.preset,
        forwards=forwards,
        warmup=args.warmup,
        tokens_per_rank=args.tokens,
        memory="host: RSS from /proc/self/statm after gc.collect(); device: torch.cuda.memory_allocated; "
        "rows hold the worst rank",
    )
    rows: list[dict] = []
    specs = [
        {
            "preset": args.preset,
            "dtype": dtype,
            "tokens": args.tokens,
            "dispatcher": name,
            "overlap": mode,
            "tbo": tbo,
            "kernels": args.kernels,
            "transport": args.transport,
            "warmup": args.warmup,
            "forwards": forwards,
            "seed": args.seed,
            "graph_replays": forwards if args.graph_replays is None else args.graph_replays,
            "trim": args.trim,
        }
        for name in dispatchers
        for mode in overlaps
        for tbo in ((False, True) if args.tbo else (False,))
    ]
    pool = RankPool(ranks, device)
    started = time.perf_counter()
    failed = 0
    try:
        if args.settle:
            # A fresh process's C allocator keeps growing for a few thousand forwards whatever runs
            # (measured: +2.7 MiB over 3000 CPU forwards, then flat; the same case run later is flat),
            # so the pool settles once on the first case before any case is measured.
            settle = summarise(
                pool.run(soak_rank, dict(specs[0], forwards=args.settle, graph_replays=0)), specs[0], ranks
            )[0]
            meta["settle"] = {
                k: settle[k]
                for k in (
                    "dispatcher",
                    "overlap",
                    "forwards",
                    "rss_growth_kib",
                    "rss_kib_checkpoints_rank0",
                    "py_objects_growth",
                )
            }
            print(
                f"settled the ranks with {args.settle} forwards of {specs[0]['dispatcher']} "
                f"{specs[0]['overlap']}: rss +{settle['rss_growth_kib']} KiB (not a case)",
                flush=True,
            )
        for spec in specs:
            label = f"{spec['dispatcher']:<12} {spec['overlap']:<10}" + (" tbo" if spec["tbo"] else "")
            t0 = time.perf_counter()
            try:
                new_rows = summarise(pool.run(soak_rank, spec), spec, ranks)
            except RankError as exc:
                new_rows = [
                    {
                        "bench": "soak",
                        "dispatcher": spec["dispatcher"],
                        "overlap": spec["overlap"],
                        "tbo": spec["tbo"],
                        "error": str(exc)[-3000:],
                    }
                ]
            for row in new_rows:
                row["device"] = device
                problems = violations(row, args.rss_tolerance_kib, args.objects_tolerance)
                row["flat"] = not problems
                failed += bool(problems)
                kind = "graph" if row.get("graph") else "eager"
                detail = (
                    "; ".join(problems)
                    if problems
                    else (
                        f"rss +{row['rss_growth_kib']} KiB, objects +{row['py_objects_growth']}, hooks "
                        f"+{row['hooks_growth']}, differing {row['outputs_differing']}, "
                        f"{row['t_forward_us']:.0f} us/forward"
                        + (f", cuda +{row['cuda_allocated_growth']} B" if "cuda_allocated_growth" in row else "")
                    )
                )
                print(
                    f"[{time.perf_counter() - started:7.1f}s] {label} {kind:<5} "
                    f"({time.perf_counter() - t0:5.1f}s): {'ok' if not problems else 'NOT FLAT'}: {detail}",
                    flush=True,
                )
            rows.extend(new_rows)
            meta["wall_s"] = round(time.perf_counter() - started, 1)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    finally:
        pool.close()
    print(f"{len(rows)} rows, {failed} not flat; written to {out}")
    return 1 if (args.check and failed) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Does host memory grow with eager collectives alone? Raw ``torch.distributed`` calls, no moe-sbo layer.

The soak (``soak.py``) found host RSS growing by ~0.4 KiB per eager forward on one GPU whenever a
forward made NCCL calls, and flat at two GPUs with the fused ``low_latency`` path. This probe takes
the layer out: per world size, every rank calls one collective (or one plain tensor op, the baseline)
``--calls`` times after ``--warmup`` calls, and reads its resident set size (after ``gc.collect()``
and a device sync) at 11 checkpoints. A growth that shows here belongs to the process group, not to
moe-sbo. Rows hold the worst rank; ``meta.env`` records the PyTorch NCCL settings the run had (e.g.
``TORCH_FR_BUFFER_SIZE=0`` turns the flight recorder off).

Usage (repo root):
  python benchmarks/probe_host_growth.py --device cuda --ranks 1 2 --out $OUT/host_growth.json
  python benchmarks/probe_host_growth.py --device cpu --ranks 1 2 --calls 2000 --out /tmp/host_growth.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from moe_sbo.cli.options import result_path
from moe_sbo.launch.group import resolve_device
from moe_sbo.launch.ranks import RankPool
from moe_sbo.measure.results import result_meta
from soak import CHECKPOINTS, host_rss_kib

# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single; 2.11 has only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
KINDS = ("tensor_op", "all_reduce", "all_gather_into_tensor", "all_to_all_single")


def _call(kind: str, src: torch.Tensor, dst: torch.Tensor, small: torch.Tensor) -> None:
    if kind == "tensor_op":  # the baseline: a kernel launch and no process group
        torch.mul(src, 2, out=dst)
    elif kind == "all_reduce":  # the count exchanges' size
        dist.all_reduce(small)
    elif kind == "all_gather_into_tensor":
        _all_gather_single(dst, src)
    elif kind == "all_to_all_single":
        dist.all_to_all_single(dst, src)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grow_rank(device: torch.device, spec: dict) -> list[dict]:
    """One rank: per kind, ``warmup`` calls, then ``calls`` calls with RSS checkpoints."""
    world = dist.get_world_size()
    elems = spec["kib"] * 1024 // 4  # float32 elements each rank sends
    src = torch.ones(world * (elems // world), device=device)
    dst = torch.empty(world * src.numel(), device=device)
    rows = []
    for kind in spec["kinds"]:
        out = dst[: src.numel()] if kind in ("tensor_op", "all_to_all_single") else dst
        small = torch.zeros(8, dtype=torch.int64, device=device)
        for _ in range(spec["warmup"]):
            _call(kind, src, out, small)
        _sync(device)
        every = max(spec["calls"] // CHECKPOINTS, 1)
        rss_kib, objects = [], []
        start = time.perf_counter()
        for i in range(spec["calls"]):
            _call(kind, src, out, small)
            if i == 0 or (i + 1) % every == 0:
                _sync(device)
                gc.collect()
                objects.append(len(gc.get_objects()))
                rss_kib.append(host_rss_kib())
        _sync(device)
        t_call_us = (time.perf_counter() - start) / spec["calls"] * 1e6
        rows.append(
            {
                "kind": kind,
                "calls": spec["calls"],
                "t_call_us": t_call_us,
                "rss_kib_checkpoints": rss_kib,
                "py_objects_checkpoints": objects,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes, one pool each")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--kib", type=int, default=64, help="KiB each rank sends per call")
    parser.add_argument("--out", required=True, help="JSON file (a directory gets host_growth_<device>.json)")
    args = parser.parse_args(argv)
    if args.calls < 2 or args.warmup < 0 or args.kib < 1 or min(args.ranks) < 1:
        parser.error(
            "--calls must be >= 2 (growth is last checkpoint minus first), --warmup >= 0, --kib >= 1 "
            f"and every --ranks >= 1; got {args.calls}, {args.warmup}, {args.kib}, {args.ranks}"
        )

    device = resolve_device(args.device)
    out = result_path(args.out, "host_growth", device)
    meta = result_meta(device=device, world_size=max(args.ranks))
    meta.update(
        calls=args.calls,
        warmup=args.warmup,
        kib=args.kib,
        env={k: v for k, v in sorted(os.environ.items()) if k.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_"))},
        memory="host: RSS from /proc/self/statm after gc.collect() and a device sync; rows hold the worst rank",
    )
    rows = []
    spec = {"kinds": args.kinds, "calls": args.calls, "warmup": args.warmup, "kib": args.kib}
    for world in args.ranks:
        pool = RankPool(world, device)
        try:
            per_rank = pool.run(grow_rank, spec)
        finally:
            pool.close()
        for variant in zip(*per_rank):
            growth = max(r["rss_kib_checkpoints"][-1] - r["rss_kib_checkpoints"][0] for r in variant)
            row = {
                "bench": "host_growth",
                "device": device,
                "world_size": world,
                "kind": variant[0]["kind"],
                "calls": args.calls,
                "rss_growth_kib": growth,
                "rss_growth_bytes_per_call": round(growth * 1024 / max(args.calls - 1, 1), 1),
                "py_objects_growth": max(
                    r["py_objects_checkpoints"][-1] - r["py_objects_checkpoints"][0] for r in variant
                ),
                "t_call_us": max(r["t_call_us"] for r in variant),
                "rss_kib_checkpoints_rank0": variant[0]["rss_kib_checkpoints"],
            }
            rows.append(row)
            print(
                f"world {world} {row['kind']:<24} rss +{growth} KiB over {args.calls} calls "
                f"({row['rss_growth_bytes_per_call']} B/call), objects +{row['py_objects_growth']}, "
                f"{row['t_call_us']:.1f} us/call",
                flush=True,
            )
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

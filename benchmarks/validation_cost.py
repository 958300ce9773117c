"""What validating a forward before its first collective costs, against one decode step.

Per dispatcher, on every rank, one layer at decode size (``--tokens`` per rank):

- ``t_checks_us``: the checks alone, called directly with the forward's real tensors: the layer's input
  check (shape, dtype, device: host-only), the dispatcher's as a forward runs it
  (``_validate_dispatch_input``: shapes, dtypes and devices checked once per input signature, then the
  expert-id range: one host read of min/max for the variable-size schemes, a device-side assert for
  ``low_latency`` on CUDA), the combine input check. On CUDA each call is followed by a synchronize,
  so a host read shows.
- ``t_checks_host_us``: the same checks back to back without that synchronize (one at the end), per
  call: what they add to the host's critical path of an eager step, which is what bounds eager decode
  (the GPU runs ahead of nothing). ``host_share`` = ``t_checks_host_us / t_layer_us``.
- ``t_layer_us`` / ``t_layer_unchecked_us``: the whole forward with the checks, and with the three check
  methods replaced by no-ops on this layer's instances (inputs are valid, so the result is the same);
  A and B alternate in rounds so drift hits both. ``check_share`` = ``t_checks_us / t_layer_us`` and
  ``ab_share`` = (checked - unchecked) / checked: the issue's bound is 2 % of a decode step on GPU.
- ``t_agree_us``: a one-element all-reduce plus its host read: what making every rank agree that all
  inputs are valid would add per forward if it were a separate collective (the alternative to
  failing on the offending rank and letting the launcher stop the others; see docs/RELIABILITY.md).

``low_latency`` replayed from a CUDA graph runs no Python, hence no check at all: its cost there is 0.
Rows are result-file JSON (``bench="validation_cost"``); times are medians, the slowest rank's.

Usage (repo root):
  CPU:  python benchmarks/validation_cost.py --device cpu --ranks 2 --out benchmarks/results/validation_cost_cpu.json
  GPU:  python benchmarks/validation_cost.py --device cuda --preset deepseek-v3 --experts-per-gpu 8 --tokens 128 \\
            --out $OUT/validation_cost_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moe_sbo.cli.options import add_rank_args, default_dtype_name, resolve_ranks, result_path
from moe_sbo.config import get_preset
from moe_sbo.dispatch import DISPATCHERS, CombineInput, DispatchInput
from moe_sbo.launch.failures import RankError
from moe_sbo.launch.group import resolve_device
from moe_sbo.launch.ranks import RankPool
from moe_sbo.layer import MoELayer
from moe_sbo.measure.results import result_meta
from moe_sbo.measure.timing import line_up, time_fn

CHECKS = ("_validate_dispatch_input", "_check_combine_input")


def _config(preset: str, experts_per_gpu: int | None, ep: int):
    """``preset``, or with E = experts_per_gpu x EP (decode deployments keep 2-9 routed experts per GPU)."""
    if experts_per_gpu is None:
        return get_preset(preset)
    from bench_low_latency import bench_config  # benchmarks/ is on sys.path when run as a script

    return bench_config(preset, experts_per_gpu, ep, None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_us(fn, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _skip(*args, **kwargs) -> None:
    return None


def cost_rank(device: torch.device, spec: dict) -> dict:
    """One rank's times for one dispatcher (module-level, so the rank pool can call it by name)."""
    ep = dist.get_world_size() if dist.is_initialized() else 1
    cfg = _config(spec["preset"], spec["experts_per_gpu"], ep)
    dtype = getattr(torch, spec["dtype"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    options = {"max_tokens_per_rank": spec["tokens"]} if spec["dispatcher"] == "low_latency" else None
    layer = MoELayer(cfg, dispatcher=spec["dispatcher"], dtype=dtype, device=device, seed=0, dispatcher_options=options)
    generator = torch.Generator(device=device).manual_seed(rank)
    x_TH = torch.randn(spec["tokens"], cfg.hidden_size, generator=generator, device=device).to(dtype)
    dispatcher = layer.dispatcher
    out: dict = {}
    with torch.inference_mode():
        topk = layer.router(x_TH)
        inp = DispatchInput(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
        recv = dispatcher.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
        rows_RH = recv.rows_RH()  # the expert output has this shape
        combine_inp = CombineInput(rows_RH, recv.handle)
        dispatcher.combine(rows_RH, recv.handle)  # finish the round the dispatch started

        def checks() -> None:
            layer._check_input(x_TH)
            dispatcher._validate_dispatch_input(inp)
            dispatcher._check_combine_input(combine_inp)

        for _ in range(spec["warmup"]):
            checks()
        out["t_checks_us"] = _median_us(checks, device, spec["iters"])
        host_times = []
        for _ in range(spec["rounds"]):
            _sync(device)
            start = time.perf_counter()
            for _ in range(spec["iters"]):
                checks()
            host_times.append((time.perf_counter() - start) * 1e6 / spec["iters"])
            _sync(device)
        out["t_checks_host_us"] = statistics.median(host_times)

        # A/B in alternating rounds: with checks, then with no-op checks on these instances only.
        checked, unchecked = [], []
        rounds = spec["rounds"]
        for _ in range(rounds):
            checked.append(time_fn(lambda: layer(x_TH), device, spec["warmup"], spec["iters"], graph=False))
            layer._check_input = _skip
            for name in CHECKS:
                setattr(dispatcher, name, _skip)
            unchecked.append(time_fn(lambda: layer(x_TH), device, spec["warmup"], spec["iters"], graph=False))
            del layer._check_input
            for name in CHECKS:
                delattr(dispatcher, name)
        out["t_layer_us"] = statistics.median(checked)
        out["t_layer_unchecked_us"] = statistics.median(unchecked)

        if dist.is_initialized():
            flag = torch.zeros(1, dtype=torch.int32, device=device)

            def agree() -> None:
                dist.all_reduce(flag)  # MAX or SUM of "my input is bad": one small collective
                flag.item()  # every rank must read it on the host to decide whether to raise

            line_up(device)
            for _ in range(spec["warmup"]):
                agree()
            line_up(device)
            out["t_agree_us"] = _median_us(agree, device, spec["iters"])
    return out


def summarise(per_rank: list[dict], spec: dict, ep: int, experts: int) -> dict:
    row = {
        "bench": "validation_cost",
        "preset": spec["preset"],
        "ep": ep,
        "num_experts": experts,
        "tokens_per_rank": spec["tokens"],
        "dispatcher": spec["dispatcher"],
        "overlap": "none",
        "tbo": False,
        "dtype": spec["dtype"],
        "graph": False,
    }
    for key in per_rank[0]:
        row[key] = max(r[key] for r in per_rank)  # the slowest rank's median
    row["check_share"] = row["t_checks_us"] / row["t_layer_us"]
    row["host_share"] = row["t_checks_host_us"] / row["t_layer_us"]
    row["ab_share"] = (row["t_layer_us"] - row["t_layer_unchecked_us"]) / row["t_layer_us"]
    if "t_agree_us" in row:
        row["agree_share"] = row["t_agree_us"] / row["t_layer_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_rank_args(parser)
    parser.add_argument(
        "--experts-per-gpu",
        type=int,
        default=None,
        help="routed experts per rank (E = this x ranks); default: the preset's E",
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: 128 GPU, 16 CPU)")
    parser.add_argument("--dispatchers", nargs="+", default=["all"])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True, help="JSON file (a directory gets validation_cost_<device>.json)")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    ranks = resolve_ranks(args.ranks, device)
    tokens = args.tokens or (128 if device == "cuda" else 16)
    dispatchers = sorted(DISPATCHERS) if args.dispatchers == ["all"] else args.dispatchers
    experts = _config(args.preset, args.experts_per_gpu, ranks).num_experts
    dtype = args.dtype or default_dtype_name(device)
    out = result_path(args.out, "validation_cost", device)
    meta = result_meta(device=device, world_size=ranks)
    meta.update(
        preset=args.preset,
        num_experts=experts,
        tokens_per_rank=tokens,
        iters=args.iters,
        rounds=args.rounds,
        timing="host clock around each call, synchronize before and after (CUDA); forwards via "
        "moe_sbo.measure.timing.time_fn (ranks lined up between iterations); medians; slowest rank",
    )
    rows = []
    pool = RankPool(ranks, device)
    try:
        for name in dispatchers:
            spec = {
                "preset": args.preset,
                "experts_per_gpu": args.experts_per_gpu,
                "dtype": dtype,
                "tokens": tokens,
                "dispatcher": name,
                "warmup": args.warmup,
                "iters": args.iters,
                "rounds": args.rounds,
            }
            try:
                row = summarise(pool.run(cost_rank, spec), spec, ranks, experts)
            except RankError as exc:
                row = {"bench": "validation_cost", "dispatcher": name, "error": str(exc)[-3000:]}
                print(row["error"], file=sys.stderr)
            else:
                print(
                    f"{name:<12} checks {row['t_checks_us']:8.1f} us = {100 * row['check_share']:5.2f} % of "
                    f"the layer ({row['t_layer_us']:.0f} us), host-only {row['t_checks_host_us']:.1f} us = "
                    f"{100 * row['host_share']:.2f} %; A/B {100 * row['ab_share']:+6.2f} %"
                    + (
                        f"; agreement all-reduce {row['t_agree_us']:.1f} us = {100 * row['agree_share']:.2f} %"
                        if "t_agree_us" in row
                        else ""
                    ),
                    flush=True,
                )
            rows.append(row)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    finally:
        pool.close()
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

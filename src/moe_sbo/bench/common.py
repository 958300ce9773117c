"""What the bench modes' rank functions share: the setup of a row, one cached layer
per rank, the physical references of a row (compute floor, raw wire), and one profiled forward
turned into timeline spans.

The hard part is memory across a sweep: building a DeepSeek-sized layer is costly, so a rank keeps
its last one between calls, and only the last one, so sweeping setups does not accumulate GPU memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import MoEConfig, get_preset
from ..dispatch import dispatcher_option_names, options_for_tokens
from ..layer import MoELayer
from ..measure.timing import line_up, time_fn, time_raw_all_to_all
from ..measure.trace import spans_from_trace
from ..routing.router import TopkOutput


def bench_config(preset: str, num_experts: int | None) -> MoEConfig:
    """``preset`` with ``num_experts`` routed experts (its own count when None)."""
    cfg = get_preset(preset)
    if num_experts and num_experts != cfg.num_experts:
        cfg = cfg.with_num_experts(num_experts).replace(name=f"{cfg.name}-e{num_experts}")
    return cfg


CACHED: dict[tuple, object] = {}


def cached(key: tuple, make: Callable[[], object], device: torch.device):
    """The rank's object for ``key``, kept between calls (weights are costly to make); only the last
    one is kept, so sweeping over setups does not accumulate GPU memory."""
    if key not in CACHED:
        CACHED.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        CACHED[key] = make()
    return CACHED[key]


def dispatcher_options(spec: dict, tokens: int) -> dict:
    """Options for ``spec``'s dispatcher: its capacity sized for ``tokens``, ``--transport`` and
    ``--index-rows``, where the dispatcher takes them (``low_latency``)."""
    options = options_for_tokens(spec["dispatcher"], tokens)
    if "transport" in dispatcher_option_names(spec["dispatcher"]):
        options["transport"] = spec["transport"]
    if takes_index_rows(spec):
        options["index_rows"] = True
    return options


def takes_index_rows(spec: dict) -> bool:
    """Whether ``--index-rows`` was given and ``spec``'s dispatcher takes it (``low_latency``)."""
    return bool(spec.get("index_rows")) and "index_rows" in dispatcher_option_names(spec["dispatcher"])


def layer_key(kind: str, spec: dict, options: dict) -> tuple:
    """What tells one cached layer of ``kind`` (``moe``, ``decoder``) from another: ``spec``'s model,
    dispatcher, dtypes and seed, and the dispatcher ``options`` it was built with."""
    return (
        kind,
        spec["preset"],
        spec["num_experts"],
        spec["dispatcher"],
        spec["dtype"],
        spec.get("expert_dtype"),
        spec["seed"],
        tuple(sorted(options.items())),
    )


def make_layer(device: torch.device, spec: dict, options: dict, **kwargs) -> MoELayer:
    """``spec``'s MoE layer on ``device``, its dispatcher built with ``options``; ``kwargs``: more of
    ``MoELayer``'s keywords (``eplb``)."""
    return MoELayer(
        bench_config(spec["preset"], spec["num_experts"]),
        dispatcher=spec["dispatcher"],
        dtype=getattr(torch, spec["dtype"]),
        device=device,
        seed=spec["seed"],
        dispatcher_options=options,
        expert_dtype=spec.get("expert_dtype"),
        **kwargs,
    )


def row_head(bench: str, spec: dict, ep: int) -> dict:
    """The fields every SBO and TBO row opens with: the setup it measured, the wire included."""
    cfg = bench_config(spec["preset"], spec["num_experts"])
    # transport: what --transport asked of a dispatcher that takes one (low_latency), else None.
    transport = spec["transport"] if "transport" in dispatcher_option_names(spec["dispatcher"]) else None
    return {
        "bench": bench,
        "preset": spec["preset"],
        "ep": ep,
        "num_experts": cfg.num_experts,
        "experts_per_gpu": cfg.num_experts // ep,
        "dispatcher": spec["dispatcher"],
        "transport": transport,
        **({"index_rows": True} if takes_index_rows(spec) else {}),
        "dtype": spec["dtype"],
        "expert_dtype": spec.get("expert_dtype") or spec["dtype"],
        "wire": spec["wire"],
    }


def resolved_path(dispatcher, device: torch.device) -> dict:
    """What a dispatcher with a choice of path ran (low_latency: Triton or torch kernels, the transport
    ``auto`` became), for the rows: a result must say which code moved its bytes. {} for the others."""
    if not hasattr(dispatcher, "uses_triton"):
        return {}
    return {
        "kernels": "triton" if dispatcher.uses_triton(device) else "torch",
        "transport_used": dispatcher.transport_for(device),
    }


@contextlib.contextmanager
def quiet_fds() -> Iterator[None]:
    """Send file descriptors 1 and 2 to /dev/null for the block: what C/C++ code prints there (which
    ``contextlib.redirect_stdout`` cannot catch) is dropped. Keep the block small: errors vanish too."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (1, 2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        _flush_c_stdio()  # C's buffered stdout must empty into /dev/null, not after the restore
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not POSIX): nothing buffered we know of
        pass


def profile_spans(run: Callable[[], object], device: torch.device, rank: int, trace_path: str | None) -> list[dict]:
    """Warm ``run`` up, profile one call on every rank; rank 0 returns its spans (and keeps the trace)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for _ in range(3):
        run()
    line_up(device)
    prof = torch.profiler.profile(activities=activities)
    with quiet_fds():  # the profiler's start and stop print USDT lines from C++, straight to fd 2
        prof.start()
    try:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        with quiet_fds():
            prof.stop()
    if rank != 0:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or str(Path(tmp) / "trace.json")
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # --trace: checked writable before the work
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [vars(s) for s in spans_from_trace(json.load(f))]


def floor_and_wire(
    layer: MoELayer, x_TH: torch.Tensor, topk: TopkOutput, warmup: int, iters: int, seed: int
) -> dict[str, float | str]:
    """The compute floor (router, routed experts on one dispatch's rows of ``topk``, shared experts,
    each alone) and, with peers, raw ``all_to_all_single`` of each phase's bytes: one rank's share of
    a row; and for dense experts ``expert_path``, the routed experts' GEMMs for those rows
    (``RoutedExperts.dispatched_route``)."""
    device = x_TH.device
    graph = device.type == "cuda"  # the parts' own GPU time, without launch gaps
    recv = layer.dispatcher.dispatch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)

    def routed() -> torch.Tensor:
        return layer.experts.forward_dispatched(recv)

    shared = layer.shared_experts
    out: dict[str, float | str] = {
        "t_floor_route_us": time_fn(lambda: layer.router(x_TH), device, warmup, iters, graph),
        "t_floor_routed_us": time_fn(routed, device, warmup, iters, graph),
        "t_floor_shared_us": time_fn(lambda: shared(x_TH), device, warmup, iters, graph) if shared else 0.0,
    }
    layer.dispatcher.combine(routed(), recv.handle)  # close the round it opened
    if not layer.experts.fp8:  # FP8 experts choose by graph capture too: no one path for eager and replay
        out["expert_path"] = layer.experts.dispatched_route(recv).name
    traffic = layer.dispatcher.last_traffic
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        # The largest rank's bytes: the transfer the layer waits for.
        sent = (traffic.dispatch_bytes_sent, traffic.combine_bytes_sent)
        times, _ = time_raw_all_to_all(sent, x_TH.dtype, device, warmup, iters, seed, rule="max")
        for phase, t_us in zip(("dispatch", "combine"), times):
            out[f"{phase}_bytes_sent"] = float(getattr(traffic, f"{phase}_bytes_sent"))
            out[f"ref_t_{phase}_us"] = t_us
    return out


def physical_limit(row: dict) -> dict:
    """What a summarised row's floor and wire parts add up to: ``t_floor_us`` (every ``t_floor_*_us``
    part), ``t_wire_us`` (raw dispatch + combine, with peers), ``t_limit_us`` = max of the two (no
    overlap can beat it: the compute must run and the bytes must cross) and ``limit_ratio`` =
    ``t_layer_us / t_limit_us``."""
    out = {
        "t_floor_us": sum(
            v for k, v in row.items() if k.startswith("t_floor_") and k.endswith("_us") and k != "t_floor_us"
        )
    }
    if "ref_t_dispatch_us" in row:
        out["t_wire_us"] = row["ref_t_dispatch_us"] + row["ref_t_combine_us"]
    out["t_limit_us"] = max(out["t_floor_us"], out.get("t_wire_us", 0.0))
    out["limit_ratio"] = row["t_layer_us"] / out["t_limit_us"] if out["t_limit_us"] > 0 else None
    return out


def bandwidth(row: dict) -> dict:
    """Algorithmic GB/s of a summarised row: the bytes one rank sent (mean over the ranks) over a time
    (the slowest rank's). ``dispatch_GBps``, ``combine_GBps``: over the layer's phase times;
    ``comm_GBps``: both phases over their summed time; ``ref_dispatch_GBps``, ``ref_combine_GBps``: over
    the raw ``all_to_all_single`` of the same bytes. A value is left out where its time is unknown
    (CUDA-graph rows time the layer only) or no byte crossed (one rank)."""
    out = {}

    def rate(sent: float | None, t_us: float | None) -> float | None:
        return sent / t_us / 1e3 if sent and t_us else None  # B/µs = MB/s

    for phase in ("dispatch", "combine"):
        sent = row.get(f"{phase}_bytes_sent")
        for key, t_us in (
            (f"{phase}_GBps", row.get(f"t_{phase}_us")),
            (f"ref_{phase}_GBps", row.get(f"ref_t_{phase}_us")),
        ):
            value = rate(sent, t_us)
            if value is not None:
                out[key] = value
    t_dispatch_us, t_combine_us = row.get("t_dispatch_us"), row.get("t_combine_us")
    if t_dispatch_us is not None and t_combine_us is not None:
        sent = row.get("dispatch_bytes_sent", 0) + row.get("combine_bytes_sent", 0)
        both = rate(sent, t_dispatch_us + t_combine_us)
        if both is not None:
            out["comm_GBps"] = both
    return out

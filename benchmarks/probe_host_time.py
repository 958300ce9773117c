"""Where a ``low_latency`` phase spends its host time: cProfile over the four dispatcher calls.

Every visible GPU is one rank; rank 0's profile is printed (top functions by own time) for each token
count, after warm-up, with the GPU and the ranks lined up between iterations (so the host never waits
for a full launch queue). Usage (GPU): ``python benchmarks/probe_host_time.py [--tokens 128 4096]
[--transport symm_mem] [--fixed-expert-rows] [--pieces | --regimes | --breakdown | --lines]``; writes the
text to ``--out`` too. ``--pieces`` times each building block's host cost alone instead (a Triton launch, small
torch ops, checks, each kernel wrapper); ``--regimes`` times the four calls with the ranks lined up,
after a busy host, and back to back; ``--breakdown`` times each step inside them in a forward (light
wrappers, not a profiler); ``--lines`` times every line of the hot calls (needs ``line_profiler``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from moe_sbo.config import get_preset
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer
from moe_sbo.measure.timing import DISPATCHER_CALLS, dispatcher_call_host_us, host_breakdown
from moe_sbo.streams import capture_graph

_FIXED = {False: "", True: " + fixed_expert_rows"}  # the headers' note of the option


def _probe_layer(
    device: torch.device, tokens: int, transport: str, fixed_rows: bool = False
) -> tuple[MoELayer, torch.Tensor]:
    """DeepSeek-V3 dims, 32 routed experts per rank, ``low_latency`` over ``transport`` with capacity
    ``tokens`` (and ``fixed_expert_rows`` if ``fixed_rows``) -> (layer, a bf16 input of ``tokens`` rows)."""
    cfg = get_preset("deepseek-v3").with_num_experts(32 * dist.get_world_size())
    options = {"max_tokens_per_rank": tokens, "transport": transport}
    if fixed_rows:
        options["fixed_expert_rows"] = True
    layer = MoELayer(cfg, dispatcher="low_latency", device=device, dispatcher_options=options)
    return layer, torch.randn(tokens, cfg.hidden_size, device=device).bfloat16()


def profile_rank(
    device: torch.device, tokens: int, transport: str, iters: int, top: int, fixed_rows: bool = False
) -> str:
    layer, x = _probe_layer(device, tokens, transport, fixed_rows)
    d = layer.dispatcher
    profiler = cProfile.Profile()
    walls = {"dispatch_launch": 0.0, "dispatch_wait": 0.0, "combine_launch": 0.0, "combine_wait": 0.0}
    with torch.inference_mode():
        topk = layer.router(x)
        for it in range(5 + iters):
            torch.cuda.synchronize()
            dist.barrier()
            timed = it >= 5
            if timed:
                profiler.enable()
            t0 = time.perf_counter()
            pending = d.dispatch_launch(x, topk.topk_ids_TK, topk.topk_weights_TK)
            t1 = time.perf_counter()
            recv = d.dispatch_wait(pending)
            t2 = time.perf_counter()
            if timed:
                profiler.disable()
            y = layer.experts.forward_dispatched(recv)
            if timed:
                profiler.enable()
            t3 = time.perf_counter()
            pending = d.combine_launch(y, recv.handle)
            t4 = time.perf_counter()
            d.combine_wait(pending)
            t5 = time.perf_counter()
            if timed:
                profiler.disable()
                for key, a, b in (
                    ("dispatch_launch", t0, t1),
                    ("dispatch_wait", t1, t2),
                    ("combine_launch", t3, t4),
                    ("combine_wait", t4, t5),
                ):
                    walls[key] += (b - a) * 1e6 / iters
    text = io.StringIO()
    text.write(
        f"-- {transport}{_FIXED[fixed_rows]}, {tokens} tokens, EP{dist.get_world_size()}: host µs per call (mean) "
        + ", ".join(f"{k} {v:.0f}" for k, v in walls.items())
        + "\n"
    )
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


@triton.jit
def _empty_kernel(a_ptr, b_ptr, n, m, k, N: tl.constexpr, M: tl.constexpr):
    pass


def pieces_rank(device: torch.device, tokens: int, transport: str, iters: int) -> str:
    """Host µs of each building block of a phase, alone (median of ``iters``, the GPU idle before each):
    a Triton launch, the small torch ops, our checks and hooks, each kernel wrapper, each phase."""
    import statistics

    from moe_sbo.dispatch import DispatchInput, ll_bulk, ll_kernels
    from moe_sbo.dispatch.ll_wire import RowFormat

    layer, x = _probe_layer(device, tokens, transport)
    cfg, d = layer.cfg, layer.dispatcher
    small = torch.zeros(64, device=device)
    fmt = RowFormat.make(cfg.hidden_size, cfg.num_experts_per_tok, x.dtype, False)
    out = []
    with torch.inference_mode():
        topk = layer.router(x)
        ids, weights = topk.topk_ids_TK, topk.topk_weights_TK
        ids32 = ids.int()
        layer(x)
        bufs = d.buffers(device, x.dtype, cfg.hidden_size, cfg.num_experts_per_tok)[0]
        slot_TP = torch.empty(tokens, d.ep.size, dtype=torch.int64, device=device)
        kernels = ll_bulk if tokens >= 512 else ll_kernels
        recv = bufs.dispatch_recv_SB[: d.num_slots]
        fixed = kernels.expert_layout(recv, fmt, d.ep.rank, d.num_local_experts)
        inp = DispatchInput(x, ids, weights)
        # index_graphs: set 0's staging and graphs, captured by the forward above
        staged = d.shape_sets(device, x.dtype, cfg.hidden_size, cfg.num_experts_per_tok).graphs[0]
        expert_x, _ = ll_kernels.expert_rows(d.num_slots * fmt.top_k, fmt, False, device)
        rows = (staged.layout.addresses.offset_of(expert_x),) * 2
        y, y_out = torch.zeros_like(expert_x), torch.empty_like(x)
        cases = {
            "triton empty kernel (5 args, 2 constexpr)": lambda: _empty_kernel[(1,)](small, small, 1, 2, 3, N=4, M=8),
            "torch.empty": lambda: torch.empty(tokens, 2, dtype=torch.int64, device=device),
            "torch.zeros": lambda: torch.zeros(4, 33, dtype=torch.int32, device=device),
            "cumsum": lambda: small.cumsum(0),
            "amin + _assert_async": lambda: torch._assert_async(small.amin() >= 0, "x"),
            "check_dispatch_input (all)": lambda: d._check_dispatch_input(inp),
            "validate_dispatch_input (a seen signature)": lambda: d._validate_dispatch_input(inp),
            "hooks.run (no hooks)": lambda: d.hooks.run("pre_dispatch", d, inp),
            "pack_rows": lambda: kernels.pack_rows(
                x, ids, weights.float(), bufs.dispatch_dst, slot_TP, fmt, d.num_local_experts, d.capacity
            ),
            "expert_layout": lambda: kernels.expert_layout(recv, fmt, d.ep.rank, d.num_local_experts),
            "gather_rows": lambda: ll_kernels.gather_rows(bufs.dispatch_recv_SB, fixed, fmt),
            "router": lambda: layer.router(x),
            "index_graphs: inputs read in place (checks, offsets)": lambda: staged.staging.pack_values(
                staged.pack.addresses, x, ids, weights
            ),
            "the same, int32 ids (one converting copy)": lambda: staged.staging.pack_values(
                staged.pack.addresses, x, ids32, weights
            ),
            "index_graphs: pack (table write + replay)": lambda: staged.pack(
                *staged.staging.pack_values(staged.pack.addresses, x, ids, weights)[0]
            ),
            "index_graphs: layout (table write + replay, + barrier)": lambda: staged.layout(*rows),
            "index_graphs: combine (table write + replay)": lambda: staged.combine(
                staged.combine.addresses.offset_of(y)
            ),
            "index_graphs: combine_end (table write + replay, + barrier)": lambda: staged.combine_end(
                tokens, staged.combine_end.addresses.offset_of(y_out)
            ),
            "CUDAGraph.replay, empty graph": _empty_graph(device),
        }
        if bufs.dispatch_barrier is not None:
            cases["symm_mem barrier"] = bufs.dispatch_barrier.wait
        for name, fn in cases.items():
            times = []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            out.append(f"{name:45s} {statistics.median(times):8.1f} µs")
        torch.cuda.synchronize()
    return f"-- host µs per call, {tokens} tokens, {transport}, EP{dist.get_world_size()}\n" + "\n".join(out)


def _empty_graph(device: torch.device):
    """The replay of a graph holding one tiny kernel: the floor of a graph replay's host cost."""
    t = torch.zeros(1, device=device)
    graph, _ = capture_graph(lambda: t.add_(1), warmup=1)
    return graph.replay


REGIMES = ("lined up", "lined up, host busy 2 ms first", "back to back")


def regimes_rank(device: torch.device, tokens: int, transport: str, iters: int, fixed_rows: bool = False) -> str:
    """Host µs inside each of the four dispatcher calls of an eager forward, in three regimes: ranks
    lined up (synchronize + barrier) before each forward, as the benchmarks time phases; the same
    with the host kept busy for 2 ms before the forward (a host that idled in the line-up may run the
    next calls slower: power state, cold caches); and forwards issued back to back, as a model issues
    them (a synchronize every 8 forwards, untimed, keeps the launch queue from filling). Medians."""
    import statistics

    layer, x = _probe_layer(device, tokens, transport, fixed_rows)
    lines = []
    with torch.inference_mode():
        for _ in range(10):
            layer(x)
        for regime in REGIMES:
            spans: dict[str, list[float]] = {k: [] for k in DISPATCHER_CALLS}
            torch.cuda.synchronize()
            dist.barrier()
            for it in range(iters):
                if regime != "back to back":
                    torch.cuda.synchronize()
                    dist.barrier()
                elif it % 8 == 0:
                    torch.cuda.synchronize()
                if regime == "lined up, host busy 2 ms first":
                    until = time.perf_counter() + 2e-3
                    while time.perf_counter() < until:
                        pass
                for key, us in dispatcher_call_host_us(layer, x).items():
                    spans[key].append(us)
            torch.cuda.synchronize()
            lines.append(f"{regime:32s} " + "  ".join(f"{k} {statistics.median(v):6.1f}" for k, v in spans.items()))
    path = f"{transport}{_FIXED[fixed_rows]}, EP{dist.get_world_size()}"
    head = f"-- host µs per call (median of {iters}), {tokens} tokens, {path}"
    return head + "\n" + "\n".join(lines)


def breakdown_rank(device: torch.device, tokens: int, transport: str, iters: int, fixed_rows: bool = False) -> str:
    """Mean host µs per call of each step inside the four dispatcher calls (``host_breakdown``'s
    wrappers, inclusive of what each calls), ranks lined up before every forward: where a phase's
    host time goes, without a profiler's overhead."""
    from moe_sbo.dispatch import ll_addresses, ll_graphs, low_latency
    from moe_sbo.dispatch.base import Dispatcher
    from moe_sbo.dispatch.low_latency import LowLatencyDispatcher
    from moe_sbo.hooks import HookRegistry

    layer, x = _probe_layer(device, tokens, transport, fixed_rows)
    targets = [
        (Dispatcher, "dispatch_launch"),
        (HookRegistry, "run"),
        (Dispatcher, "_validate_dispatch_input"),
        (LowLatencyDispatcher, "_launch_dispatch"),
        (LowLatencyDispatcher, "buffers"),
        (LowLatencyDispatcher, "_pack_staged"),
        (ll_graphs.Staging, "pack_values"),
        (ll_addresses.CallerAddresses, "write"),
        (ll_graphs.PieceGraph, "__call__"),
        (torch.cuda.CUDAGraph, "replay"),
        (low_latency, "start_exchange"),
        (Dispatcher, "dispatch_wait"),
        (LowLatencyDispatcher, "_wait_dispatch"),
        (LowLatencyDispatcher, "_layout_staged"),
        (low_latency.ll_kernels, "expert_rows"),
        (low_latency.ll_kernels, "gather_rows"),
        (Dispatcher, "combine_launch"),
        (LowLatencyDispatcher, "_combine_staged"),
        (low_latency.ll_kernels, "reduce_pairs"),
        (Dispatcher, "combine_wait"),
        (LowLatencyDispatcher, "_sum_staged"),
        (low_latency, "gather_sum"),
    ]
    with torch.inference_mode():
        for _ in range(10):
            layer(x)
        with host_breakdown(targets) as spans:
            for _ in range(iters):
                torch.cuda.synchronize()
                dist.barrier()
                dispatcher_call_host_us(layer, x)
        torch.cuda.synchronize()
    path = f"{transport}{_FIXED[fixed_rows]}, EP{dist.get_world_size()}"
    head = f"-- host µs per call (mean of {iters} forwards, inclusive), {tokens} tokens, {path}"
    lines = [f"{label:45s} {len(v) / iters:5.1f} calls {sum(v) / max(len(v), 1):8.1f} µs" for label, v in spans.items()]
    return head + "\n" + "\n".join(lines)


def lines_rank(device: torch.device, tokens: int, transport: str, iters: int, fixed_rows: bool = False) -> str:
    """Host µs of every line of the dispatcher's hot functions (``line_profiler``, which must import;
    its per-line overhead inflates the totals, so compare lines within one listing), over ``iters``
    forwards with the ranks lined up before each."""
    from line_profiler import LineProfiler  # a developer's tool, not a dependency of the project

    from moe_sbo.dispatch import ll_addresses, ll_graphs
    from moe_sbo.dispatch.base import Dispatcher
    from moe_sbo.dispatch.low_latency import LowLatencyDispatcher

    layer, x = _probe_layer(device, tokens, transport, fixed_rows)
    functions = [
        *(getattr(Dispatcher, name) for name in (*DISPATCHER_CALLS, "_validate_dispatch_input")),
        *(
            getattr(LowLatencyDispatcher, name)
            for name in ("_launch_dispatch", "_pack_staged", "_wait_dispatch", "_layout_staged", "_launch_combine")
        ),
        *(getattr(LowLatencyDispatcher, name) for name in ("_combine_staged", "_wait_combine", "_sum_staged")),
        ll_graphs.PieceGraph.__call__,
        ll_graphs.Staging.pack_values,
        ll_addresses.CallerAddresses.offset_in_place,
        ll_addresses.CallerAddresses.write,
        ll_addresses.CallerAddresses.offset_of,
    ]
    profiler = LineProfiler(*functions)
    with torch.inference_mode():
        for _ in range(10):
            layer(x)
        for _ in range(iters):
            torch.cuda.synchronize()
            dist.barrier()
            with profiler:
                dispatcher_call_host_us(layer, x)
        torch.cuda.synchronize()
    text = io.StringIO()
    text.write(f"-- line µs over {iters} forwards, {tokens} tokens, {transport}{_FIXED[fixed_rows]}\n")
    profiler.print_stats(stream=text, output_unit=1e-6, stripzeros=True)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--transport", default="symm_mem")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--pieces", action="store_true", help="time each building block alone instead of profiling")
    p.add_argument(
        "--regimes", action="store_true", help="the four calls' host time lined up, after a busy host, back to back"
    )
    p.add_argument("--breakdown", action="store_true", help="host µs of each step inside the four calls")
    p.add_argument("--fixed-expert-rows", action="store_true", help="low_latency with fixed_expert_rows")
    p.add_argument("--lines", action="store_true", help="host µs of every line of the hot calls (line_profiler)")
    args = p.parse_args()
    texts = []
    with LocalRanks(torch.cuda.device_count(), device="cuda") as ranks:
        for tokens in args.tokens:
            if args.breakdown:
                texts.append(ranks.run(breakdown_rank, tokens, args.transport, args.iters, args.fixed_expert_rows)[0])
            elif args.lines:
                texts.append(ranks.run(lines_rank, tokens, args.transport, args.iters, args.fixed_expert_rows)[0])
            elif args.regimes:
                texts.append(ranks.run(regimes_rank, tokens, args.transport, args.iters, args.fixed_expert_rows)[0])
            elif args.pieces:
                texts.append(ranks.run(pieces_rank, tokens, args.transport, args.iters)[0])
            else:
                texts.append(
                    ranks.run(profile_rank, tokens, args.transport, args.iters, args.top, args.fixed_expert_rows)[0]
                )
    print("\n".join(texts))
    if args.out:
        Path(args.out).write_text("\n".join(texts))


if __name__ == "__main__":
    main()

"""Timing without perturbing what is timed: per-iteration stamps (CUDA events or the host clock),
lining ranks up between iterations, and a median-of-many timer for single kernels.

The hard part is where synchronisation goes. Nothing here synchronises inside a timed region:
``Stamps`` records events on the current stream and reads them once at the end, and ``line_up``
(synchronize + barrier) runs only between iterations, so one rank's late start is not billed to
another rank's communication.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..streams import capture_graph

if TYPE_CHECKING:
    from ..layer import MoELayer

# Hook events stamped inside one forward, plus "start"/"end" around it.
HOOK_STAMPS = (
    "pre_dispatch",
    "dispatch_in_flight",
    "post_dispatch",
    "pre_combine",
    "combine_in_flight",
    "post_combine",
)
STAMPS = ("start", *HOOK_STAMPS, "end")
# (name, from stamp, to stamp) of every reported span.
SPANS = (
    ("t_route_us", "start", "pre_dispatch"),
    ("t_dispatch_us", "pre_dispatch", "post_dispatch"),
    ("t_dispatch_launch_us", "pre_dispatch", "dispatch_in_flight"),
    ("t_routed_us", "post_dispatch", "pre_combine"),
    ("t_combine_us", "pre_combine", "post_combine"),
    ("t_combine_launch_us", "pre_combine", "combine_in_flight"),
    ("t_shared_us", "post_combine", "end"),
    ("t_layer_us", "start", "end"),
)


class Stamps:
    """Per-iteration timestamps: CUDA events on the current stream, or host clock reads on CPU.

    ``iteration`` < 0 means warm-up: ``record`` does nothing. Read results only after ``spans_us``,
    which synchronises once at the end.
    """

    def __init__(self, device: torch.device, iters: int, names: tuple[str, ...]):
        self.cuda = device.type == "cuda"
        self.iteration = -1
        if self.cuda:
            self.events = {n: [torch.cuda.Event(enable_timing=True) for _ in range(iters)] for n in names}
        else:
            self.times = {n: [0.0] * iters for n in names}

    def record(self, name: str) -> None:
        if self.iteration < 0:
            return
        if self.cuda:
            self.events[name][self.iteration].record()
        else:
            self.times[name][self.iteration] = time.perf_counter()

    def span_us(self, start: str, end: str) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) * 1e3 for a, b in zip(self.events[start], self.events[end])]
        return [(b - a) * 1e6 for a, b in zip(self.times[start], self.times[end])]


def line_up(device: torch.device) -> None:
    """Finish all queued work and align the ranks (called between timed iterations, never inside)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()


class KernelTimer:
    """Median µs of a callable: ``triton.testing.do_bench`` when it imports (CUDA; L2 cleared before
    each call, the calls launched from the host), else CUDA events or the host clock. ``quick``
    shortens every measurement (CPU smoke runs).

    ``graph`` (CUDA): ``triton.testing.do_bench_cudagraph`` instead, the calls replayed from one CUDA
    graph: the GPU's time alone, as a layer replayed from a graph runs them. Launched from the host,
    a call of a few Triton kernels can take longer than its kernels do (each launch costs an H200
    host 15-50 µs); for the routed MLP the two agreed within 8 % (``bench dense-experts --graph``). L2 is
    not cleared, which changes nothing for weights larger than it (the routed experts' here)."""

    def __init__(self, device: torch.device, quick: bool, graph: bool = False):
        self.device = device
        self.quick = quick
        self.graph = graph and device.type == "cuda"
        self.do_bench = None
        if device.type == "cuda":
            try:
                from triton.testing import do_bench, do_bench_cudagraph

                self.do_bench = do_bench_cudagraph if self.graph else do_bench
            except Exception:  # noqa: BLE001 - any import failure means: use events
                self.do_bench = None
        if self.do_bench is not None:
            self.name = f"triton.testing.{self.do_bench.__name__}(median)"
        else:
            self.name = "cuda events (median)" if device.type == "cuda" else "host clock (median)"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.do_bench is not None:
            warmup_ms, rep_ms = (5, 20) if self.quick else (25, 200)
            if self.graph:
                return self.do_bench(fn, rep=rep_ms, return_mode="median") * 1e3
            return self.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3
        warmup, iters = (1, 3) if self.quick else (5, 30)
        stamps = Stamps(self.device, iters, ("start", "end"))
        for it in range(warmup + iters):
            stamps.iteration = it - warmup
            stamps.record("start")
            fn()
            stamps.record("end")
        return statistics.median(stamps.span_us("start", "end"))


def memory_read_us(nbytes: int, device: torch.device) -> float:
    """Median µs to read ``nbytes`` of device memory once: a float32-accumulating sum over a bf16
    buffer of that size (``KernelTimer``). The floor of anything that streams that many bytes, e.g.
    a decode step reading its weights."""
    buffer = torch.empty(max(1, nbytes // 2), dtype=torch.bfloat16, device=device).normal_()
    return KernelTimer(device, quick=device.type != "cuda")(lambda: buffer.sum(dtype=torch.float32))


def time_layer(layer: MoELayer, x_TH: torch.Tensor, warmup: int, iters: int) -> dict[str, float]:
    """Median µs of every span in ``SPANS`` over ``iters`` forwards, stamped from dispatcher hooks."""
    stamps = Stamps(x_TH.device, iters, STAMPS)
    with layer.dispatcher.hooks.scope() as scope:

        def stamp(event: str) -> Callable[[object, object], None]:
            """A hook that stamps ``event`` (its own, not the loop's last)."""
            return lambda dispatcher, payload: stamps.record(event)

        for event in HOOK_STAMPS:
            scope.register(event, stamp(event))
        for it in range(warmup + iters):
            stamps.iteration = it - warmup
            line_up(x_TH.device)
            stamps.record("start")
            layer(x_TH)
            stamps.record("end")
    return {name: statistics.median(stamps.span_us(a, b)) for name, a, b in SPANS}


DISPATCHER_CALLS = ("dispatch_launch", "dispatch_wait", "combine_launch", "combine_wait")


def dispatcher_call_host_us(layer: MoELayer, x_TH: torch.Tensor) -> dict[str, float]:
    """One forward of ``layer`` through its dispatcher's four calls (router first, routed experts
    between the phases, no shared experts) -> the host µs spent inside each call, by name. Nothing
    waits for the GPU: this is what the host adds per phase, the part no overlap can hide."""
    d = layer.dispatcher
    topk = layer.router(x_TH)
    t0 = time.perf_counter()
    pending = d.dispatch_launch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
    t1 = time.perf_counter()
    recv = d.dispatch_wait(pending)
    t2 = time.perf_counter()
    y_RH = layer.experts.forward_dispatched(recv)
    t3 = time.perf_counter()
    pending = d.combine_launch(y_RH, recv.handle)
    t4 = time.perf_counter()
    d.combine_wait(pending)
    t5 = time.perf_counter()
    return {k: (b - a) * 1e6 for k, a, b in zip(DISPATCHER_CALLS, (t0, t1, t3, t4), (t1, t2, t4, t5), strict=True)}


@contextlib.contextmanager
def host_breakdown(targets: Sequence[tuple[Any, str]]) -> Iterator[dict[str, list[float]]]:
    """Inside the block every call of each ``getattr(owner, name)`` (a class's method or a module's
    function) is timed on the host clock, inclusive of what it calls; yields ``{"Owner.name": [µs
    of each call]}``, filled as the block runs. The originals are back on exit. A wrapper costs the
    host about a microsecond a call, far less than a profiler, so nested timings add up."""
    spans: dict[str, list[float]] = {}
    originals = []
    for owner, name in targets:
        static = inspect.getattr_static(owner, name)
        descriptor = type(static) if isinstance(static, staticmethod | classmethod) else None
        fn = static.__func__ if descriptor else getattr(owner, name)
        label = f"{getattr(owner, '__name__', type(owner).__name__).rsplit('.', 1)[-1]}.{name}"
        times = spans.setdefault(label, [])

        def timed(*args, _fn=fn, _times=times, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _times.append((time.perf_counter() - start) * 1e6)

        wrapper = functools.wraps(fn)(timed)
        originals.append((owner, name, static, name in vars(owner)))
        setattr(owner, name, descriptor(wrapper) if descriptor else wrapper)
    try:
        yield spans
    finally:
        for owner, name, static, own in reversed(originals):
            if own:
                setattr(owner, name, static)
            else:  # inherited: drop the wrapper, the base class's attribute shows through again
                delattr(owner, name)


def time_all_to_all(
    chunk_elems: int, dtype: torch.dtype, device: torch.device, warmup: int, iters: int, seed: int
) -> float:
    """Median µs of one raw ``all_to_all_single`` sending ``chunk_elems`` elements to every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator(device=device).manual_seed(seed * 104_729 + rank)
    send = torch.randn(world * chunk_elems, generator=generator, device=device).to(dtype)
    recv = torch.empty_like(send)
    return time_fn(lambda: dist.all_to_all_single(recv, send), device, warmup, iters, graph=False)


def time_raw_all_to_all(
    bytes_sent: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    iters: int,
    seed: int,
    *,
    rule: str,
) -> tuple[list[float], list[int]]:
    """Raw ``all_to_all_single`` on the bytes of each phase -> (median µs per phase, elements each
    rank sent to each peer). A collective: call it on every rank, with this rank's ``bytes_sent``
    per phase (e.g. dispatch and combine).

    ``all_to_all_single`` needs one size on every rank, so the ranks first agree on one per phase:
    ``rule="mean"``, the mean over ranks (a dispatcher's bandwidth beside NCCL's on the same bytes),
    or ``"max"``, the largest rank's (the transfer a layer waits for: its physical floor). Each rank
    sends it in equal chunks to the P - 1 others; the chunk to itself is a local copy, excluded from
    the bytes as the dispatchers exclude it.
    """
    if rule not in ("mean", "max"):
        raise ValueError(f"rule must be 'mean' or 'max', got {rule!r}")
    world = dist.get_world_size()
    sizes = torch.tensor(list(bytes_sent), dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX if rule == "max" else dist.ReduceOp.SUM)
    per_rank = [b if rule == "max" else b / world for b in sizes.tolist()]
    chunks = [max(1, math.ceil(b / ((world - 1) * dtype.itemsize))) for b in per_rank]
    times = [time_all_to_all(c, dtype, device, warmup, iters, seed + i) for i, c in enumerate(chunks)]
    return times, chunks


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, graph: bool) -> float:
    """Median µs of ``fn()`` (eager), or of replays of a CUDA graph that captured one ``fn()``."""
    run: Callable[[], object]
    if graph:
        line_up(device)  # every rank captures its collectives at the same point
        cuda_graph, _ = capture_graph(fn)
        run = cuda_graph.replay
    else:
        run = fn
    stamps = Stamps(device, iters, ("start", "end"))
    for it in range(warmup + iters):
        stamps.iteration = it - warmup
        line_up(device)
        stamps.record("start")
        run()
        stamps.record("end")
    median = statistics.median(stamps.span_us("start", "end"))
    if graph:
        del cuda_graph
    return median

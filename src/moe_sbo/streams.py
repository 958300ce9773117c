"""Streams, events and SM budgets, so overlap code never branches on CPU vs CUDA.

On CUDA a ``SideStream`` is a second stream that forks from and joins the current one through
events (capturable in a CUDA graph). On CPU there are no streams: work "on the side stream" runs
inline on the host, in program order, which is the sequential equivalent.

The hard part is the SM budget. Kernels launched while another stream's kernels run share the SMs:
a GEMM grid that fills every SM leaves a communication kernel launched after it waiting for SMs, and
the transfer is serialised behind the GEMM. ``sm_budget`` caps the SMs that cuBLAS(Lt) plans for
with PyTorch's carve-out (``torch._C._set_sm_carveout_experimental``, applied by the cuBLASLt path,
which is why the context also prefers cuBLASLt); it is a planning hint to cuBLAS, not a hard fence.
PyTorch calls both settings experimental in a notice it prints once per process; the first budget
spends those notices quietly (``spend_experimental_notices``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA ``device`` (asked on hot paths: the device query once per device)."""
    return torch.cuda.get_device_capability(device)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (0 on CPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


class SideStream:
    """A second stream on ``device`` (CUDA), or the host's program order (CPU).

    Use ``fork()`` before launching side work (the side waits for what the current stream queued),
    ``with side.active():`` around the side work, and ``join()`` where the current stream needs its
    results. Tensors made on the side are recorded on the current stream at ``join`` time by the
    caller (``record_on_current``), so the caching allocator does not hand their memory out early.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fork(self, after: torch.cuda.Event | None = None) -> None:
        """The side stream waits for ``after`` (default: everything queued on the current stream)."""
        if self.stream is None:
            return
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(after)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make the side stream current for the block (CPU: nothing changes)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """The current stream waits for everything queued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def record_on_current(self, tensor: torch.Tensor | None) -> None:
        """Tell the allocator ``tensor`` (made on the side) is used by the current stream."""
        if self.stream is not None and tensor is not None:
            tensor.record_stream(torch.cuda.current_stream(self.device))


@functools.cache
def side_stream(device: torch.device) -> SideStream:
    """One side stream per device, reused by every layer (streams are costly to create)."""
    return SideStream(device)


def record_event(device: torch.device, timing: bool = False) -> torch.cuda.Event | None:
    """An event recorded now on the current stream (CUDA; ``timing`` for ``elapsed_time``), or ``None`` on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=timing)
    event.record(torch.cuda.current_stream(device))
    return event


def clock(device: torch.device) -> torch.cuda.Event | float:
    """Now, for ``elapsed_us``: a timing event on the current stream (CUDA), else
    ``time.perf_counter()`` seconds."""
    if device.type == "cuda":
        return cast(torch.cuda.Event, record_event(device, timing=True))
    return time.perf_counter()


def elapsed_us(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    """µs between two ``clock`` readings; on CUDA it waits for ``end`` (a host sync)."""
    if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    if isinstance(start, float) and isinstance(end, float):
        return (end - start) * 1e6
    raise TypeError(
        f"a timed span must run between two CUDA events or two perf_counter floats, got "
        f"{type(start).__name__} and {type(end).__name__}"
    )


def check_sm_budget(device: torch.device, sm_budget: int | None) -> None:
    """Raise if ``sm_budget`` is not a number of SMs this GPU has (CPU: any budget is ignored)."""
    if sm_budget is None or device.type != "cuda":
        return
    total = sm_count(device)
    if not 0 < sm_budget <= total:
        raise ValueError(
            f"sm_budget must be in [1, {total}] (the SMs of {torch.cuda.get_device_name(device)}), got "
            f"{sm_budget}; leave SMs for communication, e.g. sm_budget={max(1, total - 24)}"
        )


@functools.cache
def spend_experimental_notices() -> None:
    """PyTorch prints a notice, once per process, the first time a BLAS library is preferred and the
    first time the SM carve-out is set, calling both experimental (``sm_budget`` uses both on purpose).
    They are C++ warnings written straight to the standard error, which Python's warning filters do
    not reach, so every rank printed them before any output. Here both are set once and restored, with
    file descriptor 2 pointed at ``os.devnull`` for those two calls: the notices are spent, and later
    settings print nothing. What else wrote to descriptor 2 in that instant is lost; errors still
    raise. docs/OVERLAP.md says why."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        library = torch.backends.cuda.preferred_blas_library()
        carveout = torch._C._get_sm_carveout_experimental()
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            torch._C._set_sm_carveout_experimental(0)
        finally:
            torch._C._set_sm_carveout_experimental(carveout)
            torch.backends.cuda.preferred_blas_library(library)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def sm_budget(device: torch.device, sms: int | None) -> Iterator[None]:
    """GEMMs launched in the block plan for at most ``sms`` SMs (CUDA; CPU and ``None``: no effect)."""
    if sms is None or device.type != "cuda":
        yield
        return
    check_sm_budget(device, sms)
    spend_experimental_notices()
    previous_carveout = torch._C._get_sm_carveout_experimental()
    previous_library = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sm_count(device) - sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous_carveout)
        torch.backends.cuda.preferred_blas_library(previous_library)


def capturing(device: torch.device) -> bool:
    """Whether the caller is capturing a CUDA graph on ``device``'s current stream (then nothing may
    synchronise, and work that would replay its own graphs runs its kernels instead)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` captured in a CUDA graph -> (graph, the static output of the captured call).

    ``fn`` first runs ``warmup`` times on a side stream, as capture requires (lazy allocations and
    cuBLAS workspaces happen outside the graph). Replaying the graph reruns ``fn``'s kernels on the
    same buffers: write new inputs into the tensors ``fn`` reads, then ``graph.replay()``. The graph
    keeps ``fn`` (and so every tensor its closure holds) alive: were they freed, their memory would
    be reused while replays still write into it (an illegal access once the allocator releases it).

    No garbage collection runs while capturing: a collected tensor's free (a symmetric-memory unmap
    above all) is not permitted on a capturing thread and aborts the process. The capture is
    ``thread_local``: NCCL's watchdog thread keeps querying its events meanwhile.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    cast(Any, graph).captured_fn = fn  # our own attribute on torch's CUDAGraph: it keeps fn alive
    return graph, out

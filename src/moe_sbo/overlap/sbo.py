"""Single-batch overlap (SBO): where the shared experts run relative to the dispatch/combine transfers.

A strategy only registers hooks on the layer's dispatcher, inside the forward's ``HookScope``; the
layer and the dispatchers never learn which one runs. ``attach`` returns a ``SharedOutput``: the
shared experts' ``[T, H]`` output, computed wherever the hooks put it, read by the layer at the end.

=============  ==============================================================================  =========
mode           where the shared experts run                                                    on CPU
=============  ==============================================================================  =========
``none``       after the combine, on the current stream (the reference order)                  same
``dispatch``   inside ``dispatch_in_flight``: while the dispatch transfer is on the wire       overlaps
``combine``    on a side stream from ``pre_combine``, joined at ``post_combine`` (seed type 1)  sequential
``combine_sm`` on a side stream from ``combine_in_flight``, after the event the routed          overlaps
               down-projection recorded, with cuBLAS planning for ``sm_budget`` SMs (type 3)
``split``      first projection in ``dispatch_in_flight``, down projection in                  overlaps
               ``combine_in_flight`` (as Megatron splits it)
``auto``       one of the above per token count, chosen from timings it measures itself
=============  ==============================================================================  =========

Why the launch points differ: on CUDA our collectives run on the communicator's stream, which waits
for the current stream at launch. Work queued on the current stream in an ``*_in_flight`` hook
therefore runs beside the transfer. Work launched *before* the transfer (``combine`` at
``pre_combine``) grabs the SMs first and the communication kernel waits for free SMs, which is what
``combine_sm``'s launch after the transfer and SM budget are for. On CPU, gloo moves data on its own
threads, so the in-flight modes overlap there too; ``combine`` has no side stream on CPU and runs
in program order (it says so once).

The outputs are the same in every mode: the same kernels compute the same tensors, only where they
are queued changes (bitwise on CPU; on GPU too unless the SM budget makes cuBLAS pick another
kernel, hence the bf16 tolerance the tests state).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import FIXED_MODES, OVERLAP_MODES
from ..dispatch import EPGroup
from ..experts.shared import SharedExperts
from ..hooks import HookScope
from ..streams import (
    SideStream,
    capture_graph,
    capturing,
    check_sm_budget,
    clock,
    elapsed_us,
    record_event,
    side_stream,
    sm_count,
)
from ..streams import sm_budget as sm_budget_ctx
from .auto import BucketTrials, bucket_of, slowest_rank

log = logging.getLogger("moe_sbo.overlap")

# NCCL on NVLink Hopper runs up to 32 channels, one CTA (one SM) each; leave those to communication.
DEFAULT_COMM_SMS = 32
# Modes whose CPU version gives up the overlap (no side stream on CPU).
# The line it logs fits 100 columns.
_SEQUENTIAL_ON_CPU = {"combine": "no side stream, so the shared experts run at pre_combine, in program order"}
_said: set[str] = set()


def _say_once(message: str) -> None:
    """Log ``message`` the first time only, and on one rank only (every rank builds the same layers)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if message not in _said:
        _said.add(message)
        log.warning(message)


@dataclass
class SharedOutput:
    """The shared experts' ``[T, H]`` output for one forward (``None`` when the model has none).

    ``launched_at`` names the hook event that launched them (``"after_combine"`` for ``none``).
    ``result()`` raises if the strategy's hooks never ran: a strategy bug must not pass silently.
    """

    value_TH: torch.Tensor | None = None
    launched_at: str | None = None
    deferred: Callable[[], torch.Tensor] | None = None
    on_result: Callable[[], None] | None = None

    def set(self, value_TH: torch.Tensor, event: str) -> None:
        self.value_TH, self.launched_at = value_TH, event

    def result(self) -> torch.Tensor | None:
        if self.deferred is not None:
            self.set(self.deferred(), "after_combine")
            self.deferred = None
        if self.launched_at is None:
            raise RuntimeError("the overlap strategy's hooks never ran the shared experts in this forward")
        if self.on_result is not None:
            self.on_result()
        return self.value_TH


@dataclass(frozen=True)
class OverlapContext:
    """What the strategies need besides the hooks: the device, its side stream, the SM budget."""

    device: torch.device
    side: SideStream
    sm_budget: int | None


# ---- the fixed modes: functions that register hooks ---------------------------------------------

AttachFn = Callable[[HookScope, SharedExperts, torch.Tensor, OverlapContext], SharedOutput]


def attach_none(hooks: HookScope, shared: SharedExperts, x_TH: torch.Tensor, ctx: OverlapContext) -> SharedOutput:
    return SharedOutput(deferred=lambda: shared(x_TH))


def attach_dispatch(hooks: HookScope, shared: SharedExperts, x_TH: torch.Tensor, ctx: OverlapContext) -> SharedOutput:
    out = SharedOutput()
    hooks.register("dispatch_in_flight", lambda d, pending: out.set(shared(x_TH), "dispatch_in_flight"), once=True)
    return out


def attach_combine(hooks: HookScope, shared: SharedExperts, x_TH: torch.Tensor, ctx: OverlapContext) -> SharedOutput:
    out = SharedOutput()

    def start(dispatcher, combine_input):
        ctx.side.fork()  # after the routed experts queued on the current stream
        with ctx.side.active():
            out.set(shared(x_TH), "pre_combine")

    hooks.register("pre_combine", start, once=True)
    _join_side_at_post_combine(hooks, out, ctx)
    return out


def _join_side_at_post_combine(hooks: HookScope, out: SharedOutput, ctx: OverlapContext) -> None:
    """The current stream waits for the side stream's shared experts once the combine is done."""

    def join(dispatcher, y_TH):
        ctx.side.join()
        ctx.side.record_on_current(out.value_TH)

    hooks.register("post_combine", join, once=True)


def attach_combine_sm(hooks: HookScope, shared: SharedExperts, x_TH: torch.Tensor, ctx: OverlapContext) -> SharedOutput:
    out = SharedOutput()
    routed_done: list = []

    def mark_routed_done(dispatcher, combine_input):
        # The routed down-projection is the last thing queued on the current stream: the combine's
        # collective waits on it at launch, and the shared experts start after it too.
        routed_done.append(record_event(ctx.device))

    def start(dispatcher, pending):
        ctx.side.fork(after=routed_done[0])
        with ctx.side.active(), sm_budget_ctx(ctx.device, ctx.sm_budget):
            out.set(shared(x_TH), "combine_in_flight")

    hooks.register("pre_combine", mark_routed_done, once=True)
    hooks.register("combine_in_flight", start, once=True)
    _join_side_at_post_combine(hooks, out, ctx)
    return out


def attach_split(hooks: HookScope, shared: SharedExperts, x_TH: torch.Tensor, ctx: OverlapContext) -> SharedOutput:
    out = SharedOutput()
    hidden: list[torch.Tensor] = []
    hooks.register("dispatch_in_flight", lambda d, p: hidden.append(shared.up_and_activate(x_TH)), once=True)
    hooks.register("combine_in_flight", lambda d, p: out.set(shared.down(hidden.pop()), "combine_in_flight"), once=True)
    return out


ATTACH: dict[str, AttachFn] = {
    "none": attach_none,
    "dispatch": attach_dispatch,
    "combine": attach_combine,
    "combine_sm": attach_combine_sm,
    "split": attach_split,
}


# ---- strategies the layer holds ----------------------------------------------------------------


@dataclass
class FixedOverlap:
    """One mode for every forward."""

    mode: str
    ctx: OverlapContext

    @property
    def name(self) -> str:
        return self.mode

    def attach(self, hooks: HookScope, shared: SharedExperts | None, x_TH: torch.Tensor) -> SharedOutput:
        """Register this forward's hooks in ``hooks``; the returned output is ready after the combine."""
        if shared is None:
            return SharedOutput(launched_at="no_shared_experts")
        return ATTACH[self.mode](hooks, shared, x_TH, self.ctx)


@dataclass
class AutoOverlap:
    """Per token-count bucket, time every candidate mode on real forwards, then keep the fastest.

    Exploration: forwards in a bucket cycle through ``candidates`` (``none`` always among them) for
    ``warmup + trials`` rounds, each timed from ``attach`` to the shared output's ``result()``
    (CUDA events, read with a sync at the next forward of the bucket; only while exploring). Then the
    bucket keeps the mode with the lowest median, so it is never slower than ``none`` as measured.
    ``choices`` (bucket -> mode) can also be given up front, e.g. from a benchmark's JSON rows with
    ``choices_from_rows``.

    Inside CUDA-graph capture nothing is timed: the bucket's ``graph_choices`` entry runs, else its
    eager choice (or ``none``). Eager timings do not carry over to replays (an eager forward waits
    for its host; a replay does not), so a caller that serves from graphs first calls
    ``choose_for_graphs``, which times each candidate's replays and agrees over the EP group.
    """

    ctx: OverlapContext
    candidates: tuple[str, ...] = FIXED_MODES
    trials: int = 3
    warmup: int = 1
    choices: dict[int, str] = field(default_factory=dict)
    graph_choices: dict[int, str] = field(default_factory=dict)
    _open: dict[int, tuple[str, torch.cuda.Event | float, torch.cuda.Event | float]] = field(default_factory=dict)
    _forced: str | None = None  # the candidate ``choose_for_graphs`` is timing

    name = "auto"

    def __post_init__(self) -> None:
        if "none" not in self.candidates:
            self.candidates = ("none", *self.candidates)
        unknown = set(self.candidates) - set(FIXED_MODES)
        if unknown:
            raise ValueError(f"auto candidates must be among {FIXED_MODES}, got {sorted(unknown)}")
        self.exploration = BucketTrials(self.candidates, self.trials, self.warmup)

    @property
    def timings_us(self) -> dict[int, dict[str, list[float]]]:
        """Bucket -> mode -> the µs of its timed forwards."""
        return self.exploration.timings_us

    def attach(self, hooks: HookScope, shared: SharedExperts | None, x_TH: torch.Tensor) -> SharedOutput:
        if shared is None:
            return SharedOutput(launched_at="no_shared_experts")
        bucket = bucket_of(x_TH.shape[0])
        if self._forced is not None:
            return ATTACH[self._forced](hooks, shared, x_TH, self.ctx)
        if capturing(self.ctx.device):  # (reading timings would sync: never inside a capture)
            mode = self.graph_choices.get(bucket, self.choices.get(bucket, "none"))
            return ATTACH[mode](hooks, shared, x_TH, self.ctx)
        if bucket in self.choices:
            return ATTACH[self.choices[bucket]](hooks, shared, x_TH, self.ctx)
        self._close(bucket)
        if bucket in self.choices:  # that forward's timing completed the exploration
            return ATTACH[self.choices[bucket]](hooks, shared, x_TH, self.ctx)
        mode, timed = self.exploration.next(bucket)
        start = clock(self.ctx.device)
        out = ATTACH[mode](hooks, shared, x_TH, self.ctx)

        def stop() -> None:
            if timed:
                self._open[bucket] = (mode, start, clock(self.ctx.device))

        out.on_result = stop
        return out

    def _close(self, bucket: int) -> None:
        """Book the last timed forward of ``bucket``; decide once every candidate has its trials."""
        if bucket not in self._open:
            return
        mode, start, end = self._open.pop(bucket)
        samples = self.exploration.book(bucket, mode, elapsed_us(start, end))
        if samples is not None:
            medians = {m: statistics.median(samples[m]) for m in self.candidates}
            # ties go to the earlier candidate, and "none" comes first
            self.choices[bucket] = min(self.candidates, key=lambda m: medians[m])

    def choose_for_graphs(
        self, forward: Callable[[], object], num_tokens: int, group: EPGroup, *, replays: int = 20
    ) -> str:
        """The mode that CUDA-graph replays of ``forward`` run fastest with, kept in ``graph_choices``
        for the bucket of ``num_tokens`` -> that mode.

        ``forward``: one whole forward through this strategy at ``num_tokens`` tokens, e.g.
        ``lambda: layer(x_TH)``. Each candidate is captured in its own graph (``capture_graph``, whose
        warm-up runs also use that candidate) and replayed ``replays`` times; the choice is the
        lowest median on the slowest rank of ``group`` (ties: the earlier candidate, ``none`` first),
        the same on every rank. Every rank of ``group`` calls this together, as capturing a
        collective dispatcher's forward requires anyway. CUDA only (there are no graphs on CPU)."""
        device = self.ctx.device
        if device.type != "cuda":
            raise ValueError(f"choose_for_graphs times CUDA-graph replays and needs a CUDA device, got {device}")
        if replays < 1:
            raise ValueError(f"replays must be >= 1, got {replays}")
        medians = []
        for mode in self.candidates:
            self._forced = mode
            try:
                graph, _ = capture_graph(forward)
            finally:
                self._forced = None
            spans = []
            for _ in range(replays):
                start = clock(device)
                graph.replay()
                spans.append((start, clock(device)))
            medians.append(statistics.median(elapsed_us(a, b) for a, b in spans))
            del graph
        slowest = slowest_rank(medians, group, device)
        choice = self.candidates[min(range(len(self.candidates)), key=lambda i: (slowest[i], i))]
        self.graph_choices[bucket_of(num_tokens)] = choice
        return choice


def choices_from_rows(rows: list[dict], **match) -> dict[int, str]:
    """Bucket -> fastest mode, from benchmark rows with ``tokens_per_rank``, ``overlap``, ``t_layer_us``.

    ``match`` keeps only the rows whose fields equal it (e.g. ``dispatcher="low_latency",
    experts_per_gpu=8, graph=True``): a file holds several setups, and only one is yours.
    """
    best: dict[int, tuple[float, str]] = {}
    for row in rows:
        if row.get("overlap") not in FIXED_MODES or row.get("t_layer_us") is None:
            continue
        if any(row.get(key) != value for key, value in match.items()):
            continue
        bucket = bucket_of(int(row["tokens_per_rank"]))
        candidate = (float(row["t_layer_us"]), row["overlap"])
        if bucket not in best or candidate < best[bucket]:
            best[bucket] = candidate
    return {bucket: mode for bucket, (_, mode) in best.items()}


Overlap = FixedOverlap | AutoOverlap


def make_overlap(mode: str, device: torch.device | str, *, sm_budget: int | None = None) -> Overlap:
    """The strategy called ``mode`` for layers on ``device``.

    ``sm_budget``: SMs the shared experts' GEMMs may plan for in ``combine_sm`` (default: all but
    ``DEFAULT_COMM_SMS``); must not exceed the GPU's SM count. Ignored on CPU.
    """
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {mode!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # one side stream per physical GPU
    if device.type == "cuda":
        check_sm_budget(device, sm_budget)
        if sm_budget is None:
            sm_budget = max(1, sm_count(device) - DEFAULT_COMM_SMS)
    elif sm_budget is not None and mode in ("combine_sm", "auto"):
        _say_once("overlap combine_sm: the SM budget is ignored on CPU (no SMs to share)")
    if device.type != "cuda" and mode in _SEQUENTIAL_ON_CPU:
        _say_once(f"overlap {mode} on {device.type}: {_SEQUENTIAL_ON_CPU[mode]}")
    ctx = OverlapContext(device=device, side=side_stream(device), sm_budget=sm_budget)
    if mode == "auto":
        return AutoOverlap(ctx)
    return FixedOverlap(mode, ctx)

"""Two-batch overlap (TBO): split a batch in two micro-batches and interleave their stages, so one
micro-batch computes (attention, experts) while the other's dispatch or combine is on the wire.

A layer's forward is a generator of stages (``DecoderLayer.stages``: attention + router + dispatch
launch | dispatch wait + routed experts + combine launch | combine wait + shared + residual). The
executor runs micro-batch A ``delay`` stages ahead, then alternates A, B, A, B on one host thread::

    delay 0:  A0 B0 A1 B1 A2 B2     B's attention runs while A's dispatch is in flight
    delay 1:  A0 A1 B0 A2 B1 B2     B's attention runs while A's combine is in flight

Each micro-batch uses its own dispatcher (``dispatcher_for``: B's is a twin of A's): its own hooks, so
single-batch overlap strategies attach to the right micro-batch and SBO and TBO combine. The twin
shares the scheme's buffers, whose own rounds keep two transfers in flight apart (DeepEP's double
buffer, ``low_latency``'s ``num_buffers``).

The hard part is agreement across ranks. Every rank must issue the same collectives in the same
order, yet each rank splits its own batch. So every rank always runs two micro-batches in the
same schedule; a rank whose batch cannot be split sensibly (one token, one sequence in decode, a
short prefill) gives micro-batch B no tokens — it still takes part in B's collectives with nothing to
send — and logs why at debug level. Micro-batch A always starts first, so when a prefill sequence is
cut in two, its first half is in A and has written its keys and values to the cache before B's
second half attends to them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from ..dispatch import Dispatcher, Traffic
from ..streams import sm_budget as sm_budget_ctx
from ..streams import sm_count
from .stages import run_interleaved

log = logging.getLogger("moe_sbo.tbo")

# SGLang's default ``tbo_token_distribution_threshold``: a split at a sequence boundary is kept when
# the smaller micro-batch holds at least this share of the tokens; otherwise one sequence is cut.
BALANCE_THRESHOLD = 0.48
# Below this many tokens a prefill is not worth splitting (each half would be launch-bound).
MIN_PREFILL_TOKENS = 64
# Stages micro-batch A runs before B starts, per regime (measure: ``moe-sbo bench tbo``).
DEFAULT_DELAY = {"decode": 0, "prefill": 0}
# Micro-batch B's dispatcher per micro-batch A's, dropped with it.
_TWINS: weakref.WeakKeyDictionary[Dispatcher, Dispatcher] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class MicroBatch:
    """Tokens ``[start, stop)`` of the packed batch and the layer's description of them (for a
    ``DecoderLayer``, a ``decoder.attention.Batch``)."""

    start: int
    stop: int
    batch: Any


@dataclass(frozen=True)
class Split:
    """The two micro-batches; ``reason`` says why B is empty when the batch was not split."""

    a: MicroBatch
    b: MicroBatch
    reason: str | None = None


class MoEWithDispatcher(Protocol):
    """What two-batch overlap needs of a layer's MoE (``MoELayer`` is one): the dispatcher it runs
    micro-batch A on, and where the traffic of both micro-batches is recorded."""

    dispatcher: Dispatcher
    last_traffic: Traffic


class PackedBatch(Protocol):
    """What two-batch overlap reads of a batch description: its tokens, and whether it is a decode step."""

    @property
    def decode(self) -> bool: ...

    @property
    def num_tokens(self) -> int: ...


class TwoBatchLayer(Protocol):
    """A layer two-batch overlap can run (``decoder.decoder_layer.DecoderLayer`` is one): its forward is a generator
    of stages that pauses while its MoE's transfers are in flight, and it splits its own batch, since
    only the layer knows what a micro-batch of its tokens must carry (sequences, cache slots)."""

    @property
    def moe(self) -> MoEWithDispatcher: ...

    def __call__(self, x_TH: torch.Tensor, batch: Any, cache: Any) -> torch.Tensor: ...

    def split_micro_batches(
        self, x_TH: torch.Tensor, batch: Any, cache: Any, *, threshold: float, min_prefill_tokens: int
    ) -> Split: ...

    def stages(
        self, x_TH: torch.Tensor, batch: Any, cache: Any, dispatcher: Dispatcher | None = None
    ) -> Generator[None, None, torch.Tensor]: ...


def twin_dispatcher(dispatcher: Dispatcher) -> Dispatcher:
    """Micro-batch B's dispatcher for ``dispatcher`` (micro-batch A's): made once, then reused.

    Its own hooks, so an SBO strategy attaches to one micro-batch only; the scheme's buffers are
    shared (``Dispatcher.twin``), so the scheme's own double buffering keeps the two rounds apart.
    """
    if dispatcher not in _TWINS:
        _TWINS[dispatcher] = dispatcher.twin()
    return _TWINS[dispatcher]


def dispatcher_for(moe: MoEWithDispatcher, micro_batch: int) -> Dispatcher:
    """The dispatcher micro-batch 0 (``moe.dispatcher``) or 1 (its twin) of ``moe`` uses."""
    if micro_batch not in (0, 1):
        raise ValueError(f"micro_batch must be 0 or 1 (two-batch overlap), got {micro_batch}")
    return moe.dispatcher if micro_batch == 0 else twin_dispatcher(moe.dispatcher)


def _check_serves(dispatcher: Dispatcher, moe: MoEWithDispatcher) -> None:
    """A dispatcher given to ``tbo_forward`` must deliver rows for the layer's experts (before any
    collective: a mismatch would otherwise surface as a shape error on some ranks only)."""
    own = moe.dispatcher
    got = (dispatcher.name, dispatcher.num_experts, dispatcher.ep.size, dispatcher.ep.rank)
    want = (own.name, own.num_experts, own.ep.size, own.ep.rank)
    if got != want:
        raise ValueError(
            f"tbo_forward's dispatcher must serve the layer's experts: (scheme, experts, EP size, rank) = "
            f"{want}, got {got}; build it with layer.moe.sibling_dispatcher(...)"
        )


GemmSmBudget = int | Literal["auto"] | None


def resolve_gemm_sm_budget(budget: GemmSmBudget, dispatcher: Dispatcher, device: torch.device) -> int | None:
    """The SMs TBO's GEMMs plan for on ``device`` (None: all of them, no budget).

    ``"auto"``: all but those the dispatcher's transfer holds while it runs beside compute
    (``Dispatcher.transfer_sms``: NCCL's CTAs over NCCL; none over symmetric memory, the copy engines,
    one rank or CPU, which then get no budget). An int is taken as given, None as none."""
    if budget != "auto":
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ValueError(f"gemm_sm_budget must be a number of SMs, 'auto' or None, got {budget!r}")
        return budget
    held = dispatcher.transfer_sms(device)
    return max(1, sm_count(device) - held) if held and device.type == "cuda" else None


def tbo_forward(
    layer: TwoBatchLayer,
    x_TH: torch.Tensor,
    batch: PackedBatch,
    cache: Any,
    *,
    delay: int | None = None,
    threshold: float = BALANCE_THRESHOLD,
    min_prefill_tokens: int = MIN_PREFILL_TOKENS,
    gemm_sm_budget: GemmSmBudget = "auto",
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor:
    """``layer`` (a ``DecoderLayer``) on ``x_TH`` [T, H] as two interleaved micro-batches -> ``[T, H]``.

    The layer splits its batch (``split_micro_batches``, which also checks ``x_TH``, ``batch`` and
    ``cache`` before any collective); this function runs the two halves' stages interleaved.

    ``dispatcher``: micro-batch A's (B runs its twin); None: the layer's MoE's own. A fixed-capacity
    dispatcher (``low_latency``) sends capacity-sized blocks whatever a micro-batch holds, so one built
    for the whole batch sends each half the whole batch's bytes: give one sized for the larger
    micro-batch of any rank, ``layer.moe.sibling_dispatcher(max_tokens_per_rank=...)``.

    ``gemm_sm_budget`` (CUDA): the SMs every GEMM of the two micro-batches plans for (``streams.sm_budget``;
    None: all; ``"auto"``, the default: all but the transfer's, ``resolve_gemm_sm_budget``). Under TBO one
    micro-batch's GEMMs run while the other's transfer holds some SMs, and a persistent GEMM
    (``torch._grouped_mm``'s CUTLASS kernel launches one CTA per SM it plans for) then waits with its
    last CTAs for the transfer's SMs to free: a budget that leaves them out avoids it (measured:
    docs/BENCHMARKS.md, "Two-batch overlap")."""
    split = layer.split_micro_batches(x_TH, batch, cache, threshold=threshold, min_prefill_tokens=min_prefill_tokens)
    dispatcher_a = layer.moe.dispatcher if dispatcher is None else dispatcher
    _check_serves(dispatcher_a, layer.moe)
    if split.reason:
        log.debug("two-batch overlap off for this batch: %s", split.reason)
    if delay is None:
        delay = DEFAULT_DELAY["decode" if batch.decode else "prefill"]
    a, b = split.a, split.b
    dispatcher_b = twin_dispatcher(dispatcher_a)
    with sm_budget_ctx(x_TH.device, resolve_gemm_sm_budget(gemm_sm_budget, dispatcher_a, x_TH.device)):
        out_a, out_b = run_interleaved(
            layer.stages(x_TH[a.start : a.stop], a.batch, cache, dispatcher=dispatcher_a),
            layer.stages(x_TH[b.start : b.stop], b.batch, cache, dispatcher=dispatcher_b),
            delay,
        )
    layer.moe.last_traffic = dispatcher_a.last_traffic + dispatcher_b.last_traffic
    return torch.cat([out_a, out_b]) if b.stop > b.start else out_a

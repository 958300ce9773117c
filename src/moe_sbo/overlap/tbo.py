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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..decoder.attention import Batch, KVCache
from ..dispatch import Dispatcher
from ..streams import sm_budget as sm_budget_ctx
from ..streams import sm_count
from .stages import run_interleaved

if TYPE_CHECKING:
    from ..decoder.decoder_layer import DecoderLayer
    from ..layer import MoELayer

log = logging.getLogger("moe_sbo.tbo")

# SGLang's default ``tbo_token_distribution_threshold``: a split at a sequence boundary is kept when
# the smaller micro-batch holds at least this share of the tokens; otherwise one sequence is cut.
BALANCE_THRESHOLD = 0.48
# Below this many tokens a prefill is not worth splitting (each half would be launch-bound).
MIN_PREFILL_TOKENS = 64
# Stages micro-batch A runs before B starts, per regime (measure: ``moe-sbo bench --tbo``).
DEFAULT_DELAY = {"decode": 0, "prefill": 0}
# Micro-batch B's dispatcher per micro-batch A's, dropped with it.
_TWINS: weakref.WeakKeyDictionary[Dispatcher, Dispatcher] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class MicroBatch:
    """Tokens ``[start, stop)`` of the packed batch and the ``Batch`` describing them."""

    start: int
    stop: int
    batch: Batch


@dataclass(frozen=True)
class Split:
    """The two micro-batches; ``reason`` says why B is empty when the batch was not split."""

    a: MicroBatch
    b: MicroBatch
    reason: str | None = None


def _empty(at: int, device: torch.device, decode: bool) -> MicroBatch:
    positions = torch.zeros(0, dtype=torch.int64, device=device)
    return MicroBatch(at, at, Batch((), (), (), positions, decode=decode))


def _unsplit(batch: Batch, reason: str) -> Split:
    total = batch.num_tokens
    return Split(MicroBatch(0, total, batch), _empty(total, batch.positions_T.device, batch.decode), reason)


def split_batch(
    batch: Batch, *, threshold: float = BALANCE_THRESHOLD, min_prefill_tokens: int = MIN_PREFILL_TOKENS
) -> Split:
    """Two micro-batches of about half the tokens each (decode: half the sequences).

    Prefill: the sequence-boundary split closest to half the tokens if the smaller side keeps at
    least ``threshold`` of them; otherwise the sequence holding the middle token is cut there.
    """
    total = batch.num_tokens
    positions = batch.positions_T
    if batch.decode:
        if total < 2:
            return _unsplit(batch, f"decode batch of {total} sequence(s): nothing to pair it with")
        half = (total + 1) // 2
        first = batch.slots[0]
        return Split(
            MicroBatch(0, half, Batch.decode_step(first, positions[:half])),
            MicroBatch(half, total, Batch.decode_step(first + half, positions[half:])),
        )
    if total < max(2, min_prefill_tokens):
        return _unsplit(batch, f"prefill of {total} tokens is below {min_prefill_tokens}: too small to split")
    ends = [sum(batch.lengths[: i + 1]) for i in range(len(batch.lengths))]
    best = min(range(len(ends) - 1), key=lambda i: abs(2 * ends[i] - total), default=None)
    if best is not None and min(ends[best], total - ends[best]) >= threshold * total:
        return _cut(batch, best + 1, None)
    middle = total // 2
    seq = next(i for i, end in enumerate(ends) if end > middle)
    return _cut(batch, seq, middle - (ends[seq] - batch.lengths[seq]))


def _cut(batch: Batch, seq: int, inside: int | None) -> Split:
    """A takes segments before ``seq`` (and the first ``inside`` tokens of segment ``seq`` if cut)."""
    slots, starts, lengths = list(batch.slots), list(batch.starts), list(batch.lengths)
    if inside:
        a_seg = (slots[: seq + 1], starts[: seq + 1], lengths[:seq] + [inside])
        b_seg = (slots[seq:], [starts[seq] + inside] + starts[seq + 1 :], [lengths[seq] - inside] + lengths[seq + 1 :])
    else:
        a_seg = (slots[:seq], starts[:seq], lengths[:seq])
        b_seg = (slots[seq:], starts[seq:], lengths[seq:])
    a_tokens = sum(a_seg[2])
    positions = batch.positions_T
    a = Batch(tuple(a_seg[0]), tuple(a_seg[1]), tuple(a_seg[2]), positions[:a_tokens])
    b = Batch(tuple(b_seg[0]), tuple(b_seg[1]), tuple(b_seg[2]), positions[a_tokens:])
    return Split(MicroBatch(0, a_tokens, a), MicroBatch(a_tokens, batch.num_tokens, b))


def twin_dispatcher(dispatcher: Dispatcher) -> Dispatcher:
    """Micro-batch B's dispatcher for ``dispatcher`` (micro-batch A's): made once, then reused.

    Its own hooks, so an SBO strategy attaches to one micro-batch only; the scheme's buffers are
    shared (``Dispatcher.twin``), so the scheme's own double buffering keeps the two rounds apart.
    """
    if dispatcher not in _TWINS:
        _TWINS[dispatcher] = dispatcher.twin()
    return _TWINS[dispatcher]


def dispatcher_for(moe: MoELayer, micro_batch: int) -> Dispatcher:
    """The dispatcher micro-batch 0 (``moe.dispatcher``) or 1 (its twin) of ``moe`` uses."""
    if micro_batch not in (0, 1):
        raise ValueError(f"micro_batch must be 0 or 1 (two-batch overlap), got {micro_batch}")
    return moe.dispatcher if micro_batch == 0 else twin_dispatcher(moe.dispatcher)


def _check_serves(dispatcher: Dispatcher, moe: MoELayer) -> None:
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
    layer: DecoderLayer,
    x_TH: torch.Tensor,
    batch: Batch,
    cache: KVCache,
    *,
    delay: int | None = None,
    threshold: float = BALANCE_THRESHOLD,
    min_prefill_tokens: int = MIN_PREFILL_TOKENS,
    gemm_sm_budget: GemmSmBudget = "auto",
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor:
    """``layer`` (a ``DecoderLayer``) on ``x_TH`` [T, H] as two interleaved micro-batches -> ``[T, H]``.

    ``dispatcher``: micro-batch A's (B runs its twin); None: the layer's MoE's own. A fixed-capacity
    dispatcher (``low_latency``) sends capacity-sized blocks whatever a micro-batch holds, so one built
    for the whole batch sends each half the whole batch's bytes: give one sized for the larger
    micro-batch of any rank, ``layer.moe.sibling_dispatcher(max_tokens_per_rank=...)``.

    ``gemm_sm_budget`` (CUDA): the SMs every GEMM of the two micro-batches plans for (``streams.sm_budget``;
    None: all; ``"auto"``, the default: all but the transfer's, ``resolve_gemm_sm_budget``). Under TBO one
    micro-batch's GEMMs run while the other's transfer holds some SMs, and a persistent GEMM
    (``torch._grouped_mm``'s CUTLASS kernel launches one CTA per SM it plans for) then waits with its
    last CTAs for the transfer's SMs to free: a budget that leaves them out avoids it (on 2x H200 over
    an inter-node-class wire, TBO at 4096-16384 prefill tokens per rank went from 1.04-1.12x to
    1.17-1.29x the layer without TBO: docs/BENCHMARKS.md)."""
    if x_TH.shape[0] != batch.num_tokens:
        raise ValueError(f"x has {x_TH.shape[0]} tokens but the batch describes {batch.num_tokens}")
    cache.check(batch)
    dispatcher_a = layer.moe.dispatcher if dispatcher is None else dispatcher
    _check_serves(dispatcher_a, layer.moe)
    split = split_batch(batch, threshold=threshold, min_prefill_tokens=min_prefill_tokens)
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

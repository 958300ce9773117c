"""Two micro-batches of a packed batch, for two-batch overlap (``overlap/tbo.py`` runs them).

The hard part is balance without breaking causality. Prefill splits at the sequence boundary closest to
half the tokens when the smaller side keeps at least ``threshold`` of them (SGLang's rule); otherwise
the sequence holding the middle token is cut there, its first half in micro-batch A, which runs first,
so its keys and values are in the cache before B's second half attends to them. Decode splits the
sequences in half. A batch too small to split leaves B empty, with the reason.
"""

from __future__ import annotations

import torch

from ..overlap.tbo import BALANCE_THRESHOLD, MIN_PREFILL_TOKENS, MicroBatch, Split
from .attention import Batch


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

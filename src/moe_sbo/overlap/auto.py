"""What every ``auto`` choice shares: token-count buckets, the exploration that times each candidate on
real forwards, and the agreement across ranks.

SBO's ``AutoOverlap`` (``sbo.py``) picks an overlap mode per bucket, TBO's ``AutoTbo`` (``tbo_auto.py``)
whether to split the batch; both explore with ``BucketTrials`` and decide by ``slowest_rank``.
The hard part is agreement: every rank must keep the same choice, or ranks that chose differently wait
in collectives that never match; deciding by the slowest rank's medians (one all-reduce) gives every
rank the same answer, and a layer runs at its slowest rank's pace anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from ..dispatch import EPGroup

C = TypeVar("C")  # an auto strategy's candidate: an overlap mode, or TBO on/off


def bucket_of(num_tokens: int) -> int:
    """Token counts that share a decision: the next power of two."""
    return 1 << max(num_tokens - 1, 0).bit_length()


@dataclass
class BucketTrials(Generic[C]):
    """The exploration behind an ``auto`` choice, per token-count bucket: the bucket's forwards cycle
    through ``candidates``, the first ``warmup`` rounds untimed, then timed until every candidate has
    ``trials`` samples (``timings_us``: bucket -> candidate -> µs). Used by SBO's ``AutoOverlap``
    and TBO's ``AutoTbo``, which decide from the samples each their own way."""

    candidates: tuple[C, ...]
    trials: int = 3
    warmup: int = 1
    timings_us: dict[int, dict[C, list[float]]] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.trials < 1 or self.warmup < 0:
            raise ValueError(f"trials must be >= 1 and warmup >= 0, got trials={self.trials}, warmup={self.warmup}")

    def next(self, bucket: int) -> tuple[C, bool]:
        """The candidate this forward of ``bucket`` runs, and whether its time is to be booked."""
        call = self._calls.get(bucket, 0)
        self._calls[bucket] = call + 1
        return self.candidates[call % len(self.candidates)], call >= self.warmup * len(self.candidates)

    def book(self, bucket: int, candidate: C, elapsed_us: float) -> dict[C, list[float]] | None:
        """Book one timed forward; the bucket's samples once every candidate has its trials, else None."""
        samples = self.timings_us.setdefault(bucket, {c: [] for c in self.candidates})
        samples[candidate].append(elapsed_us)
        return samples if all(len(samples[c]) >= self.trials for c in self.candidates) else None


def slowest_rank(values: list[float], group: EPGroup, device: torch.device) -> list[float]:
    """Each of ``values`` as its slowest (largest) over the ranks of ``group`` (one all-reduce; the
    values themselves at one rank). What ``auto`` strategies decide by: a layer runs at its slowest
    rank's pace, and every rank must keep the same choice."""
    if group.size == 1:
        return list(values)
    reduced = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group.group)
    return reduced.tolist()

"""``auto`` two-batch overlap: per token-count bucket, time a decoder layer with and without TBO on
real forwards, then keep the faster, the same choice on every rank.

TBO pays only where a transfer is long beside the compute: published decode runs lose with it at
small batches and gain at large ones, and on two GPUs of one host over NVLink it gained little or lost
(docs/BENCHMARKS.md, "Two-batch overlap"). So the choice is made per bucket (the next power of two of the
tokens, as SBO's ``auto``), from timings of the forwards themselves.

The hard part is agreement. With TBO a rank makes two MoE calls per layer, without it one, so ranks
that chose differently would wait in collectives that never match. Two rules keep them together:

- the caller passes ``agreed_tokens``, a token count every rank agrees on (the largest batch over
  the ranks, which a data-parallel-attention scheduler gathers every step anyway); its bucket, and
  so the candidate an exploring forward runs (by the bucket's call count), is the same everywhere;
- the decision, taken once per bucket when both candidates have their trials, compares each
  candidate's slowest rank (one all-reduce of two medians over the EP group), so every rank keeps
  the same one. A layer runs at its slowest rank's pace, so that is also the right comparison.

Exploring forwards read their timing at once (a device sync on CUDA, only while exploring). Inside
a CUDA-graph capture nothing is timed: the bucket's choice runs, or no TBO before there is one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dispatch import Dispatcher, EPGroup
from ..streams import capturing, clock, elapsed_us
from .auto import BucketTrials, bucket_of, slowest_rank
from .tbo import GemmSmBudget, PackedBatch, TwoBatchLayer, tbo_forward

CANDIDATES = (False, True)  # without TBO first: a bucket's first forwards run the plain layer


@dataclass
class AutoTbo:
    """Per ``agreed_tokens`` bucket: explore both candidates (``warmup`` untimed rounds, then
    ``trials`` timed ones each, alternating), then keep the one whose slowest rank was faster
    (ties: no TBO). ``choices`` (bucket -> use TBO) can also be given up front."""

    trials: int = 3
    warmup: int = 1
    choices: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.exploration = BucketTrials(CANDIDATES, self.trials, self.warmup)

    @property
    def timings_us(self) -> dict[int, dict[bool, list[float]]]:
        """Bucket -> with TBO or not -> the µs of its timed forwards."""
        return self.exploration.timings_us

    def forward(
        self,
        layer: TwoBatchLayer,
        x_TH: torch.Tensor,
        batch: PackedBatch,
        cache: Any,
        *,
        agreed_tokens: int,
        delay: int | None = None,
        gemm_sm_budget: GemmSmBudget = "auto",
        dispatcher: Dispatcher | None = None,
    ) -> torch.Tensor:
        """``layer`` on ``x_TH`` [T, H] with or without two-batch overlap -> ``[T, H]``.

        ``agreed_tokens``: the same on every rank of the layer's EP group (e.g. the largest T over
        the ranks); a rank passing another value can hang the others. ``delay``, ``gemm_sm_budget``:
        TBO's (``tbo_forward``'s); ``dispatcher``: TBO's (the layer runs its own without TBO).
        """

        def run(use_tbo: bool) -> torch.Tensor:
            if use_tbo:
                return tbo_forward(
                    layer, x_TH, batch, cache, delay=delay, gemm_sm_budget=gemm_sm_budget, dispatcher=dispatcher
                )
            return layer(x_TH, batch, cache)

        return self.run(run, agreed_tokens=agreed_tokens, ep=layer.moe.dispatcher.ep, device=x_TH.device)

    def run(
        self, forward: Callable[[bool], torch.Tensor], *, agreed_tokens: int, ep: EPGroup, device: torch.device
    ) -> torch.Tensor:
        """``forward(use_tbo)`` with the bucket's choice, or exploring: what ``forward`` does for
        ``AutoTbo.forward``, for callers that run the two candidates their own way (the benchmark
        gives each its own dispatcher). ``ep``: the group whose ranks must agree."""
        if agreed_tokens < 0:
            raise ValueError(f"agreed_tokens must be >= 0, got {agreed_tokens}")
        bucket = bucket_of(agreed_tokens)
        if bucket in self.choices or capturing(device):
            return forward(self.choices.get(bucket, False))
        use_tbo, timed = self.exploration.next(bucket)
        y_TH, elapsed_us = _timed(lambda: forward(use_tbo), device)
        samples = self.exploration.book(bucket, use_tbo, elapsed_us) if timed else None
        if samples is not None:
            self.choices[bucket] = self._decide(samples, ep, device)
        return y_TH

    def decided(self, agreed_tokens: int) -> bool:
        """Whether the bucket of ``agreed_tokens`` has its choice (exploration is over)."""
        return bucket_of(agreed_tokens) in self.choices

    def _decide(self, samples: dict[bool, list[float]], group: EPGroup, device: torch.device) -> bool:
        """Whether TBO wins: each candidate's median on its slowest rank (one all-reduce)."""
        without, with_tbo = slowest_rank([statistics.median(samples[c]) for c in CANDIDATES], group, device)
        return with_tbo < without


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    """``fn()`` and its µs (on CUDA read at once: a sync, exploration only)."""
    start = clock(device)
    out = fn()
    return out, elapsed_us(start, clock(device))

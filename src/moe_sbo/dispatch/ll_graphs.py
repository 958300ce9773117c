"""Piecewise CUDA graphs for ``low_latency``'s eager forwards: its index work, captured once per
buffer set and replayed, so an eager phase costs the host a handful of calls at any size.

Legend: see ``moe_sbo/__init__.py``; here C is the capacity (``max_tokens_per_rank``).

Why: an eager forward is what prefill runs, and there the dispatcher's host time is on the critical
path. The send plan (``pack_rows``: a count pass, a prefix sum, a place pass, the row copy, the id
check) and the receiver layout (``expert_layout``: allocations, two passes, a prefix sum) are about
ten launches each; on an H200 host a Triton launch costs 20-30 µs and a small torch op 5-25 µs, so
the host spent ~470 µs in ``dispatch_launch`` and ~350 µs in ``dispatch_wait`` at 4096 tokens while
the GPU needed less. Replaying a captured graph of the same kernels is one call.

What is graphed, and what is not:

- ``pack``: the send plan and row copy, from fixed staging buffers (x [C, H], ids [C, K] with -1 past
  the real T tokens, weights [C, K]) into the round's send or peer buffers, and with symmetric memory
  the transfer's start (``copy_engine``'s peer copies); ``slot_CP`` [C, P] is kept per buffer set for
  combine. One graph serves every T <= C: padding tokens (ids -1) go nowhere, so the kernels do the
  work of T tokens plus a skip per pad row.
- ``layout``: with symmetric memory the transfer's end (the barrier), then the receiver's
  expert-major layout of the round's receive buffer (a fixed address); with ``fixed_expert_rows``
  the gather of the expert rows too, into the graph's fixed output (valid until the set's next
  round, as DeepEP's low-latency receive buffers are; S * K rows of H kept per set).
- Not graphed: an NCCL transfer (one collective call each way), and the kernels whose inputs or
  outputs are the caller's tensors (``gather_rows`` allocates the expert rows unless they are fixed,
  ``reduce_pairs`` reads the experts' output, ``gather_sum`` allocates y), one launch each. Keeping
  them out keeps every tensor the caller holds its own (no later replay overwrites it), at no extra
  memory; combine is then three calls (two launches and the transfer) and needs no graph.

The hard part is that a graph bakes in addresses and sizes. Every graphed input lives in buffers that
belong to one buffer set (round), allocated once, and every shape is fixed by C; the graphs of round n
are replayed next by round n + num_buffers, which reuses round n's buffers as it does without graphs
(the dispatcher's round check refuses to combine a round whose buffers were taken). A graph is
captured on its piece's first call, right after that call ran eagerly (which compiled the kernels);
capture synchronises the device once. The barrier in a graph waits on the device; nothing in a graph
talks to the peers from the host, so ranks capture independently. Under a caller's own capture (a
whole forward in a CUDA graph) the dispatcher runs the kernels directly instead, and on CPU (the
Triton interpreter) the same staged path runs without capture, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..streams import capture_graph


@dataclass
class Staging:
    """One buffer set's fixed inputs and outputs of the ``pack`` graph (C tokens, P ranks).

    The inputs are kept in the router's dtypes (int64 ids, float32 weights) so that one forward's
    three tensors, viewed as 4-byte words, are copied in by one ``_foreach_copy_`` of a single
    dtype: on CUDA one fused launch, where three dtypes take three copy launches (the host's cost,
    which an eager decode step waits on). Inputs of other dtypes, or strided ones, take those three
    converting copies.

    ``padded_from``: the first row of ``ids_CK`` known to hold -1 (host state, so the -1 tail is
    only rewritten when T shrinks). ``views``: rows 0..T-1 of the three inputs and of ``slot_CP``,
    and the inputs' word views, for the last T staged
    (making them costs the host more than the copies' own call, and a decode loop stages one T)."""

    x_CH: torch.Tensor
    ids_CK: torch.Tensor
    weights_CK: torch.Tensor
    slot_CP: torch.Tensor
    padded_from: int = 0
    views: tuple[int, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = (-1, (), ())

    @classmethod
    def allocate(cls, capacity: int, hidden: int, top_k: int, num_ranks: int, dtype: torch.dtype, device) -> Staging:
        with torch.inference_mode(False):  # written by later forwards under plain no_grad too
            return cls(
                x_CH=torch.zeros(capacity, hidden, dtype=dtype, device=device),
                ids_CK=torch.full((capacity, top_k), -1, dtype=torch.int64, device=device),
                weights_CK=torch.zeros(capacity, top_k, dtype=torch.float32, device=device),
                slot_CP=torch.zeros(capacity, num_ranks, dtype=torch.int64, device=device),
            )

    def stage(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Copy one forward's T tokens in; rows T..C-1 get ids -1 (one call, and a fill when T
        shrank; no sync) -> ``slot_CP``'s first T rows, [T, P]."""
        num_tokens = x_TH.shape[0]
        if self.views[0] != num_tokens:
            rows = (self.x_CH, self.ids_CK, self.weights_CK, self.slot_CP)
            with torch.inference_mode(False):  # a dtype view made in inference mode could not be written outside it
                views = tuple(t[:num_tokens] for t in rows)
                self.views = (num_tokens, views, _words(views[:3]))
        x_view, ids_view, weights_view, slot_TP = self.views[1]
        sources: tuple[torch.Tensor, ...] = ()
        if self.views[2] and (x_TH.dtype, ids_TK.dtype, weights_TK.dtype) == (x_view.dtype, torch.int64, torch.float32):
            sources = _words((x_TH, ids_TK, weights_TK))
        if sources:
            torch._foreach_copy_(self.views[2], sources)
        else:
            torch._foreach_copy_((x_view, ids_view, weights_view), (x_TH, ids_TK, weights_TK))
        if num_tokens < self.padded_from:
            self.ids_CK[num_tokens : self.padded_from].fill_(-1)
        self.padded_from = num_tokens
        return slot_TP

    @staticmethod
    def bytes(capacity: int, hidden: int, top_k: int, num_ranks: int, elem: int) -> int:
        return capacity * (hidden * elem + top_k * (8 + 4) + num_ranks * 8)


def _words(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` viewed as int32 words, or () if one is strided. Every row is whole words: x rows
    are a multiple of 16 bytes (the fused kernels' check, before any staging), ids int64, weights
    float32."""
    x, ids, weights = tensors  # spelled out: called on every staged forward, where the host's time counts
    if not (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
        return ()
    return x.view(torch.int32), ids.view(torch.int32), weights.view(torch.int32)


class PieceGraph:
    """A piece of index work: ``fn`` queues kernels on the current stream (no host read, no
    collective) and returns its outputs; it should not hold the dispatcher (a reference cycle would
    keep a deleted layer's buffers alive until the next garbage collection). The first call runs it
    eagerly and then captures it (``capture``: CUDA only); every later call replays the capture and
    returns the captured outputs, which each replay overwrites. Without ``capture`` every call runs
    ``fn``."""

    def __init__(self, fn: Callable[[], Any], capture: bool):
        self._fn = fn
        self._capture = capture
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self) -> Any:
        if self._graph is not None:
            self._graph.replay()
            return self._outputs
        outputs = self._fn()
        if self._capture:  # the eager call above was the warm-up
            self._graph, self._outputs = capture_graph(self._fn, warmup=0)
        return outputs


@dataclass
class RoundGraphs:
    """One buffer set's pieces (built on first use): the ``pack`` graph and the ``staging`` it
    reads, the start of the set's dispatch transfer (in ``pack`` with symmetric memory, called after
    it with NCCL) and the ``layout`` graph (which first waits on the set's barrier when ``pack``
    started a symmetric-memory transfer)."""

    staging: Staging | None = None
    pack: PieceGraph | None = None
    start_transfer: Callable[[], list] | None = None
    layout: PieceGraph | None = None
    layout_keeps_fp8: bool = False  # the ``deliver_fp8`` the layout graph's gather was built for

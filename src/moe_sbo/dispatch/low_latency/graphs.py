"""Piecewise CUDA graphs for ``low_latency``'s eager forwards: its index work, captured once per
buffer set and replayed, so an eager phase costs the host a handful of calls at any size.

Legend: see ``moe_sbo/__init__.py``; here C is the capacity (``max_tokens_per_rank``).

Why: an eager forward is what prefill runs, and there the dispatcher's host time is on the critical
path. The send plan (``pack_rows``: a count pass, a prefix sum, a place pass, the row copy, the id
check) and the receiver layout (``expert_layout``: allocations, two passes, a prefix sum) are about
ten launches each, and each launch costs the host more than the GPU's work at these sizes
(docs/BENCHMARKS.md has the host times). Replaying a captured graph of the same kernels is one call.

What is graphed: every kernel of both phases, in four pieces per buffer set (``pieces.py`` builds
each). The caller's tensors
(x, ids and weights in; the expert rows out; the experts' output in; y out) are new each forward, so
the pieces read their addresses, and the token count T, from a small table the host writes before
each replay (``addresses.CallerAddresses``: plain stores into pinned memory, fetched by the
piece's first kernel), not from the capture:

- ``pack``: the staging of the forward's x, ids and weights into fixed buffers (x [C, H], ids [C, K]
  with -1 past the real T tokens, weights [C, K]), the send plan and row copy into the round's send
  or peer buffers, and with symmetric memory the transfer's start (``copy_engine``'s peer copies);
  ``slot_CP`` [C, P] is kept per buffer set for combine. One graph serves every T <= C: padding
  tokens (ids -1) go nowhere, so the kernels do the work of T tokens plus a skip per pad row.
- ``layout``: with symmetric memory the transfer's end (the barrier), then the receiver's
  expert-major layout of the round's receive buffer (a fixed address) and the gather of the expert
  rows into the tensor the host allocated for this forward (``fixed_expert_rows``: into one kept per
  set, valid until the set's next round, as DeepEP's low-latency receive buffers are).
- ``combine``: each slot's weighted sum of the experts' output into the blocks, and with symmetric
  memory the transfer's start.
- ``combine_end``: with symmetric memory the transfer's end, then each token's returned rows summed
  into the y the host allocated for this forward.
- Not graphed: an NCCL transfer (one collective call each way).

So what the caller holds stays its own (no later replay overwrites a tensor handed out, unless
``fixed_expert_rows`` says so), and an eager phase costs the host one or two replays, a table write
and an allocation.

The hard part is that a graph bakes in addresses and sizes. Every graphed input lives in buffers that
belong to one buffer set (round), allocated once, and every shape is fixed by C; the graphs of round n
are replayed next by round n + num_buffers, which reuses round n's buffers as it does without graphs
(the dispatcher's round check refuses to combine a round whose buffers were taken). A graph is
captured on its piece's first call, right after that call ran eagerly (which compiled the kernels);
capture synchronises the device once. The barrier in a graph waits on the device; nothing in a graph
talks to the peers from the host, so ranks capture independently. Under a caller's own capture (a
whole forward in a CUDA graph) the kernels run directly instead (``fused.FusedPath``), and on CPU (the
Triton interpreter) the same staged path runs without capture, which is what the CPU tests exercise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...streams import capture_graph
from .addresses import CallerAddresses, readable


@dataclass
class Staging:
    """One buffer set's fixed inputs and outputs of the ``pack`` graph (C tokens, P ranks).

    The ``pack`` graph's first kernels copy a forward's x, ids and weights in, from the addresses
    the host writes before the replay (``addresses.py``): no launch of the host's own. Inputs the
    kernels cannot read in place (another dtype than x's own, int64 ids and float32 weights, which
    the router gives; strided; not 16-byte aligned) are converted first, one torch copy each.
    ``slot_views``: ``slot_CP``'s first T rows for the last T (a view per forward costs the host a
    few microseconds, and a decode loop stages one T)."""

    x_CH: torch.Tensor
    ids_CK: torch.Tensor
    weights_CK: torch.Tensor
    slot_CP: torch.Tensor
    slot_views: tuple[int, torch.Tensor | None] = (-1, None)

    @classmethod
    def allocate(cls, capacity: int, hidden: int, top_k: int, num_ranks: int, dtype: torch.dtype, device) -> Staging:
        with torch.inference_mode(False):  # written by later forwards under plain no_grad too
            return cls(
                x_CH=torch.zeros(capacity, hidden, dtype=dtype, device=device),
                ids_CK=torch.full((capacity, top_k), -1, dtype=torch.int64, device=device),
                weights_CK=torch.zeros(capacity, top_k, dtype=torch.float32, device=device),
                slot_CP=torch.zeros(capacity, num_ranks, dtype=torch.int64, device=device),
            )

    def pack_values(
        self, table: CallerAddresses, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> tuple[tuple[int, int, int, int], tuple[torch.Tensor, ...]]:
        """The ``pack`` graph's table values for a forward's inputs -> ((T, then the offsets of x,
        ids and weights), the tensors they address: the caller's own, or converted copies, which
        the caller must hold until the replay is queued)."""
        x_at = table.offset_in_place(x_TH, self.x_CH.dtype)
        ids_at = table.offset_in_place(ids_TK, torch.int64)
        weights_at = table.offset_in_place(weights_TK, torch.float32)
        if x_at is None or ids_at is None or weights_at is None:  # not what the router gives: convert
            x_TH, ids_TK = readable(x_TH, self.x_CH.dtype), readable(ids_TK, torch.int64)
            weights_TK = readable(weights_TK, torch.float32)
            x_at, ids_at, weights_at = table.offset_of(x_TH), table.offset_of(ids_TK), table.offset_of(weights_TK)
        return (x_TH.shape[0], x_at, ids_at, weights_at), (x_TH, ids_TK, weights_TK)

    def slot_TP(self, num_tokens: int) -> torch.Tensor:
        """``slot_CP``'s first T rows, [T, P]: where each token's rows went, for combine."""
        if self.slot_views[0] != num_tokens:
            with torch.inference_mode(False):  # a view made in inference mode could not be written outside it
                self.slot_views = (num_tokens, self.slot_CP[:num_tokens])
        view = self.slot_views[1]
        assert view is not None
        return view

    @staticmethod
    def bytes(capacity: int, hidden: int, top_k: int, num_ranks: int, elem: int) -> int:
        return capacity * (hidden * elem + top_k * (8 + 4) + num_ranks * 8)


class PieceGraph:
    """A piece of index work: ``fn`` queues kernels on the current stream (no host read, no
    collective) and returns its outputs; it should not hold the dispatcher (a reference cycle would
    keep a deleted layer's buffers alive until the next garbage collection). With ``capture`` (CUDA
    only) the first call runs ``fn`` eagerly (the warm-up: Triton compiles), captures it and replays
    the capture; every call returns the captured outputs, which each replay overwrites. So a later
    piece captured against them (``combine`` reads the ``layout`` piece's tensors) reads the same
    tensors every replay, and the first call runs the piece's kernels twice on the same inputs (each
    piece gives the same bytes again; a piece with a barrier waits twice, as every rank's does).
    Without ``capture`` every call runs ``fn``. With ``addresses``, each call's ``values`` are
    written into them first and ``fn`` is preceded by their fetch (``addresses.py``), so the piece's
    kernels read the caller's tensors.
    """

    def __init__(self, fn: Callable[[], Any], capture: bool, addresses: CallerAddresses | None = None):
        if addresses is not None:  # the piece's first kernel fetches the values each call writes
            body = fn

            def fn() -> Any:
                addresses.fetch()
                return body()

        self._fn = fn
        self._capture = capture
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None
        self.addresses = addresses

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def outputs(self) -> Any:
        """What the last call returned (with ``capture``, the captured outputs: the same tensors every
        replay; without, each call's own), for a later piece that reads them when it runs."""
        return self._outputs

    def __call__(self, *values: int) -> Any:
        if self.addresses is not None:
            self.addresses.write(*values)
        if self._graph is None:
            outputs = self._fn()
            if not self._capture:
                self._outputs = outputs
                return outputs
            self._graph, self._outputs = capture_graph(self._fn, warmup=0)  # the call above was the warm-up
        self._graph.replay()
        return self._outputs


@dataclass
class RoundGraphs:
    """One buffer set's pieces (built on first use, by ``pieces.py``): the ``pack`` graph and the
    ``staging`` it reads, the ``layout`` graph (which first waits on the set's barrier when ``pack``
    started a symmetric-memory transfer; with ``fixed_expert_rows`` it gathers into
    ``expert_rows``), and the ``combine`` and ``combine_end`` graphs (the latter first waits on the
    combine barrier with symmetric memory). The transfers' starts are the buffers' ``Exchange``s:
    inside the ``pack`` and ``combine`` graphs with symmetric memory, called after them with NCCL."""

    staging: Staging | None = None
    pack: PieceGraph | None = None
    layout: PieceGraph | None = None
    # The (``deliver_fp8``, in place) the layout graph was built for: in place (``index_rows``) it
    # gathers no rows.
    layout_built_for: tuple[bool, bool] = (False, False)
    expert_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # with ``fixed_expert_rows``
    # With ``index_rows``: the receive buffer's rows [S + 1, H] (and with fp8 their scales), the views
    # handed out each round (made once: a view per forward costs the host a few microseconds).
    received_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None
    combine: PieceGraph | None = None
    combine_end: PieceGraph | None = None
    # ``set_combine_weights`` of an eager round: the weights staged here (float32 [C, K], made on first
    # use), then a piece per T that writes them into the rows and ends with the set's barrier.
    restamp_weights_CK: torch.Tensor | None = None
    restamp: dict[int, PieceGraph] = field(default_factory=dict)

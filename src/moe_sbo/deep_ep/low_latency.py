"""DeepEP's low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``) over moe-sbo's
``low_latency`` dispatcher, through its public phases (``dispatch_launch`` / ``dispatch_wait`` /
``combine_launch`` / ``combine_wait``) and its packed per-expert rows (``dispatch.low_latency.packed``).

Legend: see ``moe_sbo/__init__.py``; here C is DeepEP's ``num_max_dispatch_tokens_per_rank``, N = P * C
the rows of each expert in DeepEP's layout, and X = T * K the (token, choice) pairs of this rank.

::

    dispatch  x [T, H] -> one row per (token, rank), weight 1 (``restamp``) or the dispatch's
                          weights (``topk_weights``); or one row per (token, choice) [X, H], each with
                          its one expert id and weight 1 (capacity C * K); fp8 on the wire with use_fp8
              the dispatcher's grouped rows -> DeepEP's packed [L, N, H] and counts [L] (one kernel,
              replayed from a graph when eager); layout ranges [L, P] (begin << 32 | count of the rows
              from each source rank), computed when ``handle[1]`` is read
    combine   restamp: combine's topk_weights written into the dispatched rows on the experts' ranks
              (``set_combine_weights``); then the experts' [L, N, H] read in place by the dispatcher's
              combine -> each token's sum [T, H]; per choice: each (token, choice) row returns
              unweighted [X, H] and the token's rank weights them and sums in float32 (one kernel)

The hard part is the weights. DeepEP's low-latency combine takes them only at combine, on the token's
rank, while moe-sbo's dispatcher weights each expert row on the expert's rank with the weights its
row carries, and sends one row per (token, rank), not one per choice. Where the rows lie in the
peers' buffers (symmetric memory, or one rank) combine's weights are written into them before the
combine: moe-sbo's rows and DeepEP's meaning. A caller that knows the weights at dispatch (every
engine does: the router made them) may pass them there and skip that step; combine then refuses any
other weights. Elsewhere (NCCL, CPU) every (token, choice) travels as a token of its own with weight
1, as DeepEP's own kernels send it. Every step is a fixed-shape device operation, so the whole path
can be captured in a CUDA graph (after one eager call allocates the buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dispatch import Dispatcher, Pending
from ..dispatch.low_latency.packed import PackedRows, combine_input, pack_rows, rows_per_source
from ..dispatch.reduce import gather_sum
from ..quant.fp8 import FP8_GROUP
from ..streams import capture_graph, capturing
from .layout import check_topk_idx

MAX_PACK_GRAPHS = 16  # pack graphs kept per Buffer: (dispatcher, buffer set, receive buffer) combinations


@dataclass
class LowLatencyHandle:
    """What ``low_latency_dispatch`` returns as ``handle``; filled when the receive completes (at once,
    or when the receiving hook runs), so it is not frozen.

    DeepEP-visible: ``layout_range`` int64 [L, P] (``handle[1]``, computed on first read),
    ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts`` (``handle[2..4]``). ``handle[0]``,
    DeepEP's per-row source token index, is not known on this side (moe-sbo's receiver sees each
    row's source rank and slot, never the token index) and raises ``ValueError``.

    Internal: ``dtype`` of the dispatched x, the ``dispatcher``, ``num_topk``, ``num_tokens``,
    ``buffer_index`` (which of the two receive and zero-copy combine buffers is this round's),
    ``device``, ``topk_weights`` (the dispatch's, when given: weighted on the experts' ranks) and
    its ``weights_version``, ``restamp`` (combine writes its weights into the dispatched rows
    first), ``choice_index_TK`` (per choice: int64 [T, K] arange, each (token,
    choice)'s row among the X returned), ``packed`` (the receive's ``PackedRows``).
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    dtype: torch.dtype  # of the dispatched x (and of combine's rows)
    num_topk: int
    num_tokens: int
    buffer_index: int
    dispatcher: Dispatcher
    device: torch.device
    topk_weights: torch.Tensor | None = None
    weights_version: int = 0
    restamp: bool = False
    choice_index_TK: torch.Tensor | None = None
    packed: PackedRows | None = None
    pending: Pending | None = field(default=None, repr=False)
    _layout_range: torch.Tensor | None = field(default=None, repr=False)

    @property
    def layout_range(self) -> torch.Tensor:
        """int64 [L, P]: ``begin << 32 | count`` of the rows each source rank sent each local expert.

        Sync: device operations on the current stream, the first time it is read."""
        if self._layout_range is None:
            if self.packed is None:
                raise ValueError("the dispatch of this handle has not been received yet: call its receiving hook first")
            d = self.dispatcher
            count_LP = rows_per_source(self.packed, d.capacity or 1, d.ep.size)
            self._layout_range = ((count_LP.cumsum(dim=1) - count_LP) << 32) | count_LP
        return self._layout_range

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> Any:
        position = index + 5 if isinstance(index, int) and index < 0 else index
        if position == 0:
            raise ValueError(
                "handle[0], DeepEP's per-row source token index (src_info), is not kept by moe_sbo.deep_ep: "
                "moe-sbo's receiver knows each row's source rank (handle[1], the layout ranges), not its token"
            )
        if position == 1:
            return self.layout_range
        fields = (None, None, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
        return fields[position]


def check_dispatch_args(
    x_TH: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    num_ranks: int,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    cumulative_local_expert_recv_stats: torch.Tensor | None,
    dispatch_wait_recv_cost_stats: torch.Tensor | None,
    topk_weights_TK: torch.Tensor | None = None,
) -> None:
    """Refuse, before any collective, what this mode cannot honour or DeepEP would not accept."""
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got {getattr(x_TH, 'shape', type(x_TH).__name__)}")
    check_topk_idx(topk_idx_TK)
    if topk_idx_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"topk_idx must have x's {x_TH.shape[0]} rows, got {tuple(topk_idx_TK.shape)}")
    if topk_weights_TK is not None and (
        not isinstance(topk_weights_TK, torch.Tensor)
        or tuple(topk_weights_TK.shape) != tuple(topk_idx_TK.shape)
        or topk_weights_TK.dtype != torch.float32
        or topk_weights_TK.device != x_TH.device
    ):
        raise ValueError(
            f"topk_weights must be float32 [num_tokens, num_topk] = {list(topk_idx_TK.shape)} on {x_TH.device}, got "
            f"{getattr(topk_weights_TK, 'dtype', type(topk_weights_TK).__name__)} "
            f"{tuple(getattr(topk_weights_TK, 'shape', ()))}"
        )
    if x_TH.shape[0] > num_max_dispatch_tokens_per_rank:
        raise ValueError(
            f"num_tokens must be <= num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank}, got "
            f"{x_TH.shape[0]}; split the batch or raise num_max_dispatch_tokens_per_rank on every rank"
        )
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts must be a positive multiple of the EP size {num_ranks}, got {num_experts}")
    if use_fp8 and x_TH.shape[1] % FP8_GROUP:
        raise ValueError(f"use_fp8 needs hidden % {FP8_GROUP} == 0, got hidden = {x_TH.shape[1]}; pass use_fp8=False")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 packs power-of-2 scales, so it needs round_scale=True (as in DeepEP)")
    if use_fp8 and round_scale:
        raise ValueError(
            "round_scale (power-of-2 fp8 scales, and use_ue8m0 with it) is not what moe-sbo's fp8 wire sends: its "
            "scales are amax / 448 in float32 (quant/fp8.py); pass round_scale=False, use_ue8m0=False"
        )
    if dispatch_wait_recv_cost_stats is not None:
        raise ValueError(
            "dispatch_wait_recv_cost_stats (DeepEP's per-peer receive wait times) is not measured by moe_sbo.deep_ep; "
            "pass None (moe-sbo's timings: moe_sbo.profiling and the benchmarks)"
        )
    stats = cumulative_local_expert_recv_stats
    if stats is not None and (tuple(stats.shape) != (num_experts // num_ranks,) or stats.dtype != torch.int32):
        raise ValueError(
            f"cumulative_local_expert_recv_stats must be int32 [num_local_experts] = [{num_experts // num_ranks}], got "
            f"{stats.dtype} {tuple(stats.shape)}"
        )


def launch_dispatch(
    handle: LowLatencyHandle, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, ones_X1: torch.Tensor | None
) -> Pending:
    """The dispatch in flight: with the dispatch's weights, or (``ones_X1``, float32 [X, 1] of ones)
    with weight 1 for every choice, each token once per rank (``restamp``) or every (token, choice)
    as a token of its own.

    Sync: ``dispatch_launch`` of the ``low_latency`` dispatcher: no host read."""
    d = handle.dispatcher
    if ones_X1 is None:
        assert handle.topk_weights is not None, "a dispatch is weighted, restamped or per choice"
        return d.dispatch_launch(x_TH, topk_idx_TK, handle.topk_weights)
    num_tokens, top_k = topk_idx_TK.shape
    if handle.restamp:
        return d.dispatch_launch(x_TH, topk_idx_TK, ones_X1.view(num_tokens, top_k))
    # Each row K times over: an expand copied once (a plain copy kernel; repeat_interleave gathers).
    x_XH = x_TH[:, None].expand(num_tokens, top_k, x_TH.shape[1]).reshape(num_tokens * top_k, -1)
    return d.dispatch_launch(x_XH, topk_idx_TK.reshape(-1, 1), ones_X1)


@dataclass
class PackReplays:
    """``pack_rows`` replayed from a CUDA graph where it reads and writes the same tensors as before:
    an eager dispatch through the dispatcher's index graphs hands out the same buffers every time a
    set comes round, and the receive tensors are this Buffer's own, so one graph per combination
    replaces a Triton launch (tens of microseconds of host) by a replay. A combination is captured
    the second time it is seen (a first sighting may be a one-off tensor); at most
    ``MAX_PACK_GRAPHS`` graphs and ``MAX_PACK_GRAPHS * 16`` sightings are kept."""

    graphs: dict[tuple, torch.cuda.CUDAGraph] = field(default_factory=dict)
    seen: set[tuple] = field(default_factory=set)

    def run(
        self,
        output: Any,
        rows_per_expert: int,
        x_NH: torch.Tensor,
        scales_NQ: torch.Tensor | None,
        count_L: torch.Tensor,
        ok_1: torch.Tensor,
    ) -> PackedRows:
        fixed = getattr(output.handle, "fixed", None)
        if x_NH.device.type != "cuda" or capturing(x_NH.device) or not hasattr(fixed, "pair_row_SK"):
            return pack_rows(output, rows_per_expert, x_NH, scales_NQ, count_L, ok_1)
        # The tensors themselves (their ids): a graph keeps those it captured alive, so an id in a
        # cached key cannot be another tensor's; eager rounds of the index graphs hand out the same
        # tensors each time their set comes round.
        key = (
            rows_per_expert,
            id(output.expert_x_RH),
            id(output.expert_rows_R),
            id(output.expert_scales_RQ),
            id(output.num_rows_per_expert_L),
            id(fixed.pair_row_SK),  # type: ignore[union-attr]
            id(fixed.num_real_1),  # type: ignore[union-attr]
            id(x_NH),
            id(scales_NQ),
            id(count_L),
            id(ok_1),
        )
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen or len(self.graphs) >= MAX_PACK_GRAPHS:
                if len(self.seen) >= MAX_PACK_GRAPHS * 16:  # one-off tensors (launched kernels' outputs)
                    self.seen.clear()
                self.seen.add(key)
                return pack_rows(output, rows_per_expert, x_NH, scales_NQ, count_L, ok_1)
            # No warm-up run: the kernel rewrites the layout in place, so it must run once per round.
            graph, _ = capture_graph(lambda: pack_rows(output, rows_per_expert, x_NH, scales_NQ, count_L, ok_1), 0)
            self.graphs[key] = graph
        graph.replay()
        return PackedRows(output, rows_per_expert)


def receive(
    handle: LowLatencyHandle,
    pending: Pending,
    x_storage: torch.Tensor,
    scales_storage: torch.Tensor | None,
    count_L: torch.Tensor,
    stats_L: torch.Tensor | None,
    replays: PackReplays,
    ok_1: torch.Tensor,
) -> None:
    """Finish the dispatch and lay its rows out as DeepEP's: into ``x_storage`` [L * N + 1, H]
    (DeepEP's packed [L, N, H] and one scratch row; ``scales_storage`` likewise with Q columns),
    ``count_L`` int32; ``stats_L`` (int32) grows by the counts.

    Sync: ``dispatch_wait`` (the current stream waits for the transfer; CPU: the host), then device
    operations only; CUDA-graph safe."""
    d = handle.dispatcher
    out = d.dispatch_wait(pending)
    rows_per_expert = d.ep.size * handle.num_max_dispatch_tokens_per_rank
    handle.packed = replays.run(out, rows_per_expert, x_storage, scales_storage, count_L, ok_1)
    if stats_L is not None:
        stats_L.add_(count_L)
    handle.pending = None


def check_combine_args(
    x_LSH: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    handle: LowLatencyHandle,
    use_logfmt: bool,
    out: torch.Tensor | None,
    combine_wait_recv_cost_stats: torch.Tensor | None,
) -> None:
    """Refuse, before any collective, a combine this mode cannot honour."""
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle must be the one low_latency_dispatch returned, got {type(handle).__name__}")
    if handle.packed is None:
        raise ValueError("the dispatch of this handle has not been received yet: call its receiving hook first")
    local = handle.dispatcher.num_local_experts
    expected = (local, handle.dispatcher.ep.size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
    if tuple(x_LSH.shape) != expected:
        raise ValueError(
            f"x must be [num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden] = {list(expected)}, "
            f"got {tuple(x_LSH.shape)}"
        )
    shape = (handle.num_tokens, handle.num_topk)
    if tuple(topk_idx_TK.shape) != shape or tuple(topk_weights_TK.shape) != shape:
        raise ValueError(
            f"topk_idx and topk_weights must be the dispatch's {list(shape)}, got {tuple(topk_idx_TK.shape)} and "
            f"{tuple(topk_weights_TK.shape)}"
        )
    if handle.topk_weights is not None and (
        topk_weights_TK is not handle.topk_weights or topk_weights_TK._version != handle.weights_version
    ):
        raise ValueError(
            "this dispatch was given topk_weights, which the experts' ranks applied: combine must get that same "
            "tensor, unchanged; or dispatch without topk_weights to weight at combine"
        )
    if use_logfmt:
        raise ValueError(
            "use_logfmt (DeepEP's 10-bit LogFMT combine wire) is not sent by moe-sbo: its combine moves the "
            "activation dtype; pass use_logfmt=False"
        )
    if combine_wait_recv_cost_stats is not None:
        raise ValueError("combine_wait_recv_cost_stats is not measured by moe_sbo.deep_ep; pass None")
    shape_ok = out is None or (tuple(out.shape) == (handle.num_tokens, handle.hidden) and out.dtype == x_LSH.dtype)
    if out is not None and not (shape_ok and out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous {x_LSH.dtype} [num_tokens, hidden] = [{handle.num_tokens}, {handle.hidden}], "
            f"got {out.dtype} {tuple(out.shape)}"
        )


def launch_combine(handle: LowLatencyHandle, x_LNH: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending:
    """The experts' outputs in DeepEP's packed layout, read where they lie; the combine in flight
    (``restamp``: combine's weights written into the dispatched rows first).

    Sync: ``combine_launch`` (and ``set_combine_weights``, a barrier with symmetric memory): no host read."""
    assert handle.packed is not None, "checked by check_combine_args"
    if handle.restamp:
        weights = topk_weights_TK.float()
        handle.dispatcher.set_combine_weights(handle.packed.output.handle, weights)  # type: ignore[attr-defined]
    rows, dispatch_handle = combine_input(handle.packed, x_LNH.reshape(-1, x_LNH.shape[-1]))
    return handle.dispatcher.combine_launch(rows, dispatch_handle)


def finish_combine(
    handle: LowLatencyHandle,
    pending: Pending,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    out_TH: torch.Tensor,
) -> None:
    """Into ``out_TH``: per choice, each token's K returned rows weighted by ``topk_weights`` (choices
    of id -1 add nothing) and summed in float32; with the dispatch's weights, the returned sums.

    Sync: ``combine_wait`` (the current stream waits; CPU: the host), then one device operation."""
    if handle.choice_index_TK is None:
        handle.dispatcher.combine_wait(pending, out=out_TH)
        return
    rows = handle.dispatcher.combine_wait(pending)
    # Choice k of token t came back as row t * K + k; X (past every row) adds nothing for an id of -1.
    index_TK = torch.where(topk_idx_TK < 0, rows.shape[0], handle.choice_index_TK)
    gather_sum(rows, index_TK, topk_weights_TK.reshape(-1).float(), out_dtype=out_TH.dtype, out=out_TH)


def receive_hook(fn: Callable[[], None]) -> Callable[[], None]:
    """A receiving hook that runs ``fn`` once; a second call raises (the round is already received)."""
    done: list[bool] = []

    def hook() -> None:
        if done:
            raise RuntimeError("this receiving hook already ran; each dispatch or combine is received once")
        done.append(True)
        fn()

    return hook

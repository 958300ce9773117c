"""DeepEP's low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``) over moe-sbo's
``low_latency`` dispatcher, through its public phases (``dispatch_launch`` / ``dispatch_wait`` /
``combine_launch`` / ``combine_wait``).

Legend: see ``moe_sbo/__init__.py``; here C is DeepEP's ``num_max_dispatch_tokens_per_rank`` and
X = T * K the (token, choice) pairs of this rank, each sent as a token of its own.

::

    dispatch  x [T, H] -> one row per (token, choice) [X, H] with that one expert id, weight 1
              low_latency dispatcher (capacity C * K, fp8 on the wire with use_fp8)
              rows grouped by local expert [R, H] -> DeepEP's packed [L, P * C, H], counts [L],
              layout ranges [L, P] (begin << 32 | count of the rows from each source rank)
    combine   DeepEP's [L, P * C, H] back to the dispatcher's [R, H]; its combine returns each
              (token, choice) row unweighted [X, H]; the token's rank weights them with the
              ``topk_weights`` given to combine and sums them in float32 -> [T, H]

The hard part is the weights. DeepEP's low-latency combine takes the weights only at combine, on the
token's rank, while moe-sbo's dispatcher weights each expert row on the expert's rank with the
weights it was dispatched with. Sending every (token, choice) as a token of its own with weight 1
keeps DeepEP's meaning exactly (the weights given to combine are the ones applied) and needs no
extra exchange, at the price of one row per choice instead of one per destination rank: DeepEP's
own low-latency kernels send one per choice as well. Every step is a fixed-shape device operation,
so the whole path can be captured in a CUDA graph (after one eager call allocates the buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dispatch import Dispatcher, DispatchOutput, Pending
from ..quant.fp8 import FP8_GROUP
from .layout import check_topk_idx


@dataclass
class LowLatencyHandle:
    """What ``low_latency_dispatch`` returns as ``handle``; filled when the receive completes (at once,
    or when the receiving hook runs), so it is not frozen.

    DeepEP-visible: ``layout_range`` int64 [L, P] (``handle[1]``), ``num_max_dispatch_tokens_per_rank``,
    ``hidden``, ``num_experts`` (``handle[2..4]``). ``handle[0]``, DeepEP's per-row source token
    index, is not known on this side (moe-sbo's receiver sees each row's source rank and slot, never
    the token index) and raises ``ValueError``.

    Internal: ``dtype`` of the dispatched x, the ``dispatcher``, its ``output`` (the receive's
    ``DispatchOutput``), ``slot_R`` int64 [R] (where expert row r lies in the packed layout, flattened;
    the padding rows point at row 0), ``num_topk``, ``num_tokens``, ``buffer_index`` (which of the two
    zero-copy combine buffers is this round's).
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    dtype: torch.dtype  # of the dispatched x (and of combine's rows)
    num_topk: int
    num_tokens: int
    buffer_index: int
    dispatcher: Dispatcher
    layout_range: torch.Tensor
    output: DispatchOutput | None = None
    slot_R: torch.Tensor | None = None
    pending: Pending | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> Any:
        position = index + 5 if isinstance(index, int) and index < 0 else index
        if position == 0:
            raise ValueError(
                "handle[0], DeepEP's per-row source token index (src_info), is not kept by moe_sbo.deep_ep: "
                "moe-sbo's receiver knows each row's source rank (handle[1], the layout ranges), not its token"
            )
        fields = (None, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
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
) -> None:
    """Refuse, before any collective, what this mode cannot honour or DeepEP would not accept."""
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got {getattr(x_TH, 'shape', type(x_TH).__name__)}")
    check_topk_idx(topk_idx_TK)
    if topk_idx_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"topk_idx must have x's {x_TH.shape[0]} rows, got {tuple(topk_idx_TK.shape)}")
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


def launch_dispatch(dispatcher: Dispatcher, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> Pending:
    """Every (token, choice) as a token of its own, weight 1 -> the dispatch in flight.

    Sync: ``dispatch_launch`` of the ``low_latency`` dispatcher: no host read."""
    num_tokens, top_k = topk_idx_TK.shape
    x_XH = x_TH.repeat_interleave(top_k, dim=0) if top_k != 1 else x_TH
    ids_X1 = topk_idx_TK.reshape(num_tokens * top_k, 1)
    weights_X1 = torch.ones(num_tokens * top_k, 1, dtype=torch.float32, device=x_TH.device)
    return dispatcher.dispatch_launch(x_XH, ids_X1, weights_X1)


def receive(
    handle: LowLatencyHandle,
    pending: Pending,
    x_storage: torch.Tensor,
    scales_storage: torch.Tensor | None,
    count_L: torch.Tensor,
    stats_L: torch.Tensor | None,
) -> None:
    """Finish the dispatch and lay its rows out as DeepEP's: into ``x_storage`` [L * P * C + 1, H]
    (DeepEP's packed [L, P * C, H] and one row more; ``scales_storage`` likewise with Q columns),
    ``count_L`` int32, ``handle.layout_range`` int64 [L, P]; ``stats_L`` (int32) grows by the counts.

    Sync: ``dispatch_wait`` (the current stream waits for the transfer; CPU: the host), then device
    operations only; CUDA-graph safe."""
    d = handle.dispatcher
    out = d.dispatch_wait(pending)
    num_local, num_ranks = d.num_local_experts, d.ep.size
    rows_per_expert = num_ranks * handle.num_max_dispatch_tokens_per_rank
    slots_per_rank = handle.num_max_dispatch_tokens_per_rank * handle.num_topk  # the dispatcher's capacity
    num_slots = num_ranks * slots_per_rank
    counts_L = out.num_rows_per_expert_L
    device = counts_L.device
    slot_R = out.handle.layout.row_R  # each expert row's receive slot (S: padding)
    num_rows = slot_R.shape[0]
    # The rows are grouped by expert, real ones first: row r belongs to the expert whose cumulative
    # count first exceeds r (L: padding).
    ends_L = counts_L.cumsum(0)
    expert_R = torch.searchsorted(ends_L, torch.arange(num_rows, device=device), right=True)
    is_real_R = expert_R < num_local
    # Inside an expert, rows in slot order, so each source rank's rows are contiguous (slot // (C * K)
    # is the source): a row's position is how many of its expert's rows have a smaller slot.
    seen_LS = torch.zeros(num_local + 1, num_slots + 1, dtype=torch.int32, device=device)
    # index_fill_ on the flat view: a Python scalar, no host tensor to copy (CUDA-graph capture refuses one).
    flat_R = expert_R * (num_slots + 1) + torch.where(is_real_R, slot_R, num_slots)
    seen_LS.view(-1).index_fill_(0, flat_R, 1)
    per_source_LP = seen_LS[:num_local, :num_slots].view(num_local, num_ranks, slots_per_rank).sum(dim=2)
    position_R = seen_LS.cumsum(dim=1)[expert_R, slot_R.clamp(max=num_slots)].long() - 1
    if device.type == "cpu":
        if bool((position_R[is_real_R] >= rows_per_expert).any()):
            raise ValueError(
                f"an expert received more than num_max_dispatch_tokens_per_rank * num_ranks = {rows_per_expert} "
                "rows: a token chose one expert twice in topk_idx"
            )
    else:
        torch._assert_async((~is_real_R | (position_R < rows_per_expert)).all(), "a token chose one expert twice")
    dump = num_local * rows_per_expert  # the storage's extra last row: padding rows land there, unread
    dest_R = torch.where(is_real_R, expert_R.clamp(max=num_local - 1) * rows_per_expert + position_R, dump)
    rows_RH = out.rows_RH().to(x_storage.dtype)
    if x_storage.dtype.itemsize == 1:  # fp8 rows move as bytes (index_copy_ has no fp8 kernel on every device)
        x_storage.view(torch.uint8).index_copy_(0, dest_R, rows_RH.contiguous().view(torch.uint8))
    else:
        x_storage.index_copy_(0, dest_R, rows_RH)
    if scales_storage is not None:
        assert out.expert_scales_RQ is not None, "an fp8 low_latency dispatcher with deliver_fp8 hands out scales"
        scales_storage.index_copy_(0, dest_R, out.expert_scales_RQ.float())
    count_L.copy_(counts_L)
    begin_LP = per_source_LP.cumsum(dim=1) - per_source_LP
    handle.layout_range.copy_((begin_LP.long() << 32) | per_source_LP.long())
    if stats_L is not None:
        stats_L.add_(counts_L.to(stats_L.dtype))
    handle.output = out
    handle.slot_R = torch.where(is_real_R, dest_R, 0)
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
    if handle.output is None:
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
    if use_logfmt:
        raise ValueError(
            "use_logfmt (DeepEP's 10-bit LogFMT combine wire) is not sent by moe-sbo: its combine moves the "
            "activation dtype; pass use_logfmt=False"
        )
    if combine_wait_recv_cost_stats is not None:
        raise ValueError("combine_wait_recv_cost_stats is not measured by moe_sbo.deep_ep; pass None")
    if out is not None and (tuple(out.shape) != (handle.num_tokens, handle.hidden) or out.dtype != x_LSH.dtype):
        raise ValueError(
            f"out must be {x_LSH.dtype} [num_tokens, hidden] = [{handle.num_tokens}, {handle.hidden}], got "
            f"{out.dtype} {tuple(out.shape)}"
        )


def launch_combine(handle: LowLatencyHandle, x_LSH: torch.Tensor) -> Pending:
    """DeepEP's per-expert rows back into the dispatcher's expert rows; its combine in flight.

    Sync: ``combine_launch``: no host read."""
    assert handle.slot_R is not None and handle.output is not None, "checked by check_combine_args"
    rows_RH = x_LSH.reshape(-1, x_LSH.shape[-1]).index_select(0, handle.slot_R)
    return handle.dispatcher.combine_launch(rows_RH, handle.output.handle)


def finish_combine(
    handle: LowLatencyHandle,
    pending: Pending,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    out_TH: torch.Tensor,
) -> None:
    """Each token's K returned rows weighted by ``topk_weights`` (0 where ``topk_idx`` is -1) and
    summed in float32, into ``out_TH``.

    Sync: ``combine_wait`` (the current stream waits; CPU: the host), then device operations."""
    rows_XH = handle.dispatcher.combine_wait(pending)
    weights_TK = topk_weights_TK.float().masked_fill(topk_idx_TK < 0, 0.0)
    rows_TKH = rows_XH.view(handle.num_tokens, handle.num_topk, handle.hidden).float()
    out_TH.copy_(torch.einsum("tkh,tk->th", rows_TKH, weights_TK))


def receive_hook(fn: Callable[[], None]) -> Callable[[], None]:
    """A receiving hook that runs ``fn`` once; a second call raises (the round is already received)."""
    done: list[bool] = []

    def hook() -> None:
        if done:
            raise RuntimeError("this receiving hook already ran; each dispatch or combine is received once")
        done.append(True)
        fn()

    return hook

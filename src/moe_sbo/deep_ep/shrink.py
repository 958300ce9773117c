"""DeepEP's shrink mode (``Buffer(enable_shrink=True)``; DeepEP first called it elastic): a rank that
stops taking part in the low-latency calls is masked, and the others go on without it.

::

    a low-latency call (dispatch, combine, clean) fails on a rank that stopped (wait bound, or a
    closed connection)
      -> the ranks still taking part agree on who stopped (``dispatch.membership.agree``, on the
         default group's store); a rank that destroyed its buffer said so there, so no one waits for it
      -> mask them (``low_latency_query_mask_buffer`` reports it), and run the call again over a group of
         the others: experts of masked ranks are dropped from every token (their topk_idx become -1)

The hard part is keeping DeepEP's shapes while the group shrinks. Every call runs the ``low_latency``
dispatcher over the unmasked ranks with their experts only, then writes its results into DeepEP's
layout of the whole group: ``[L, P * C, H]`` rows (each expert's rows come first, so the shrunken
layout's rows fit in front) and ``[L, P]`` layout ranges, zero in the masked ranks' columns. A combine
whose dispatch ran over a larger group (a rank stopped in between) dispatches again over the smaller
one and moves each expert's output rows to their new places, range by range: the rows of every
unmasked source rank are the same rows in the same order.

Transfers complete inside each call here: with ``return_recv_hook`` the hook has nothing left to do.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .. import env
from ..dispatch import Dispatcher, EPGroup
from ..dispatch.membership import agree
from . import low_latency as ll

T = TypeVar("T")
PREFIX = "moe_sbo/deep_ep/shrink"
# Groups of unmasked ranks this process made, by (default group, ranks): made once and shared, since
# PyTorch names a locally synchronised group after its ranks.
_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}
_BUFFERS = [0]  # shrink-mode buffers this process made: each gets its own keys in the store


@dataclass
class ShrinkHandle(ll.LowLatencyHandle):
    """A shrink-mode dispatch's handle: DeepEP's view (``layout_range`` [L, P] of the whole group)
    over ``inner``, the dispatch that ran over the unmasked ranks ``active``; ``x`` and ``topk_idx``
    are kept to dispatch again if a rank stops before the combine."""

    inner: ll.LowLatencyHandle | None = None
    x: torch.Tensor | None = None
    topk_idx: torch.Tensor | None = None
    use_fp8: bool = False
    active: tuple[int, ...] = ()


class RankMask:
    """DeepEP's mask buffer for one ``Buffer``: which ranks of its group are masked, the group of the
    others, and the agreement that masks a rank that stopped.

    ``group``/``ep``: the Buffer's. The store is the default group's (its host must not be the rank
    that stops). ``patience_s``: how long the others wait for a rank that neither takes part nor said
    it left (default ``MOE_SBO_TIMEOUT_S``)."""

    def __init__(self, group: Any, ep: EPGroup, patience_s: float | None = None):
        if not dist.is_initialized():
            raise ValueError("enable_shrink needs an initialised torch.distributed default group (its store)")
        self.group, self.ep = group, ep
        self.global_ranks = tuple(dist.get_process_group_ranks(group))
        self.mask_P = torch.zeros(ep.size, dtype=torch.int32)
        self.patience_s = patience_s if patience_s is not None else env.collective_timeout_s()
        _BUFFERS[0] += 1
        self.base = f"{PREFIX}/{'-'.join(map(str, self.global_ranks))}/{_BUFFERS[0]}"
        self.store = dist.distributed_c10d._get_default_store()
        self.round = 0  # agreements so far: every unmasked rank counts the same
        self.on_change: Callable[[], None] = lambda: None  # the Buffer drops what it built over the old group

    @property
    def active(self) -> tuple[int, ...]:
        """The unmasked ranks (of the Buffer's group), ascending."""
        return tuple(r for r in range(self.ep.size) if not int(self.mask_P[r]))

    def active_ep(self) -> EPGroup:
        """The EP group of the unmasked ranks (the Buffer's own when none is masked)."""
        active = self.active
        if len(active) == self.ep.size:
            return self.ep
        ranks = tuple(self.global_ranks[r] for r in active)
        key = (id(dist.distributed_c10d._get_default_group()), ranks)
        if key not in _GROUPS:
            timeout = datetime.timedelta(seconds=env.collective_timeout_s())
            _GROUPS[key] = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)
        return EPGroup(_GROUPS[key], active.index(self.ep.rank), len(active))

    def remap(self, topk_idx_TK: torch.Tensor, num_local: int) -> torch.Tensor:
        """DeepEP's expert ids -> ids over the unmasked ranks' experts; -1 for a masked rank's."""
        position = torch.full((self.ep.size,), -1, dtype=torch.int64)
        for index, rank in enumerate(self.active):
            position[rank] = index
        position = position.to(topk_idx_TK.device)
        valid = topk_idx_TK >= 0
        owner = torch.where(valid, topk_idx_TK, 0) // num_local
        new_owner = position[owner]
        ids = new_owner * num_local + topk_idx_TK % num_local
        return torch.where(valid & (new_owner >= 0), ids, -1).to(topk_idx_TK.dtype)

    def drop_masked(self, topk_idx_TK: torch.Tensor, num_local: int) -> torch.Tensor:
        """``topk_idx`` with the masked ranks' experts set to -1 (DeepEP's ids kept otherwise)."""
        masked = self.mask_P.to(topk_idx_TK.device).bool()
        owner = torch.where(topk_idx_TK >= 0, topk_idx_TK, 0) // num_local
        return torch.where((topk_idx_TK >= 0) & ~masked[owner], topk_idx_TK, -1)

    def run(self, attempt: Callable[[], T]) -> T:
        """``attempt()``; when it fails on a rank that stopped, mask the ranks the others agree on and
        run it again over the rest."""
        while True:
            try:
                return attempt()
            except RuntimeError as err:
                if not _stopped_peer(err):
                    raise
                self._agree()

    def _agree(self) -> None:
        self.round += 1
        active = self.active
        decision = agree(
            self.store,
            f"{self.base}/round{self.round}",
            self.ep.rank,
            active,
            None,
            gone=lambda rank: self.store.check([f"{self.base}/left/{rank}"]),
            patience_s=self.patience_s,
        )
        if self.ep.rank not in decision["members"]:
            raise RuntimeError(
                f"rank {self.ep.rank} was masked by the others (they went on as {decision['members']}); "
                "this buffer must not be used again"
            )
        for rank in active:
            if rank not in decision["members"]:
                self.mask_P[rank] = 1
        self.on_change()

    def leave(self) -> None:
        """This rank's buffer is destroyed: the others mask it without waiting for it."""
        self.store.set(f"{self.base}/left/{self.ep.rank}", "1")

    def update(self, rank: int, mask: bool) -> None:
        if not 0 <= rank < self.ep.size:
            raise ValueError(f"rank_to_mask must be a rank of the buffer's group [0, {self.ep.size}), got {rank}")
        self.mask_P[rank] = int(mask)
        self.on_change()

    def query(self, mask_status: torch.Tensor) -> None:
        if mask_status.dtype != torch.int32 or tuple(mask_status.shape) != (self.ep.size,):
            raise ValueError(
                f"mask_status must be int32 [num_ranks] = [{self.ep.size}], got {mask_status.dtype} "
                f"{tuple(mask_status.shape)}"
            )
        mask_status.copy_(self.mask_P)

    def clean(self) -> None:
        self.mask_P.zero_()
        self.on_change()


def _stopped_peer(err: BaseException) -> bool:
    text = str(err).lower()
    return any(word in text for word in ("timed out", "timeout", "connection", "closed", "reset", "peer"))


# The Buffer's low-latency dispatcher for (experts, C, K, fp8, per choice) over an EP group, made once and kept.
DispatcherFor = Callable[[int, int, int, bool, bool, EPGroup], Dispatcher]


def dispatch(
    dispatcher_for: DispatcherFor,
    mask: RankMask,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool,
    stats_L: torch.Tensor | None,
    buffer_index: int,
) -> tuple[Any, torch.Tensor, ShrinkHandle]:
    """``Buffer.low_latency_dispatch`` in shrink mode: (recv_x, recv_count, handle) in DeepEP's shapes
    for the whole group, the dispatch run over the unmasked ranks. The receive tensors are new each call."""
    size, capacity = mask.ep.size, num_max_dispatch_tokens_per_rank
    num_local, hidden = num_experts // size, x.shape[1]
    handle = ShrinkHandle(
        num_max_dispatch_tokens_per_rank=capacity,
        hidden=hidden,
        num_experts=num_experts,
        dtype=x.dtype,
        num_topk=topk_idx.shape[1],
        num_tokens=x.shape[0],
        buffer_index=buffer_index,
        dispatcher=None,  # type: ignore[arg-type]  # the inner handle's
        device=x.device,
        _layout_range=torch.zeros(num_local, size, dtype=torch.int64, device=x.device),
        x=x,
        topk_idx=topk_idx,
        use_fp8=use_fp8,
    )
    x_dtype = torch.float8_e4m3fn if use_fp8 else x.dtype
    packed_x = torch.zeros(num_local, size * capacity, hidden, dtype=x_dtype, device=x.device)
    scales = torch.zeros(num_local, size * capacity, hidden // 128, device=x.device) if use_fp8 else None
    count_L = torch.empty(num_local, dtype=torch.int32, device=x.device)

    def attempt() -> None:
        inner_x, inner_scales = _dispatch_active(dispatcher_for, mask, handle, count_L, stats_L)
        inner = handle.inner
        assert inner is not None, "set by _dispatch_active"
        rows = len(handle.active) * capacity  # the shrunken layout's rows come first in each expert's
        packed_x[:, :rows] = inner_x[:-1].view(num_local, rows, hidden)
        if scales is not None and inner_scales is not None:
            scales[:, :rows] = inner_scales[:-1].view(num_local, rows, hidden // 128)
        handle.layout_range.zero_()
        handle.layout_range[:, list(handle.active)] = inner.layout_range

    mask.run(attempt)
    return (packed_x if scales is None else (packed_x, scales)), count_L, handle


def _dispatch_active(
    dispatcher_for: DispatcherFor,
    mask: RankMask,
    handle: ShrinkHandle,
    count_L: torch.Tensor,
    stats_L: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch ``handle.x`` over the unmasked ranks, setting ``handle.inner`` and ``handle.active``;
    returns the receive tensors of that dispatch (x [L * P' * C + 1, H], fp8 scales or None)."""
    assert handle.x is not None and handle.topk_idx is not None, "a shrink handle keeps its dispatch inputs"
    ep, active = mask.active_ep(), mask.active
    num_local = handle.num_experts // mask.ep.size
    capacity, hidden, device = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.x.device
    num_active_experts = len(active) * num_local
    num_tokens, top_k = handle.num_tokens, handle.num_topk
    dispatcher = dispatcher_for(num_active_experts, capacity, top_k, handle.use_fp8, True, ep)
    inner = ll.LowLatencyHandle(
        num_max_dispatch_tokens_per_rank=capacity,
        hidden=hidden,
        num_experts=num_active_experts,
        dtype=handle.dtype,
        num_topk=top_k,
        num_tokens=num_tokens,
        buffer_index=0,
        dispatcher=dispatcher,
        device=device,
        choice_index_TK=torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k),
    )
    rows = num_active_experts * capacity + 1
    x_storage = torch.zeros(rows, hidden, dtype=torch.float8_e4m3fn if handle.use_fp8 else handle.dtype, device=device)
    scales_storage = torch.zeros(rows, hidden // 128, device=device) if handle.use_fp8 else None
    ones_X1 = torch.ones(num_tokens * top_k, 1, dtype=torch.float32, device=device)
    ok_1 = torch.ones(1, dtype=torch.int32, device=device)
    with torch.no_grad():
        pending = ll.launch_dispatch(inner, handle.x, mask.remap(handle.topk_idx, num_local), ones_X1)
        ll.receive(inner, pending, x_storage, scales_storage, count_L, None, ll.PackReplays(), ok_1)
    if stats_L is not None:
        stats_L.add_(count_L.to(stats_L.dtype))
    handle.inner, handle.active = inner, active
    return x_storage, scales_storage


def combine(
    dispatcher_for: DispatcherFor,
    mask: RankMask,
    x_LSH: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: ShrinkHandle,
    out: torch.Tensor,
) -> None:
    """``Buffer.low_latency_combine`` in shrink mode, into ``out`` [T, H]: the masked ranks' experts
    add nothing. If a rank was masked since the dispatch, dispatch again over the others first."""
    size = mask.ep.size
    num_local = handle.num_experts // size
    expected = (num_local, size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
    if tuple(x_LSH.shape) != expected:
        raise ValueError(
            f"x must be [num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden] = "
            f"{list(expected)}, got {tuple(x_LSH.shape)}"
        )

    def attempt() -> None:
        rows_LSH = x_LSH
        if handle.active != mask.active:  # a rank stopped after the dispatch: dispatch again
            before_LP = handle.layout_range.clone()
            counts = torch.empty(num_local, dtype=torch.int32, device=x_LSH.device)
            _dispatch_active(dispatcher_for, mask, handle, counts, None)
            rows_LSH = _move_rows(x_LSH, before_LP, handle)
        inner = handle.inner
        assert inner is not None, "set by the dispatch"
        rows = len(handle.active) * handle.num_max_dispatch_tokens_per_rank
        with torch.no_grad():
            pending = ll.launch_combine(inner, rows_LSH[:, :rows].contiguous(), topk_weights)
            ll.finish_combine(inner, pending, mask.drop_masked(topk_idx, num_local), topk_weights, out)

    mask.run(attempt)


def _move_rows(x_LSH: torch.Tensor, before_LP: torch.Tensor, handle: ShrinkHandle) -> torch.Tensor:
    """The expert rows of ``x_LSH`` (laid out as the first dispatch's ranges ``before_LP`` [L, P])
    moved to the new dispatch's ranges: each unmasked source rank's rows are the same, in order."""
    inner = handle.inner
    assert inner is not None, "set by the dispatch"
    moved = torch.zeros_like(x_LSH)
    low = (1 << 32) - 1
    for local in range(x_LSH.shape[0]):
        for index, rank in enumerate(handle.active):
            old, new = int(before_LP[local, rank]), int(inner.layout_range[local, index])
            count = new & low
            assert count == old & low, "an unmasked rank's rows for an expert are the same in both dispatches"
            moved[local, (new >> 32) : (new >> 32) + count] = x_LSH[local, (old >> 32) : (old >> 32) + count]
    return moved


def clean(mask: RankMask) -> None:
    """``clean_low_latency_buffer``'s part in shrink mode: a barrier over the unmasked ranks, so that a
    rank that stopped is masked here too."""

    def attempt() -> None:
        ep = mask.active_ep()
        if ep.size > 1:
            dist.barrier(group=ep.group)

    mask.run(attempt)

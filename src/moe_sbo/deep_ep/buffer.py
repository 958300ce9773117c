"""``Buffer``: DeepEP 1.x's public Python API (method names, arguments, return structures) over
moe-sbo's dispatchers. ``import moe_sbo.deep_ep as deep_ep`` in place of ``import deep_ep``.

::

    get_dispatch_layout                      layout.py (device counts from topk_idx)
    dispatch / combine                       normal.py -> ``alltoall`` (one node) or ``node_aware``
    low_latency_dispatch / _combine          ll_state.py (state), low_latency.py (steps) -> ``low_latency``
    previous_event / async_finish / capture  events.py (moe-sbo's CUDA events; CPU: completed no-ops)

The hard part is honesty about what differs. DeepEP's arguments fall in three kinds here: those that
change a result are honoured (x and fp8 scales, top-k, handles, ``expert_alignment``,
``num_worst_tokens``, bias, ``use_fp8``, ``zero_copy``, ``out``, hooks, events); those that only tune
DeepEP's kernels or NVSHMEM (``Config``, SM counts, QPs, buffer byte counts, NVLink/MNNVL/fabric
switches) are accepted and change nothing; and those that would change a result in a way moe-sbo
does not (power-of-2 fp8 scales, LogFMT, receive-time statistics, an MPI communicator)
raise ``ValueError`` before any collective. docs/DEEP_EP.md maps each method.

Every call queues its work on the caller's current stream; ``async_finish`` then returns an event
recorded at its end, and ``allocate_on_comm_stream`` changes nothing (the tensors are the current
stream's). ``hooks`` is one ``HookRegistry`` shared by every dispatcher this buffer uses, so the six
moe-sbo hook events fire on both modes (their payloads are the dispatcher's: see DEEP_EP.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..dispatch import Dispatcher, EPGroup, make_dispatcher
from ..hooks import HookRegistry
from . import low_latency as ll
from . import normal, shrink
from .config import DEFAULT_NUM_SMS, Config, default_config, low_latency_size_hint
from .events import EventOverlap, capture_event, finish, wait_previous
from .layout import dispatch_layout
from .ll_state import LowLatencyState


class Buffer:
    """The expert-parallel communication object of one process group (DeepEP's ``deep_ep.Buffer``).

    ``group``: the EP process group (gloo CPU ranks, gloo ranks sharing a GPU, or NCCL); its nodes
    (DeepEP's RDMA ranks) are ``MOE_SBO_RANKS_PER_NODE`` (or torchrun's ``LOCAL_WORLD_SIZE``) ranks
    each. ``num_nvl_bytes``, ``num_rdma_bytes``, ``num_qps_per_rank``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric``: accepted and kept, no
    effect (moe-sbo allocates what each shape needs; NCCL or symmetric memory choose the links).
    ``low_latency_mode``: kept; both modes work either way. ``explicitly_destroy``: ``destroy()``
    then frees the buffers. ``enable_shrink`` (``enable_elastic``, DeepEP's earlier name): a rank
    that stops taking part in the low-latency calls is masked and the others go on without it
    (``shrink.py``; ``low_latency_query_mask_buffer`` tells who). ``comm`` (MPI) is refused.
    """

    num_sms: ClassVar[int] = DEFAULT_NUM_SMS  # DeepEP's class-wide SM count; no effect here

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        enable_elastic: bool = False,
    ) -> None:
        if comm is not None:
            raise ValueError("comm (an mpi4py communicator) is not supported; pass a torch.distributed group")
        if group is None:
            raise ValueError(
                "group must be a torch.distributed process group (dist.new_group(...) or dist.group.WORLD)"
            )
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.ep = EPGroup.from_torch(group)
        self.group = group
        self.rank = self.ep.rank
        self.group_size = self.ep.size
        self.num_nodes = self.ep.size // self.ep.node_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.hooks = HookRegistry()
        self._normal: dict[int, Dispatcher] = {}
        self._ll = LowLatencyState(self.ep, self.hooks)
        self._destroyed = False
        self._mask: shrink.RankMask | None = None
        if enable_shrink or enable_elastic:
            self._mask = shrink.RankMask(group, self.ep)
            self._mask.on_change = self._ll.dispatchers.clear  # dispatchers over the old group go

    # ---- life and static helpers ----------------------------------------------------------------

    def destroy(self) -> None:
        """Free the dispatchers and buffers (DeepEP: only with ``explicitly_destroy=True``)."""
        if not self.explicitly_destroy:
            raise ValueError("destroy() needs Buffer(..., explicitly_destroy=True), as in DeepEP")
        if self._mask is not None:
            self._mask.leave()
        self._normal.clear()
        self._ll = LowLatencyState(self.ep, self.hooks)
        self._destroyed = True

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the FP8 paths are available: always (fp8 rows move as bytes; no kernel build)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set ``Buffer.num_sms`` (even, as DeepEP asks); it changes nothing here."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"the SM count must be an even int >= 2, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream now (``previous_event`` of a later call); CPU: a no-op one."""
        return capture_event()

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """``config.low_latency_size_hint``: the bytes of the low-latency layout tensors kept per shape."""
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A ``Config`` for ``num_ranks`` (the same for all: it tunes nothing here)."""
        return default_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A ``Config`` for ``num_ranks`` (the same for all: it tunes nothing here)."""
        return default_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream this buffer's work runs on: the caller's current one (CUDA), None on CPU."""
        return torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def get_local_buffer_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Refused: there is no raw registered buffer to view (moe-sbo allocates per shape)."""
        raise ValueError("get_local_buffer_tensor: moe_sbo.deep_ep keeps no raw NVLink/RDMA buffer to view")

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed; make a new one")

    # ---- normal mode ----------------------------------------------------------------------------

    def _normal_dispatcher(self, num_experts: int) -> Dispatcher:
        if num_experts not in self._normal:
            if self.num_nodes > 1:
                d = make_dispatcher("node_aware", num_experts, self.ep, ranks_per_node=self.ep.node_size)
            else:
                d = make_dispatcher("alltoall", num_experts, self.ep)
            d.hooks = self.hooks
            self._normal[num_experts] = d
        return self._normal[num_experts]

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """(num_tokens_per_rank int32 [P], num_tokens_per_rdma_rank int32 [nodes] or None on one node,
        num_tokens_per_expert int32 [E], is_token_in_rank bool [T, P], event) for ``topk_idx``
        (int64 [T, K], -1: no expert).

        Sync: device work on the current stream after ``previous_event``; no host read; the event is
        recorded at its end when ``async_finish``."""
        self._check_alive()
        wait_previous(previous_event)
        lay = dispatch_layout(topk_idx, num_experts, self.ep.size, self.ep.node_size)
        event = finish(topk_idx.device, async_finish, (topk_idx,))
        return (
            lay.num_tokens_per_rank_P,
            lay.num_tokens_per_node_N,
            lay.num_tokens_per_expert_E,
            lay.is_token_in_rank_TP,
            event,
        )

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: normal.NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[
        Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, normal.NormalHandle | None, EventOverlap
    ]:
        """Send each token to the ranks ``is_token_in_rank`` names (``get_dispatch_layout``'s).

        ``x``: [T, H] (any float dtype; bf16 in DeepEP), or (fp8 e4m3 [T, H], float32 scales [T, H/128]).
        With ``topk_idx`` (int64 [T, K]) and ``topk_weights`` (float32 [T, K]): their rows come too, ids
        made local ([0, L), -1 for other ranks' experts, weight 0 there); ``num_tokens_per_expert``
        (int [E]) is then required. ``handle``: a previous dispatch's, to send new ``x`` the same way
        (no top-k). ``expert_alignment`` rounds up the per-expert counts; ``num_worst_tokens`` pads
        the outputs to that many rows (ids -1) and returns an empty list. ``num_tokens_per_rank`` /
        ``num_tokens_per_rdma_rank`` are read from ``is_token_in_rank`` instead; ``config`` has no effect.

        Returns (recv_x [M, H] or its fp8 pair, recv_topk_idx [M, K], recv_topk_weights [M, K], the
        rows per local expert (a list), handle, event); rows in source-rank then token order. A cached
        dispatch returns (recv_x, None, None, None, None, event).

        Sync: the host blocks on small count exchanges and one read of the received row count (as
        DeepEP's normal mode without ``num_worst_tokens``); not CUDA-graph safe. The transfer runs on
        NCCL's stream (CPU: gloo, inline); the current stream waits for it before this returns."""
        self._check_alive()
        _check_config(config)
        wait_previous(previous_event)
        recv_x, recv_idx, recv_weights, per_expert, new_handle = normal.dispatch(
            self.ep,
            self._normal_dispatcher,
            self.num_nodes,
            x,
            handle,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
        )
        device = (x[0] if isinstance(x, tuple) else x).device
        return recv_x, recv_idx, recv_weights, per_expert, new_handle, finish(device, async_finish, (recv_x,))

    def combine(
        self,
        x: torch.Tensor,
        handle: normal.NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Sum each token's rows back from the ranks it went to (no weights): ``x`` [M, H] in the
        order dispatch returned. ``topk_weights`` [M, K] float32 are summed the same way; ``bias``: one
        or two [T, H] tensors added to the sum (in float32, one rounding). ``config`` has no effect.

        Returns (combined_x [T, H] in x's dtype, combined_topk_weights [T, K] or None, event).

        Sync: the scheme's transfer on NCCL's stream (CPU: gloo, inline); the current stream waits
        for it before this returns; not CUDA-graph safe."""
        self._check_alive()
        _check_config(config)
        wait_previous(previous_event)
        combined, weights = normal.combine(x, handle, topk_weights, bias)
        return combined, weights, finish(x.device, async_finish, (combined,))

    # ---- low-latency mode -----------------------------------------------------------------------

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP zeroes the parts of its buffer its kernels count on; moe-sbo's low-latency buffers
        hold no state a normal-mode call could disturb. This zeroes the zero-copy combine buffers of
        that shape (what a caller could have left there) and checks the arguments."""
        low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.ep.size, num_experts)
        if self._mask is not None:
            shrink.clean(self._mask)  # shrink mode: a rank that stopped is masked here too
        self._ll.zero_combine_buffers(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        topk_weights: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor, ll.LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """Send each token to the experts ``topk_idx`` (int64 [T, K], -1: none) names, T <= C =
        ``num_max_dispatch_tokens_per_rank`` (the same on every rank).

        Returns (recv_x, recv_count int32 [L], handle, event, hook). recv_x: [L, P * C, H] in x's dtype,
        or with ``use_fp8`` (e4m3 [L, P * C, H], float32 scales [L, P * C, H / 128], row-major); only
        the first ``recv_count[l]`` rows of expert l are real, grouped by source rank (the handle's
        ranges). The tensors are reused two calls later (two buffers, as DeepEP's).
        ``cumulative_local_expert_recv_stats`` (int32 [L]) grows by the counts. ``round_scale`` /
        ``use_ue8m0`` with fp8, and ``dispatch_wait_recv_cost_stats``, raise ``ValueError``.

        ``topk_weights`` (float32 [T, K]; a moe-sbo keyword, not DeepEP's): the weights combine will
        be given, known now. Each token then travels once per destination rank (not once per choice)
        and its rows are weighted on the experts' ranks, moe-sbo's own combine; the same tensor,
        unchanged, must then be passed to ``low_latency_combine``.

        Sync: no host read. Without ``return_recv_hook`` the current stream waits for the transfer
        before this returns; with it, the transfer is in flight and ``hook()`` receives (the outputs
        are valid after it). CUDA-graph safe after one eager call with the shape (which allocates)."""
        self._check_alive()
        ll.check_dispatch_args(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            self.ep.size,
            use_fp8,
            round_scale,
            use_ue8m0,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            topk_weights,
        )
        if self._mask is not None:
            if topk_weights is not None:
                raise ValueError("topk_weights at dispatch is not taken in shrink mode; pass them to combine only")
            self._ll.rounds += 1
            recv, count, shrunk = shrink.dispatch(
                self._ll.dispatcher,
                self._mask,
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                use_fp8,
                cumulative_local_expert_recv_stats,
                (self._ll.rounds - 1) % 2,
            )
            done = ll.receive_hook(lambda: None) if return_recv_hook else None  # received already
            return recv, count, shrunk, finish(x.device, async_finish, (x, topk_idx, count)), done
        return self._ll.dispatch(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            cumulative_local_expert_recv_stats,
            use_fp8,
            async_finish,
            return_recv_hook,
            topk_weights,
        )

    def get_next_low_latency_combine_buffer(self, handle: ll.LowLatencyHandle) -> torch.Tensor:
        """The [L, P * C, H] tensor ``low_latency_combine(..., zero_copy=True)`` reads for this handle's
        round (one of two per shape, in x's dtype): fill it with the experts' outputs."""
        if not isinstance(handle, ll.LowLatencyHandle):
            raise TypeError(f"handle must be the one low_latency_dispatch returned, got {type(handle).__name__}")
        return self._ll.combine_buffer(handle)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: ll.LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Bring the experts' outputs ``x`` [L, P * C, H] (the dispatch's layout) back and reduce them
        with ``topk_weights`` (float32 [T, K]; 0 where ``topk_idx`` is -1), in float32.

        ``zero_copy``: read the experts' outputs from ``get_next_low_latency_combine_buffer(handle)``
        instead of ``x``. ``out``: [T, H] to write into (returned). ``use_logfmt`` and
        ``combine_wait_recv_cost_stats`` raise ``ValueError``.

        Returns (combined_x [T, H], event, hook). Sync: no host read; with ``return_recv_hook`` the
        transfer is in flight and ``hook()`` finishes it (``combined_x`` is valid after), else the
        current stream waits for it. CUDA-graph safe after one eager call with the shape."""
        self._check_alive()
        if self._mask is not None and isinstance(handle, shrink.ShrinkHandle):
            return self._shrink_combine(
                x,
                topk_idx,
                topk_weights,
                handle,
                use_logfmt,
                zero_copy,
                async_finish,
                return_recv_hook,
                out,
                combine_wait_recv_cost_stats,
            )
        ll.check_combine_args(x, topk_idx, topk_weights, handle, use_logfmt, out, combine_wait_recv_cost_stats)
        rows = self.get_next_low_latency_combine_buffer(handle) if zero_copy else x
        return self._ll.combine(rows, topk_idx, topk_weights, handle, async_finish, return_recv_hook, out)

    def _shrink_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: shrink.ShrinkHandle,
        use_logfmt: bool,
        zero_copy: bool,
        async_finish: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
        combine_wait_recv_cost_stats: torch.Tensor | None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """``low_latency_combine`` in shrink mode (``shrink.combine``): received inside the call."""
        if use_logfmt or combine_wait_recv_cost_stats is not None:
            raise ValueError("use_logfmt and combine_wait_recv_cost_stats are refused (see low_latency_combine)")
        shape = (handle.num_tokens, handle.num_topk)
        if tuple(topk_idx.shape) != shape or tuple(topk_weights.shape) != shape:
            raise ValueError(
                f"topk_idx and topk_weights must be the dispatch's {list(shape)}, got "
                f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}"
            )
        rows = self.get_next_low_latency_combine_buffer(handle) if zero_copy else x
        combined = (
            out if out is not None else torch.empty(handle.num_tokens, handle.hidden, dtype=x.dtype, device=x.device)
        )
        assert self._mask is not None, "shrink mode"
        shrink.combine(self._ll.dispatcher, self._mask, rows, topk_idx, topk_weights, handle, combined)
        done = ll.receive_hook(lambda: None) if return_recv_hook else None
        return combined, finish(x.device, async_finish, (x, topk_idx, topk_weights, combined)), done

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask``: the next low-latency calls leave it out (or
        take it in). Every unmasked rank must make the same change. Needs ``enable_shrink``."""
        self._shrink_mask().update(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write each rank's mask into ``mask_status`` (int32 [num_ranks]; 1: masked). Needs
        ``enable_shrink``. Sync: a copy from the host."""
        self._shrink_mask().query(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (a rank that still does not take part is masked again at the next call
        that needs it). Needs ``enable_shrink``."""
        self._shrink_mask().clean()

    def _shrink_mask(self) -> shrink.RankMask:
        if self._mask is None:
            raise ValueError("the mask buffer needs shrink mode: build the Buffer with enable_shrink=True")
        return self._mask


def _check_config(config: Config | None) -> None:
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a moe_sbo.deep_ep.Config, got {type(config).__name__}")

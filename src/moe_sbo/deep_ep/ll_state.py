"""What a ``Buffer`` keeps for DeepEP's low-latency mode, and the mode's dispatch and combine once their
arguments are checked: the ``low_latency`` dispatchers per shape, the two receive tensor sets and
zero-copy combine buffers per shape (DeepEP's two buffers), per-shape constants and the packing's
replay graphs (``low_latency.PackReplays``). ``buffer.py`` holds DeepEP's method signatures and
checks and calls in here; ``low_latency.py`` has each step.

Legend: see ``moe_sbo/__init__.py``; here C is DeepEP's ``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dispatch import Dispatcher, EPGroup, make_dispatcher
from ..hooks import HookRegistry
from . import low_latency as ll
from .events import EventOverlap, finish


@dataclass
class LowLatencyState:
    """One ``Buffer``'s low-latency state over its EP group ``ep``; every dispatcher shares ``hooks``.
    ``rounds`` counts the dispatches (a round's receive tensors are set ``rounds % 2``)."""

    ep: EPGroup
    hooks: HookRegistry
    dispatchers: dict[tuple, Dispatcher] = field(default_factory=dict)
    storage: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Any]] = field(default_factory=dict)
    combine_buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)
    constants: dict[tuple, torch.Tensor] = field(default_factory=dict)
    pack_replays: ll.PackReplays = field(default_factory=ll.PackReplays)
    rounds: int = 0

    def dispatcher(
        self,
        num_experts: int,
        capacity: int,
        top_k: int,
        use_fp8: bool,
        per_choice: bool,
        ep: EPGroup | None = None,
    ) -> Dispatcher:
        """Each token travels once per destination rank (C per rank), or, ``per_choice``, each
        (token, choice) as a token of its own (C * K of them). The rows (fp8 ones as e4m3 and scales)
        stay in the receive buffer until they are packed (``index_rows``), so an eager round reads
        and writes the same tensors each time its set comes round and the packing replays from a
        graph (``low_latency.PackReplays``). ``ep``: the group (shrink mode: the unmasked ranks';
        default the Buffer's)."""
        ep = ep or self.ep
        key = (num_experts, capacity, top_k, use_fp8, per_choice, ep.size)
        if key not in self.dispatchers:
            d = make_dispatcher(
                "low_latency",
                num_experts,
                ep,
                max_tokens_per_rank=capacity * top_k if per_choice else capacity,
                fp8=use_fp8,
                num_buffers=2,
                index_rows=True,
            )
            d.deliver_fp8 = use_fp8
            d.hooks = self.hooks
            self.dispatchers[key] = d
        return self.dispatchers[key]

    def constant(self, name: str, num_tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
        """Constants made once per shape: ``"ones"`` float32 [T * K, 1] (each choice's weight on the
        wire) and ``"choices"`` int64 [T, K] (each choice's returned row, per choice); ``"ok"`` int32
        [1] of 1 (the packing's overflow flag, one per device: T and K are 0)."""
        key = (name, num_tokens, top_k, device)
        if key not in self.constants:
            with torch.inference_mode(False):
                if name == "ones":
                    value = torch.ones(num_tokens * top_k, 1, dtype=torch.float32, device=device)
                elif name == "ok":
                    value = torch.ones(1, dtype=torch.int32, device=device)
                else:
                    value = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)
            self.constants[key] = value
        return self.constants[key]

    def receive_storage(
        self, handle: ll.LowLatencyHandle, use_fp8: bool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Any]:
        """The round's receive tensors (two per shape, used in turn, as DeepEP's two buffers):
        x [L * P * C + 1, H], with fp8 its scales, the counts int32 [L], and what
        ``low_latency_dispatch`` returns as recv_x (the packed [L, P * C, H] view, with fp8 and its
        scales' view)."""
        rows = handle.num_experts * handle.num_max_dispatch_tokens_per_rank + 1
        key = (rows, handle.hidden, use_fp8, handle.dtype, device, handle.buffer_index)
        if key not in self.storage:
            num_local, hidden = handle.num_experts // self.ep.size, handle.hidden
            x_dtype = torch.float8_e4m3fn if use_fp8 else handle.dtype
            x = torch.zeros(rows, hidden, dtype=x_dtype, device=device)
            scales = torch.zeros(rows, hidden // 128, device=device) if use_fp8 else None
            count = torch.zeros(num_local, dtype=torch.int32, device=device)
            recv_x: Any = x[:-1].view(num_local, -1, hidden)
            if scales is not None:
                recv_x = (recv_x, scales[:-1].view(num_local, -1, hidden // 128))
            self.storage[key] = (x, scales, count, recv_x)
        return self.storage[key]

    def combine_buffer(self, handle: Any) -> torch.Tensor:
        """The [L, P * C, H] zero-copy combine buffer of ``handle``'s round (one of two per shape)."""
        num_local = handle.num_experts // self.ep.size
        rows = self.ep.size * handle.num_max_dispatch_tokens_per_rank
        shape = (handle.num_experts, handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        key = (*shape, handle.dtype, handle.device, handle.buffer_index)
        if key not in self.combine_buffers:
            self.combine_buffers[key] = torch.zeros(
                num_local, rows, handle.hidden, dtype=handle.dtype, device=handle.device
            )
        return self.combine_buffers[key]

    def zero_combine_buffers(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the zero-copy combine buffers of that shape."""
        for key, tensor in self.combine_buffers.items():
            if key[:3] == (num_experts, num_max_dispatch_tokens_per_rank, hidden):
                tensor.zero_()

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        capacity: int,
        num_experts: int,
        stats_L: torch.Tensor | None,
        use_fp8: bool,
        async_finish: bool,
        return_recv_hook: bool,
        topk_weights: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor, ll.LowLatencyHandle, EventOverlap, Callable[[], None] | None]:
        """``Buffer.low_latency_dispatch`` with its arguments checked."""
        (num_tokens, hidden), top_k = x.shape, topk_idx.shape[1]
        # Three ways, fastest first: the weights given now (one row per (token, rank), weighted on the
        # experts' ranks); the weights written into the dispatched rows at combine (the same rows;
        # where the rows lie in the peers' buffers: symmetric memory or one rank); else one row per
        # (token, choice), weighted on the token's rank.
        weighted = topk_weights is not None
        dispatcher = self.dispatcher(num_experts, capacity, top_k, use_fp8, False)
        restamp = not weighted and dispatcher.can_set_combine_weights(x.device)  # type: ignore[attr-defined]
        per_choice = not weighted and not restamp
        if per_choice:
            dispatcher = self.dispatcher(num_experts, capacity, top_k, use_fp8, True)
        handle = ll.LowLatencyHandle(
            num_max_dispatch_tokens_per_rank=capacity,
            hidden=hidden,
            num_experts=num_experts,
            dtype=x.dtype,
            num_topk=top_k,
            num_tokens=num_tokens,
            buffer_index=self.rounds % 2,
            dispatcher=dispatcher,
            device=x.device,
            topk_weights=topk_weights,
            weights_version=0 if topk_weights is None else topk_weights._version,
            restamp=restamp,
            choice_index_TK=self.constant("choices", num_tokens, top_k, x.device) if per_choice else None,
        )
        self.rounds += 1
        x_storage, scales_storage, count_L, recv_x = self.receive_storage(handle, use_fp8, x.device)
        ok = self.constant("ok", 0, 0, x.device)
        with torch.no_grad():
            ones = None if weighted else self.constant("ones", num_tokens, top_k, x.device)
            pending = ll.launch_dispatch(handle, x, topk_idx, ones)

        def receive() -> None:
            with torch.no_grad():
                ll.receive(handle, pending, x_storage, scales_storage, count_L, stats_L, self.pack_replays, ok)

        hook = None
        if return_recv_hook:
            hook = ll.receive_hook(receive)
        else:
            receive()
        event = finish(x.device, async_finish, (x, topk_idx, x_storage, count_L))
        return recv_x, count_L, handle, event, hook

    def combine(
        self,
        rows: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: ll.LowLatencyHandle,
        async_finish: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """``Buffer.low_latency_combine`` with its arguments checked, the experts' outputs ``rows``."""
        combined = out
        if combined is None:
            combined = torch.empty(handle.num_tokens, handle.hidden, dtype=rows.dtype, device=rows.device)
        with torch.no_grad():
            pending = ll.launch_combine(handle, rows, topk_weights)

        def receive() -> None:
            with torch.no_grad():
                ll.finish_combine(handle, pending, topk_idx, topk_weights, combined)

        hook = None
        if return_recv_hook:
            hook = ll.receive_hook(receive)
        else:
            receive()
        return combined, finish(rows.device, async_finish, (rows, topk_idx, topk_weights, combined)), hook

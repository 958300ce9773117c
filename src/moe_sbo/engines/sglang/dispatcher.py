"""moe-sbo's dispatcher for SGLang's ``deepep`` backend: SGLang's DeepEP formats out, moe-sbo's six hook
events inside, and moe-sbo's SBO modes placing the shared experts SGLang's model hands over.

::

    SGLang (FusedMoE, DeepseekV2MoE)        here                              moe_sbo.deep_ep.Buffer
    dispatch(hidden_states, topk_output) -> dispatch_a: pre_dispatch hooks
                                                        normal: -
                                                        LL:  low_latency_dispatch(recv hook) -> in flight
                                            dispatch_b: normal: get_dispatch_layout + dispatch  -> in flight
                                                        LL:  hook()
                                                        -> DeepEPNormal/LLDispatchOutput, post_dispatch hooks
    combine(combine_input)               -> combine_a: pre_combine hooks
                                                        LL:  low_latency_combine(recv hook)     -> in flight
                                            combine_b: normal: combine                          -> in flight
                                                        LL:  hook(); post_combine hooks -> [T, H]

SGLang's hook registries are kept in a moe-sbo ``HookRegistry`` under the six event names:
``register_pre_dispatch_hook`` -> ``pre_dispatch``, ``register_deepep_dispatch_hook`` ->
``dispatch_in_flight`` (fired by the moe-sbo dispatcher inside the buffer, while its transfer is on the
wire), ``register_post_dispatch_hook`` -> ``post_dispatch``, ``register_pre_combine_hook`` ->
``pre_combine``, ``register_post_combine_hook`` -> ``post_combine``; ``combine_in_flight`` is fired by
the buffer's dispatcher too. They fire on every path, ``dispatch()`` and the ``dispatch_a`` /
``dispatch_b`` halves two-batch overlap calls alike, no method is replaced on an instance, and a hook may
remove itself or another while hooks run (SGLang's own registry forbids both).

With an SBO mode, the work SGLang's model registers through ``register_deepep_dispatch_hook`` (its
shared experts, when SBO is on) is not fired at ``dispatch_in_flight`` as such but where moe-sbo's mode
puts it (``moe_sbo.overlap``'s attach functions, on this registry): ``none`` after the combine,
``dispatch`` in the dispatch's flight, ``combine`` on the side stream from ``pre_combine``,
``combine_sm`` on the side stream from ``combine_in_flight`` with the SM budget.

The hard part is the buffer's single hook registry: SGLang's MoE layers share one process-wide buffer
(as they share DeepEP's), so this dispatcher bridges the buffer's in-flight events to its own hooks
only for the duration of its own buffer calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers import deep_gemm_wrapper
from sglang.srt.layers.dp_attention import get_is_extend_in_batch
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
from sglang.srt.layers.moe.token_dispatcher.deepep import (
    DeepEPLLDispatchOutput,
    DeepEPNormalDispatchOutput,
)
from sglang.srt.layers.moe.utils import DeepEPMode, DispatcherOutputDtype, get_deepep_output_dtype

from moe_sbo.experts.shared import SharedExperts
from moe_sbo.hooks import HookHandle, HookRegistry, HookScope
from moe_sbo.overlap import SharedOutput, make_overlap
from moe_sbo.overlap.sbo import FixedOverlap

from .buffer import process_buffer


class SharedWork:
    """The shared-expert work SGLang's model registered for this forward, as moe-sbo's SBO modes call
    shared experts (``shared(x_TH)``): it runs the registered hooks, which keep their output themselves."""

    def __init__(self, dispatcher: MoeSboDispatcher):
        self.dispatcher = dispatcher

    def __call__(self, x_TH: torch.Tensor) -> None:
        self.dispatcher.shared_work.run("dispatch_in_flight", self.dispatcher, None)


class MoeSboDispatcher(BaseDispatcher):
    """One micro-batch's dispatcher (``MoeSboTboDispatcher`` holds one or two). Arguments as SGLang's
    ``DeepEPDispatcher``'s; ``overlap``: a moe-sbo SBO mode placing the shared-expert work (None: the
    work registered through ``register_deepep_dispatch_hook`` fires at ``dispatch_in_flight``).

    Normal mode moves bf16 (or float32) rows through moe-sbo's ``alltoall`` (one node) or ``node_aware``
    (``MOE_SBO_RANKS_PER_NODE`` ranks per node); low-latency mode through ``low_latency``, bf16 or fp8
    (``--deepep-dispatcher-output-dtype``)."""

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        router_topk: int,
        num_experts: int,
        num_local_experts: int,
        hidden_size: int,
        params_dtype: torch.dtype,
        deepep_mode: DeepEPMode,
        num_max_dispatch_tokens_per_rank: int,
        overlap: str | None = None,
        runner_backend: Any = None,
    ):
        super().__init__()
        if num_experts % num_local_experts or num_experts // num_local_experts != group.size():
            raise ValueError(
                f"num_local_experts must be num_experts / EP size = {num_experts} / {group.size()}, got "
                f"{num_local_experts}; moe-sbo's dispatcher places experts evenly over the EP group"
            )
        self.group = group
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.params_dtype = params_dtype
        self.deepep_mode = deepep_mode
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.overlap = overlap
        self.runner_backend = runner_backend
        self.expert_mask_gpu = None  # SGLang's AITER sink mask; moe-sbo marks no sink slot
        self.hooks = HookRegistry()  # SGLang's hooks, by moe-sbo event
        self.shared_work = HookRegistry()  # with an SBO mode: the model's shared-expert work
        self.last_event_order: list[str] = []  # the moe-sbo events of the last forward, in order
        self._strategies: dict[torch.device, FixedOverlap] = {}
        self._forward: _Forward | None = None

    # ---- SGLang's hook registries -----------------------------------------------------------

    def register_pre_dispatch_hook(self, hook: Callable) -> HookHandle:
        """``hook(dispatcher, hidden_states, topk_output) -> (hidden_states, topk_output) | None`` at
        ``pre_dispatch``."""
        return self.hooks.register("pre_dispatch", lambda d, payload: hook(d, *payload))

    def register_deepep_dispatch_hook(self, hook: Callable) -> HookHandle:
        """``hook(dispatcher)`` at ``dispatch_in_flight``; with an SBO mode, where the mode puts the
        shared experts."""
        registry = self.hooks if self.overlap is None else self.shared_work
        return registry.register("dispatch_in_flight", lambda d, payload: _none(hook(d)))

    def register_post_dispatch_hook(self, hook: Callable) -> HookHandle:
        """``hook(dispatcher, dispatch_output) -> dispatch_output | None`` at ``post_dispatch``."""
        return self.hooks.register("post_dispatch", hook)

    def register_pre_combine_hook(self, hook: Callable) -> HookHandle:
        """``hook(dispatcher, combine_input) -> combine_input | None`` at ``pre_combine``."""
        return self.hooks.register("pre_combine", hook)

    def register_post_combine_hook(self, hook: Callable) -> HookHandle:
        """``hook(dispatcher, hidden_states) -> hidden_states | None`` at ``post_combine``."""
        return self.hooks.register("post_combine", hook)

    # ---- SGLang's dispatcher API ------------------------------------------------------------

    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any) -> Any:
        """``dispatch_b()`` after ``dispatch_a(...)``. Sync: as those two."""
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: Any) -> None:
        """Run the ``pre_dispatch`` hooks; in low-latency mode, launch the transfer.

        Sync: normal mode moves nothing yet; low-latency mode returns with the transfer in flight
        (no host read, as ``Buffer.low_latency_dispatch(return_recv_hook=True)``)."""
        if self._forward is not None:
            self._abandon()
            raise RuntimeError("dispatch_a was called twice without a combine_b in between")
        self.last_event_order = []
        with self._closing_on_error():
            hidden_states, topk_output = self._run("pre_dispatch", (hidden_states, topk_output))
            forward = self._forward = _Forward(self, hidden_states, topk_output)
            if forward.low_latency:
                with self._bridge():
                    forward.launch_low_latency_dispatch()

    def dispatch_b(self) -> Any:
        """Finish the dispatch: SGLang's ``DeepEPNormalDispatchOutput`` or ``DeepEPLLDispatchOutput``,
        after the ``post_dispatch`` hooks.

        Sync: normal mode runs the whole transfer here (the host blocks on its count exchanges and
        one read of the received row count, as DeepEP's normal mode); low-latency mode receives (the
        current stream waits; no host read)."""
        forward = self._require_forward("dispatch_b")
        with self._closing_on_error():
            with self._bridge():
                output = forward.finish_dispatch()
            return self._run("post_dispatch", output)

    def combine(self, combine_input: Any) -> torch.Tensor:
        """``combine_b()`` after ``combine_a(...)``. Sync: as those two."""
        self.combine_a(combine_input)
        return self.combine_b()

    def combine_a(self, combine_input: Any) -> None:
        """Run the ``pre_combine`` hooks; in low-latency mode, launch the transfer back.

        ``combine_input``: SGLang's ``DeepEPNormalCombineInput`` (rows weighted and summed over this
        rank's experts, as dispatch returned them) or ``DeepEPLLCombineInput`` (each expert's rows
        unweighted; the top-k weights are applied here). Sync: low-latency mode returns with the
        transfer in flight."""
        forward = self._require_forward("combine_a")
        with self._closing_on_error():
            combine_input = self._run("pre_combine", combine_input)
            if forward.low_latency:
                with self._bridge():
                    forward.launch_low_latency_combine(combine_input)
            else:
                forward.combine_input = combine_input

    def combine_b(self) -> torch.Tensor:
        """The combined ``[T, H]`` (hidden_states' dtype), after the ``post_combine`` hooks; the shared
        experts' work of this forward has run when this returns (on CUDA: queued, the current stream
        waits for it).

        Sync: normal mode runs the whole transfer here; low-latency mode receives. The host blocks on
        CPU (gloo); on CUDA only the current stream waits."""
        forward = self._require_forward("combine_b")
        try:
            with self._bridge():
                combined = forward.finish_combine()
            combined = self._run("post_combine", combined)
            forward.shared_done()
        finally:
            self._abandon()
        return combined

    @property
    def forward_in_progress(self) -> bool:
        """Whether a forward was dispatched and not yet combined (its hooks are then registered)."""
        return self._forward is not None

    # ---- internals ----------------------------------------------------------------------------

    def _require_forward(self, phase: str) -> _Forward:
        if self._forward is None:
            raise RuntimeError(f"{phase} needs dispatch_a first (one forward at a time per dispatcher)")
        return self._forward

    def _abandon(self) -> None:
        """End the forward in progress: its SBO hooks are removed."""
        if self._forward is not None:
            self._forward.close()
            self._forward = None

    @contextmanager
    def _closing_on_error(self) -> Iterator[None]:
        """A phase that raises ends its forward, so no hook of it reaches the next one."""
        try:
            yield
        except BaseException:
            self._abandon()
            raise

    def _run(self, event: str, payload: Any) -> Any:
        self.last_event_order.append(event)
        return self.hooks.run(event, self, payload)

    def strategy(self, device: torch.device) -> FixedOverlap:
        """The SBO strategy of ``self.overlap`` for ``device`` (one per device: its side stream)."""
        if device not in self._strategies:
            strategy = make_overlap(self.overlap or "none", device)
            assert isinstance(strategy, FixedOverlap), "settings.OVERLAP_MODES holds fixed modes only"
            self._strategies[device] = strategy
        return self._strategies[device]

    @contextmanager
    def _bridge(self) -> Iterator[None]:
        """While a buffer call runs: its dispatcher's in-flight events fire this dispatcher's hooks."""
        buffer = self._require_forward("a transfer").buffer
        with HookScope(buffer.hooks) as scope:
            for event in ("dispatch_in_flight", "combine_in_flight"):
                scope.register(event, self._forwarder(event))
            yield

    def _forwarder(self, event: str) -> Callable[[Any, Any], None]:
        """A hook on the buffer's registry firing ``event`` on this dispatcher's."""

        def forward(dispatcher: Any, pending: Any) -> None:
            self._run(event, pending)

        return forward


class _Forward:
    """One forward's state between ``dispatch_a`` and ``combine_b``: the mode, the buffer, the handle,
    and the SBO strategy's hooks (a ``HookScope`` on the dispatcher's registry, removed at ``close``)."""

    def __init__(self, dispatcher: MoeSboDispatcher, hidden_states: torch.Tensor, topk_output: Any):
        d = self.dispatcher = dispatcher
        mode = d.deepep_mode.resolve(get_is_extend_in_batch())
        self.low_latency = mode == DeepEPMode.LOW_LATENCY
        self.buffer = process_buffer(
            d.group, d.hidden_size, d.deepep_mode, d.num_max_dispatch_tokens_per_rank, d.num_experts
        )
        self.hidden_states = hidden_states
        self.topk_weights = topk_output.topk_weights
        self.topk_ids = topk_output.topk_ids.to(torch.int64)
        self.use_fp8 = self._use_fp8(d, mode)
        self.combine_input: Any = None
        self.handle: Any = None
        self.pending: tuple = ()
        self.scope = HookScope(d.hooks)
        self.shared: SharedOutput | None = None
        if d.overlap is not None and d.shared_work.count():
            # The fixed modes but ``split`` only call ``shared(x_TH)`` (settings.OVERLAP_MODES has no split).
            work = cast(SharedExperts, SharedWork(d))
            self.shared = d.strategy(hidden_states.device).attach(self.scope, work, hidden_states)

    @staticmethod
    def _use_fp8(d: MoeSboDispatcher, mode: DeepEPMode) -> bool:
        d.dispatch_mode = mode  # what SGLang's dtype rule reads for per-mode overrides
        dtype = get_deepep_output_dtype(d)
        if dtype not in (DispatcherOutputDtype.BF16, DispatcherOutputDtype.FP8):
            raise ValueError(
                f"moe-sbo's SGLang dispatcher sends bf16 or fp8, got --deepep-dispatcher-output-dtype {dtype.value}; "
                "pass --deepep-dispatcher-output-dtype bf16 (or fp8 with --deepep-mode low_latency)"
            )
        if dtype == DispatcherOutputDtype.FP8 and mode != DeepEPMode.LOW_LATENCY:
            raise ValueError(
                "moe-sbo's SGLang dispatcher sends fp8 in low-latency mode only (its normal mode moves the "
                "hidden states as given); pass --deepep-dispatcher-output-dtype bf16, or --deepep-mode low_latency"
            )
        return dtype == DispatcherOutputDtype.FP8

    # ---- dispatch -----------------------------------------------------------------------------

    def launch_low_latency_dispatch(self) -> None:
        d = self.dispatcher
        packed, count_L, self.handle, _, hook = self.buffer.low_latency_dispatch(
            self.hidden_states,
            self.topk_ids,
            d.num_max_dispatch_tokens_per_rank,
            d.num_experts,
            use_fp8=self.use_fp8,
            return_recv_hook=True,
        )
        self.pending = (packed, count_L, hook)

    def finish_dispatch(self) -> Any:
        if self.low_latency:
            return self._finish_low_latency_dispatch()
        d, buffer = self.dispatcher, self.buffer
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(self.topk_ids, d.num_experts)
        recv_x, recv_ids, recv_weights, per_expert_list, self.handle, _ = buffer.dispatch(
            self.hidden_states,
            topk_idx=self.topk_ids,
            topk_weights=self.topk_weights.float(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_node,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            expert_alignment=128 if deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM else 1,
        )
        get_global_expert_distribution_recorder().on_deepep_dispatch_normal(
            per_expert_list,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_node,
            num_tokens_per_expert=per_expert,
        )
        return DeepEPNormalDispatchOutput(recv_x, None, recv_ids, recv_weights, per_expert_list)

    def _finish_low_latency_dispatch(self) -> Any:
        packed, count_L, hook = self.pending
        hook()
        self.pending = ()
        get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(count_L)
        x, scales = packed if isinstance(packed, tuple) else (packed, None)
        num_tokens, num_ranks = self.hidden_states.shape[0], self.dispatcher.group.size()
        num_experts = self.dispatcher.num_experts
        expected_m = (num_tokens * num_ranks * self.topk_ids.shape[1] + num_experts) // num_experts
        return DeepEPLLDispatchOutput(x, scales, self.topk_ids, self.topk_weights, count_L, expected_m)

    # ---- combine ------------------------------------------------------------------------------

    def launch_low_latency_combine(self, combine_input: Any) -> None:
        hidden_states, topk_ids, topk_weights = combine_input[:3]
        combined, _, hook = self.buffer.low_latency_combine(
            hidden_states, topk_ids.to(torch.int64), topk_weights.float(), self.handle, return_recv_hook=True
        )
        self.pending = (combined, hook)

    def finish_combine(self) -> torch.Tensor:
        if self.low_latency:
            combined, hook = self.pending
            hook()
            self.pending = ()
            return combined
        hidden_states = self.combine_input[0]
        combined, _, _ = self.buffer.combine(hidden_states, self.handle)
        return combined

    def shared_done(self) -> None:
        """The shared-expert work has run (``none`` runs it now); raises if its hooks never fired."""
        if self.shared is not None:
            self.shared.result()

    def close(self) -> None:
        self.scope.remove_all()


def _none(_: Any) -> None:
    """In-flight hooks return nothing (moe-sbo's registry refuses a replacement there)."""
    return None

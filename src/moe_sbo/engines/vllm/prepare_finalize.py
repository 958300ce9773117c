"""``MoeSboPrepareAndFinalize``: vLLM's modular-kernel prepare/finalize over a moe-sbo dispatcher.

Legend: see ``moe_sbo/__init__.py``.

::

    prepare_async   -> dispatch_launch (pre_dispatch, dispatch_in_flight hooks)   returns (hook, receiver)
      hook          -> the transfer's wait
      receiver      -> dispatch_wait (post_dispatch hooks) -> R expert rows, one expert each
    experts         vLLM's, on [R, H] with topk_ids [R, 1] (global ids) and weights 1
    finalize_async  -> combine_launch (pre_combine, combine_in_flight hooks)      returns (hook, receiver)
      hook          -> the transfer's wait
      receiver      -> combine_wait (post_combine hooks): y [T, H], summed in a fixed order

The hard part is the meeting of two layouts. vLLM's standard format hands the experts tokens with
their top-k ids and takes back one row per (token, choice) to weight and sum; moe-sbo's dispatchers
deliver one row per (token, local expert) pair, grouped by expert, and weight and sum the experts'
rows themselves in the combine, in a fixed order. So each expert row goes to vLLM as a token with one
choice (its expert, weight 1): vLLM's weighting is then the identity, and the top-k weights are
applied once, by moe-sbo's combine. Rows past the real ones (``low_latency``'s fixed layout) get an
expert of another rank, which vLLM's ``expert_map`` turns into "no expert" (as vLLM's DeepEP
high-throughput class does with DeepEP's -1 ids); at EP 1 they get the last expert and are never read.

The two-phase split is vLLM's: ``prepare_async`` and ``finalize_async`` return a (hook, receiver)
pair, the hook being moe-sbo's wait on the transfer, so vLLM's dual-batch overlap registers the hook
and runs the other micro-batch while the transfer is in flight. vLLM calls its shared experts between
``finalize_async`` and the hook: they run while the combine is in flight (``overlap="combine"``);
``overlap="none"`` finishes the combine inside ``finalize_async`` instead. Given ``shared`` (moe-sbo's
``SharedExperts``), every moe-sbo SBO mode runs them through the dispatcher's hooks and the output is
routed + shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
from vllm.v1.worker.ubatching import dbo_current_ubatch_id

from ...dispatch import (
    DISPATCHERS,
    Dispatcher,
    DispatchHandle,
    EPGroup,
    Pending,
    make_dispatcher,
    options_for_tokens,
)
from ...experts.shared import SharedExperts
from ...hooks import HookRegistry, HookScope
from ...overlap import FIXED_MODES, SharedOutput, make_overlap

# ``overlap`` values without ``shared``: where vLLM's own shared experts run relative to the combine.
VLLM_SHARED_ORDERS = ("combine", "none")


@dataclass(frozen=True)
class DispatcherRecipe:
    """A moe-sbo dispatcher to build once the layer's expert count is known (vLLM's DeepEP slot is
    filled before it is): ``name``, the torch process ``group``, and for ``low_latency`` the most
    tokens a rank dispatches per forward (vLLM's ``max_num_tokens``)."""

    name: str
    group: Any
    max_tokens_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.name not in DISPATCHERS or self.name == "local":
            raise ValueError(f"dispatcher must be one of {sorted(set(DISPATCHERS) - {'local'})}, got {self.name!r}")
        if self.name == "low_latency" and self.max_tokens_per_rank is None:
            raise ValueError("the low_latency dispatcher needs max_tokens_per_rank (vLLM's max_num_tokens per rank)")

    def build(self, num_experts: int) -> Dispatcher:
        """The dispatcher for ``num_experts`` experts; ``node_aware`` takes its nodes from
        ``MOE_SBO_RANKS_PER_NODE`` (or torchrun's ``LOCAL_WORLD_SIZE``), as every moe-sbo group does."""
        ep = EPGroup.from_torch(self.group)
        options: dict[str, Any] = {}
        if self.name == "low_latency":
            assert self.max_tokens_per_rank is not None, "checked in __post_init__"
            options = options_for_tokens(self.name, self.max_tokens_per_rank) | {"num_buffers": 2}
        elif self.name == "node_aware":
            options = {"ranks_per_node": ep.node_size}
        return make_dispatcher(self.name, num_experts, ep, **options)


class MoeSboPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's ``FusedMoEPrepareAndFinalizeModular`` (standard activation format) over a moe-sbo dispatcher.

    ``dispatcher``: a moe-sbo ``Dispatcher``, or a ``DispatcherRecipe`` built at the first prepare
    (when the layer's expert count is known). ``hooks`` is the dispatcher's ``HookRegistry``: the six
    events fire on every forward. ``overlap``: without ``shared``, ``"combine"`` (vLLM's shared experts
    run while the combine is in flight) or ``"none"`` (after it); with ``shared`` (moe-sbo's
    ``SharedExperts``), any of moe-sbo's fixed SBO modes, and finalize writes routed + shared.
    """

    def __init__(
        self,
        dispatcher: Dispatcher | DispatcherRecipe,
        *,
        overlap: str = "combine",
        shared: SharedExperts | None = None,
    ):
        super().__init__()
        allowed = FIXED_MODES if shared is not None else VLLM_SHARED_ORDERS
        if overlap not in allowed:
            raise ValueError(
                f"overlap must be one of {list(allowed)} {'with' if shared is not None else 'without'} shared "
                f"experts, got {overlap!r}; the SBO modes that move the shared experts need them passed as shared="
            )
        self._recipe = dispatcher if isinstance(dispatcher, DispatcherRecipe) else None
        self._dispatcher = dispatcher if isinstance(dispatcher, Dispatcher) else None
        self._ep_size = (
            dispatcher.ep.size if isinstance(dispatcher, Dispatcher) else EPGroup.from_torch(dispatcher.group).size
        )
        self.hooks = self._dispatcher.hooks if self._dispatcher is not None else HookRegistry()
        self.overlap = overlap
        self.shared = shared
        # One in-flight forward per vLLM micro-batch (dual-batch overlap runs two).
        self._handles: list[DispatchHandle | None] = [None, None]
        self._scopes: list[HookScope | None] = [None, None]
        self._shared_out: list[SharedOutput | None] = [None, None]

    @property
    def dispatcher(self) -> Dispatcher:
        """The moe-sbo dispatcher (a recipe's is built by the first prepare)."""
        if self._dispatcher is None:
            raise RuntimeError("the dispatcher is built by the first prepare (it needs the layer's expert count)")
        return self._dispatcher

    @property
    def group(self) -> Any:
        """The torch process group the dispatcher moves rows over."""
        if self._dispatcher is not None:
            return self._dispatcher.ep.group
        assert self._recipe is not None, "a prepare/finalize holds a dispatcher or a recipe"
        return self._recipe.group

    def _dispatcher_for(self, num_experts: int) -> Dispatcher:
        if self._dispatcher is None:
            assert self._recipe is not None, "a prepare/finalize holds a dispatcher or a recipe"
            self._dispatcher = self._recipe.build(num_experts)
            self._dispatcher.hooks = self.hooks
        if num_experts != self._dispatcher.num_experts:
            raise ValueError(
                f"num_experts must be the dispatcher's {self._dispatcher.num_experts}, got {num_experts}; "
                "use one prepare/finalize per layer shape"
            )
        return self._dispatcher

    # ---- what vLLM asks of every prepare/finalize ---------------------------------------------

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None  # moe-sbo takes int32 and int64 ids

    def max_num_tokens_per_rank(self) -> int | None:
        if self._dispatcher is not None:
            return self._dispatcher.capacity
        return self._recipe.max_tokens_per_rank if self._recipe is not None else None

    def num_dispatchers(self) -> int:
        return self._ep_size

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return True

    # ---- prepare: dispatch --------------------------------------------------------------------

    def prepare_async(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> tuple[Callable[[], None], mk.ReceiverType]:
        """Launch the dispatch of ``a1`` [T, H] to the experts ``topk_ids`` [T, K] name.

        Returns (hook, receiver): the hook waits for the transfer; the receiver (after it) returns
        vLLM's prepare result: expert rows [R, H] (quantised as ``quant_config`` asks, unless
        ``defer_input_quant``), scales, per-expert counts, ids [R, 1], weights [R, 1] (ones).

        Sync: as the dispatcher's ``dispatch_launch`` (variable-size schemes exchange counts on the
        host) and ``dispatch_wait``; hooks of ``pre_dispatch`` and ``dispatch_in_flight`` have run
        when this returns."""
        dispatcher = self._dispatcher_for(num_experts)
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError(
                    f"apply_router_weight_on_input needs top-k 1, got {topk_ids.shape[1]}; vLLM applies it only then"
                )
            a1 = a1 * topk_weights.to(a1.dtype)
            topk_weights = torch.ones_like(topk_weights)
        ubatch = dbo_current_ubatch_id()
        self._attach_shared(ubatch, a1)
        pending = dispatcher.dispatch_launch(a1, topk_ids, topk_weights)

        def receiver() -> mk.PrepareResultType:
            return self._receive(ubatch, pending, quant_config, defer_input_quant)

        return pending.wait, receiver

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        """``prepare_async`` followed by its hook and receiver. Sync: as those."""
        hook, receiver = self.prepare_async(
            a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input, quant_config,
            defer_input_quant,
        )  # fmt: skip
        hook()
        return receiver()

    def _attach_shared(self, ubatch: int, x_TH: torch.Tensor) -> None:
        """This forward's SBO hooks (with ``shared``); a scope a failed forward left is removed first."""
        old = self._scopes[ubatch]
        if old is not None:
            old.remove_all()
        self._scopes[ubatch] = self._shared_out[ubatch] = None
        if self.shared is None:
            return
        scope = self.hooks.scope()
        self._scopes[ubatch] = scope
        self._shared_out[ubatch] = make_overlap(self.overlap, x_TH.device).attach(scope, self.shared, x_TH)

    def _receive(
        self, ubatch: int, pending: Pending, quant_config: FusedMoEQuantConfig, defer_input_quant: bool
    ) -> mk.PrepareResultType:
        out = self.dispatcher.dispatch_wait(pending)
        self._handles[ubatch] = out.handle
        rows_RH = out.rows_RH()
        ids_R1 = self._expert_of_rows(out.num_rows_per_expert_L, rows_RH.shape[0])
        weights_R1 = torch.ones(ids_R1.shape, dtype=torch.float32, device=rows_RH.device)
        meta = mk.ExpertTokensMetadata(
            expert_num_tokens=out.num_rows_per_expert_L.to(device=rows_RH.device, dtype=torch.int32),
            expert_num_tokens_cpu=None,
        )
        scales = None
        if quant_config.quant_dtype is not None and not defer_input_quant and rows_RH.numel():
            rows_RH, scales = moe_kernel_quantize_input(
                rows_RH,
                quant_config.a1_scale,
                quant_dtype=quant_config.quant_dtype,
                per_act_token_quant=quant_config.per_act_token_quant,
                block_shape=quant_config.block_shape,
            )
        return rows_RH, scales, meta, ids_R1, weights_R1

    def _expert_of_rows(self, num_rows_per_expert_L: torch.Tensor, num_rows: int) -> torch.Tensor:
        """int64 [R, 1]: each expert row's global expert id; rows past the real ones get an expert of
        another rank (vLLM's ``expert_map`` maps it to none), or at EP 1 the last expert."""
        d = self.dispatcher
        device = num_rows_per_expert_L.device
        ends_L = num_rows_per_expert_L.to(torch.int64).cumsum(0)
        local_R = torch.searchsorted(ends_L, torch.arange(num_rows, device=device), right=True)
        if d.ep.size > 1:
            outside = d.num_experts - 1 if d.ep.rank == 0 else 0
            ids_R = torch.where(local_R < d.num_local_experts, local_R + d.first_local_expert, outside)
        else:
            ids_R = local_R.clamp(max=d.num_local_experts - 1)
        return ids_R[:, None]

    # ---- finalize: combine --------------------------------------------------------------------

    def finalize_async(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> tuple[Callable[[], None], Callable[[], None]]:
        """Launch the combine of the experts' rows ``fused_expert_output`` ([R, H] or [R, 1, H], the
        order prepare returned) into ``output`` [T, H].

        Returns (hook, receiver): the hook waits for the transfer; the receiver writes ``output``
        (routed, plus shared when this holds them). With ``overlap="none"`` and no ``shared`` the
        combine is finished here and both are no-ops.

        Sync: as the dispatcher's ``combine_launch`` / ``combine_wait``; ``pre_combine`` and
        ``combine_in_flight`` hooks have run when this returns."""
        ubatch = dbo_current_ubatch_id()
        handle = self._handles[ubatch]
        if handle is None:
            raise RuntimeError("finalize ran without a prepare on this micro-batch; call prepare first")
        self._handles[ubatch] = None
        # vLLM's weight-and-reduce of [R, 1, H] rows with weight 1 is the identity: the rows go as they
        # are, and the dispatcher checks there is one per expert row it delivered.
        y_RH = fused_expert_output.reshape(-1, fused_expert_output.shape[-1])
        pending = self.dispatcher.combine_launch(y_RH.to(handle.dtype), handle)

        def receiver() -> None:
            routed_TH = self.dispatcher.combine_wait(pending)
            shared_out, scope = self._shared_out[ubatch], self._scopes[ubatch]
            if shared_out is not None:
                shared_TH = shared_out.result()
                routed_TH = routed_TH + shared_TH if shared_TH is not None else routed_TH
            if scope is not None:
                scope.remove_all()
            self._scopes[ubatch] = self._shared_out[ubatch] = None
            output.copy_(routed_TH)

        if self.overlap == "none" and self.shared is None:
            pending.wait()
            receiver()
            return _nothing, _nothing
        return pending.wait, receiver

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        """``finalize_async`` followed by its hook and receiver. Sync: as those."""
        hook, receiver = self.finalize_async(
            output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, weight_and_reduce_impl
        )
        hook()
        receiver()


def _nothing() -> None:
    """The hook and receiver of a combine already finished."""

"""The expert-parallel MoE layer: router, routed experts spread over the EP group, shared experts.

Legend: see ``moe_sbo/__init__.py``.

One forward::

    x [T, H] -> router -> topk ids/weights [T, K]
             -> dispatch (launch, wait)      rows for my L experts, grouped by expert [R, H]
             -> routed experts (grouped GEMM; bf16 or block-scaled FP8 weights)        [R, H]
             -> combine (launch, wait)       weighted sum back on the tokens' rank    [T, H]
             -> + shared experts(x)                                                   [T, H]

(With ``low_latency``'s ``index_rows`` the dispatched rows stay where the transfer put them and the
routed experts read them through the layout's index: ``RoutedExperts.forward_dispatched``.)

With expert load balancing (``eplb=``) the router's logical ids are counted into a device-side load
window and become physical slot ids (a replica of the expert) before dispatch; the dispatchers see
only physical slots, ``slots_per_rank`` per rank (``moe_sbo.eplb``).

The layer never touches ranks or streams: the dispatcher owns communication, and the overlap
strategy (``overlap=``) decides where the shared experts run by attaching hooks to the dispatcher
for the length of one forward (``moe_sbo.overlap.sbo``); the layer only reads their output at the end.
The hard part is that the forward must pause while a transfer is in flight: it is written as a
generator of stages (``stages``) that yields there, so two-batch overlap can run another micro-batch's
work in the gap, and ``forward`` simply runs it to the end (``overlap/stages.py``). Weights, seeded and
loaded, are ``weights.py``'s.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch
from torch import nn

from .config import MoEConfig
from .dispatch import Dispatcher, EPGroup, Traffic, make_dispatcher
from .eplb.placement import Placement
from .eplb.runtime import EPLBOptions, LoadWindow, ReplicaTable, initial_placement, route_to_slots
from .eplb.transfer import MoveReport, all_reduce_load, check_fits, check_same_placement, move_expert_slots
from .experts import RoutedExperts, SharedExperts
from .overlap import Overlap, make_overlap
from .overlap.stages import run_to_end
from .routing.router import Router
from .weights import MoEWeights, load_weights, seed_weights

EXPERT_DTYPES = (None, "fp8")


class MoELayer(nn.Module):
    """A DeepSeek-style MoE layer whose routed experts are split over ``group`` by ``dispatcher``.

    ``dispatcher``: ``local`` (all experts here, the reference), ``allgather``, ``alltoall`` or
    ``low_latency``; ``dispatcher_options``: keyword options for it (e.g. ``max_tokens_per_rank``).
    ``group``: a ``torch.distributed`` group (``None``: the default group, or one rank when
    ``torch.distributed`` is not initialised). ``overlap``: where the shared experts run, one of
    ``moe_sbo.overlap.OVERLAP_MODES`` or a strategy from ``make_overlap``; ``sm_budget`` is the SMs
    ``combine_sm`` leaves the shared experts. Weights are random from ``seed`` (identical on every
    rank for the same expert) until ``load_weights`` sets them; ``seed=None`` leaves them
    uninitialised, for a load that follows. ``dtype`` of the weights and
    activations: by default bfloat16 on CUDA, float32 on CPU (CPU bf16 GEMMs are slow, and CPU ranks
    are for checking results, where float32 differs from a reference only by summation order).
    ``expert_dtype``: ``None`` (the routed experts' weights in ``dtype``) or ``"fp8"``: e4m3 weights
    with one scale per 128x128 block, as DeepSeek-V3 ships them, in block-scaled FP8 GEMMs (half the
    weight bytes; docs/FP8.md). With ``low_latency``'s fp8 dispatch the rows then reach the experts
    as they came off the wire, never dequantised. ``eplb``: expert load balancing (``EPLBOptions``):
    each rank holds ``slots_per_rank`` physical expert slots, redundant replicas included, counts the
    load, and ``rebalance`` moves experts between ranks.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        dispatcher: str = "local",
        group=None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        seed: int | None = 0,
        overlap: str | Overlap = "none",
        sm_budget: int | None = None,
        dispatcher_options: dict | None = None,
        expert_dtype: str | None = None,
        eplb: EPLBOptions | None = None,
    ):
        super().__init__()
        if expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")
        self.cfg = cfg
        device = torch.device(device) if device is not None else torch.device("cpu")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dtype = dtype
        self.overlap = make_overlap(overlap, device, sm_budget=sm_budget) if isinstance(overlap, str) else overlap
        ep = EPGroup.from_torch(group)
        self.eplb = eplb
        # Physical expert slots: the logical experts, plus the redundant replicas under eplb (``local``
        # holds every expert on each rank: one rank's placement).
        slot_ranks = 1 if dispatcher == "local" else ep.size
        self.placement: Placement | None = None
        if eplb is not None:
            self.placement = initial_placement(cfg.num_experts, slot_ranks, eplb)
        num_slots = cfg.num_experts if self.placement is None else self.placement.num_physical
        self.dispatcher = make_dispatcher(dispatcher, num_slots, ep, **(dispatcher_options or {}))
        self.router = Router(cfg, device=device)
        self.experts = RoutedExperts(
            self.dispatcher.num_local_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dtype=dtype,
            device=device,
            fp8=expert_dtype == "fp8",
        )
        self.dispatcher.deliver_fp8 = self.experts.fp8 and self.dispatcher.sends_fp8
        self.shared_experts = (
            SharedExperts(cfg.hidden_size, cfg.shared_intermediate_size, dtype=dtype, device=device)
            if cfg.num_shared_experts
            else None
        )
        self.last_traffic = Traffic()  # of the last forward (of both micro-batches after a TBO forward)
        if self.placement is not None and eplb is not None:
            self.load_window = LoadWindow(cfg.num_experts, eplb.window, device)
            ep = self.dispatcher.ep  # node_aware's may set its own ranks_per_node
            self.replicas = ReplicaTable(self.placement, ep.rank, device, ranks_per_node=ep.node_size)
            self.forwards_since_rebalance = 0
            self.last_masked_tokens = torch.zeros((), dtype=torch.int64, device=device)
        if seed is not None:  # None: left uninitialised for load_weights (no time spent on random weights)
            self.reset_parameters(seed)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """``x_TH`` [T, H] in the layer's dtype and device -> ``[T, H]``. T may differ per rank, or be 0."""
        y_TH = run_to_end(self.stages(x_TH))
        if self.eplb is not None and self.eplb.rebalance_every is not None:
            self.forwards_since_rebalance += 1
            if self.forwards_since_rebalance >= self.eplb.rebalance_every:
                self.rebalance()  # between forwards: every rank counts the same forwards
        return y_TH

    def stages(self, x_TH: torch.Tensor, dispatcher: Dispatcher | None = None) -> Generator[None, None, torch.Tensor]:
        """The forward, pausing (``yield``) while each transfer is in flight; returns ``[T, H]``.

        ``forward`` runs it straight through. Two-batch overlap (``overlap/tbo.py``) interleaves two
        of these, micro-batch B's with ``dispatcher=`` a twin of ``self.dispatcher`` (its own hooks,
        the same buffers: ``overlap.tbo.dispatcher_for(layer, 1)``).
        """
        self._check_input(x_TH)
        if dispatcher is None:
            dispatcher = self.dispatcher
        with dispatcher.hooks.scope() as forward_hooks:  # the strategy's hooks end with this forward
            shared = self.overlap.attach(forward_hooks, self.shared_experts, x_TH)
            topk = self.router(x_TH)
            ids_TK, weights_TK = self.route(topk.topk_ids_TK, topk.topk_weights_TK)
            pending = dispatcher.dispatch_launch(x_TH, ids_TK, weights_TK)
            yield  # dispatch in flight
            recv = dispatcher.dispatch_wait(pending)
            expert_y_RH = self.experts.forward_dispatched(recv)  # [R, H], grouped by local expert
            pending = dispatcher.combine_launch(expert_y_RH, recv.handle)
            yield  # combine in flight
            routed_TH = dispatcher.combine_wait(pending)
            shared_TH = shared.result()
        self.last_traffic = dispatcher.last_traffic
        return routed_TH if shared_TH is None else routed_TH + shared_TH

    def sibling_dispatcher(self, **options: Any) -> Dispatcher:
        """A dispatcher of this layer's scheme over its EP group, for the same experts: the layer's
        dispatcher options, ``options`` replacing any of them. E.g. a ``low_latency`` capacity
        (``max_tokens_per_rank``) for half the batch, which two-batch overlap's micro-batches use
        (``overlap.tbo.tbo_forward(..., dispatcher=)``) so that each sends half-size blocks, with the
        layer's weights and its fp8 dispatch, transport and kernels. Rows reach the experts as the
        layer's own dispatcher delivers them (fp8 kept for FP8 experts)."""
        own = self.dispatcher
        sibling = make_dispatcher(own.name, own.num_experts, own.ep, **{**own.options, **options})
        sibling.deliver_fp8 = self.experts.fp8 and sibling.sends_fp8
        return sibling

    # ---- weights ---------------------------------------------------------------------------------

    @property
    def local_expert_ids(self) -> Sequence[int]:
        """The logical experts of this rank's slots, in slot order (a range when contiguous)."""
        first = self.dispatcher.first_local_expert
        if self.placement is None:
            return range(first, first + self.dispatcher.num_local_experts)
        ids = self.placement.rank_logical_ids(self.dispatcher.ep.rank)
        return range(ids[0], ids[-1] + 1) if list(ids) == list(range(ids[0], ids[-1] + 1)) else ids

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Seeded random weights; expert e gets the same values on whichever rank owns it (``weights.py``)."""
        seed_weights(self, seed)

    def load_weights(self, weights: MoEWeights, *, expert_ids: Sequence[int] | None = None) -> None:
        """Set every weight from ``weights``.

        Routed experts: either all E (``gate_up_proj_E2IH`` [E, 2I, H]; this rank keeps its own
        slice) or exactly this rank's L experts ([L, 2I, H], in ``local_expert_ids`` order). Pass
        ``expert_ids`` to say which experts the tensors hold; it is then checked against
        ``local_expert_ids``, so one rank's read cannot be loaded into another rank's layer.
        """
        load_weights(self, weights, expert_ids)

    # ---- expert load balancing -------------------------------------------------------------------

    def route(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logical ids and weights [T, K] -> (physical slots to send to, weights):
        unchanged without eplb; with eplb the routing is first counted into the load window. Experts
        a partial placement lacks (elastic EP, degraded: ``ReplicaTable.masked_E``) get weight 0, so
        they drop out of each token's sum; ``last_masked_tokens`` counts the tokens that lost one
        (a device scalar). Device-side only: graph-capturable."""
        if self.eplb is None:
            return ids_TK, weights_TK
        slots_TK = route_to_slots(ids_TK, self.load_window, self.replicas)
        if self.replicas.any_masked:
            masked_TK = self.replicas.masked_E[ids_TK]
            weights_TK = weights_TK.masked_fill(masked_TK, 0)
            self.last_masked_tokens = masked_TK.any(1).sum()
        return slots_TK, weights_TK

    def expert_load(self, all_ranks: bool = False) -> torch.Tensor:
        """``[E]`` int64 tokens per logical expert over the load window: this rank's tokens, or with
        ``all_ranks`` the EP group's (an all-reduce: every rank must call it)."""
        if self.eplb is None:
            raise ValueError("expert_load needs expert load balancing; build the layer with eplb=EPLBOptions()")
        load_E = self.load_window.total()
        return all_reduce_load(load_E, self.dispatcher.ep.group) if all_ranks else load_E

    def rebalance(self, placement: Placement | None = None) -> MoveReport:
        """Move to ``placement`` (default: the one ``eplb.policy`` computes from the EP group's load
        window), between forwards, on every rank of the EP group: only experts that change rank travel,
        rank to rank; the weights and replica tables are rewritten in place, so CUDA graphs captured
        before keep working. All or nothing: on a failure the old placement keeps serving."""
        if self.eplb is None or self.placement is None:
            raise ValueError("rebalance needs expert load balancing; build the layer with eplb=EPLBOptions()")
        if self.placement.missing_experts():
            raise ValueError(
                f"experts {list(self.placement.missing_experts())} have no slot (elastic EP, degraded); restore "
                "them first (moe_sbo.launch.elastic.ElasticMoE.restore)"
            )
        ep = self.dispatcher.ep
        if placement is None:
            load_E = self.expert_load(all_ranks=True).double().cpu()
            placement = self.eplb.placement_for(load_E, ep.size, num_groups=self.cfg.n_group)
        check_fits(self.placement, placement, self.eplb.redundant_per_rank)
        check_same_placement(placement, ep.group, self.router.weight.device)
        report = move_expert_slots(self.experts.slot_tensors(), self.placement, placement, ep.rank, ep.group)
        self.replicas.update(placement)
        self.placement = placement
        self.forwards_since_rebalance = 0
        return report

    def _check_input(self, x_TH: torch.Tensor) -> None:
        if not isinstance(x_TH, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [T, H], got {type(x_TH).__name__}")
        if x_TH.dim() != 2 or x_TH.shape[1] != self.cfg.hidden_size:
            raise ValueError(
                f"x must be [T, {self.cfg.hidden_size}] (hidden size of {self.cfg.name}), got shape "
                f"{tuple(x_TH.shape)}; flatten batch and sequence, and check the preset"
            )
        if x_TH.dtype != self.dtype:
            raise TypeError(f"x must have the layer's dtype {self.dtype}, got {x_TH.dtype}; use x.to({self.dtype})")
        device = self.router.weight.device
        if x_TH.device != device:
            raise ValueError(f"x must be on the layer's device {device}, got {x_TH.device}; use x.to('{device}')")

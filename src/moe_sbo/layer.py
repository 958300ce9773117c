"""The expert-parallel MoE layer: router, routed experts spread over the EP group, shared experts.

Legend (used in every module): T tokens on this rank, H hidden, I expert intermediate, E routed
experts (global), L experts local to this rank, K top-k, R (token, local expert) rows this rank's
experts compute, P ranks in the EP group.

One forward, as in DESIGN.md §2::

    x [T, H] -> router -> topk ids/weights [T, K]
             -> dispatch (launch, wait)      rows for my L experts, grouped by expert [R, H]
             -> routed experts (grouped GEMM)                                         [R, H]
             -> combine (launch, wait)       weighted sum back on the tokens' rank    [T, H]
             -> + shared experts(x)                                                   [T, H]

The layer never touches ranks or streams: the dispatcher owns communication, and the overlap
strategy (``overlap=``) decides where the shared experts run by attaching hooks to the dispatcher
for the length of one forward (``moe_sbo.overlap.sbo``); the layer only reads their output at the end.
The hard part this file owns is weights: every rank must hold bit-identical weights for the experts
it owns, so random initialisation is seeded per expert, not per rank.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
from torch import nn

from .config import MoEConfig
from .dispatch import EPGroup, Traffic, make_dispatcher
from .experts import RoutedExperts, SharedExperts
from .overlap import Overlap, make_overlap
from .routing import Router


@dataclass(frozen=True)
class MoEWeights:
    """Weights of one MoE layer, Hugging Face layout: every expert, or one rank's experts only.

    ``router_weight_EH`` [E, H]; ``e_score_correction_bias_E`` [E] or None; ``gate_up_proj_E2IH``
    [E, 2I, H] (gate rows first); ``down_proj_EHI`` [E, H, I]; ``shared_gate_up_proj_2SH`` [2S, H]
    and ``shared_down_proj_HS`` [H, S] with S = I * num_shared_experts, or None without shared experts.
    A per-rank checkpoint read (``checkpoint.py``) gives the two routed-expert tensors with L rows,
    this rank's experts in order, instead of E; ``MoELayer.load_weights`` accepts either.
    """

    router_weight_EH: torch.Tensor
    e_score_correction_bias_E: torch.Tensor | None
    gate_up_proj_E2IH: torch.Tensor
    down_proj_EHI: torch.Tensor
    shared_gate_up_proj_2SH: torch.Tensor | None = None
    shared_down_proj_HS: torch.Tensor | None = None


class MoELayer(nn.Module):
    """A DeepSeek-style MoE layer whose routed experts are split over ``group`` by ``dispatcher``.

    ``dispatcher``: ``local`` (all experts here, the reference), ``allgather``, ``alltoall`` or
    ``low_latency``; ``dispatcher_options``: keyword options for it (e.g. ``max_tokens_per_rank``).
    ``group``: a ``torch.distributed`` group (``None``: the default group, or one rank when
    ``torch.distributed`` is not initialised). ``overlap``: where the shared experts run, one of
    ``moe_sbo.overlap.OVERLAP_MODES`` or a strategy from ``make_overlap``; ``sm_budget`` is the SMs
    ``combine_sm`` leaves the shared experts. Weights are random from ``seed`` (identical on every
    rank for the same expert) until ``load_weights`` sets them.
    """

    def __init__(self, cfg: MoEConfig, *, dispatcher: str = "local", group=None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 seed: int = 0, overlap: str | Overlap = "none", sm_budget: int | None = None,
                 dispatcher_options: dict | None = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.overlap = make_overlap(overlap, device, sm_budget=sm_budget) if isinstance(overlap, str) else overlap
        self._dispatcher_options = dict(dispatcher_options or {})
        self.dispatcher = make_dispatcher(dispatcher, cfg.num_experts, EPGroup.from_torch(group),
                                          **self._dispatcher_options)
        self._twin_dispatcher = None  # made on first use by micro-batch 1 (two-batch overlap)
        self.router = Router(cfg, device=device)
        self.experts = RoutedExperts(self.dispatcher.num_local_experts, cfg.hidden_size,
                                     cfg.moe_intermediate_size, dtype=dtype, device=device)
        self.shared_experts = (
            SharedExperts(cfg.hidden_size, cfg.shared_intermediate_size, dtype=dtype, device=device)
            if cfg.num_shared_experts else None
        )
        self.last_traffic = Traffic()  # of the last forward (of both micro-batches after a TBO forward)
        self.micro_batch_traffic = {0: Traffic(), 1: Traffic()}
        self.reset_parameters(seed)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """``x_TH`` [T, H] in the layer's dtype and device -> ``[T, H]``. T may differ per rank, or be 0."""
        return run_to_end(self.stages(x_TH))

    def stages(self, x_TH: torch.Tensor, micro_batch: int = 0) -> Generator[None, None, torch.Tensor]:
        """The forward, pausing (``yield``) while each transfer is in flight; returns ``[T, H]``.

        ``forward`` runs it straight through. Two-batch overlap (``overlap/tbo.py``) interleaves two
        of these, one per ``micro_batch``, each with its own dispatcher (own hooks and buffers).
        """
        self._check_input(x_TH)
        dispatcher = self.dispatcher_for(micro_batch)
        with dispatcher.hooks.scope() as forward_hooks:  # the strategy's hooks end with this forward
            shared = self.overlap.attach(forward_hooks, self.shared_experts, x_TH)
            topk = self.router(x_TH)
            pending = dispatcher.dispatch_launch(x_TH, topk.topk_ids_TK, topk.topk_weights_TK)
            yield  # dispatch in flight
            recv = dispatcher.dispatch_wait(pending)
            expert_y_RH = self.experts(recv.expert_x_RH, recv.num_rows_per_expert_L)
            pending = dispatcher.combine_launch(expert_y_RH, recv.handle)
            yield  # combine in flight
            routed_TH = dispatcher.combine_wait(pending)
            shared_TH = shared.result()
        self.last_traffic = self.micro_batch_traffic[micro_batch] = recv.handle.traffic
        return routed_TH if shared_TH is None else routed_TH + shared_TH

    def dispatcher_for(self, micro_batch: int):
        """Micro-batch 0 uses ``self.dispatcher``; micro-batch 1 a twin (same group, own hooks and buffers)."""
        if micro_batch == 0:
            return self.dispatcher
        if micro_batch != 1:
            raise ValueError(f"micro_batch must be 0 or 1 (two-batch overlap), got {micro_batch}")
        if self._twin_dispatcher is None:
            self._twin_dispatcher = make_dispatcher(self.dispatcher.name, self.cfg.num_experts, self.dispatcher.ep,
                                                    **self._dispatcher_options)
        return self._twin_dispatcher

    # ---- weights ---------------------------------------------------------------------------------

    @property
    def local_expert_ids(self) -> range:
        first = self.dispatcher.first_local_expert
        return range(first, first + self.dispatcher.num_local_experts)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Seeded random weights; expert e gets the same values on whichever rank owns it."""
        cfg, device = self.cfg, self.router.weight.device
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.router.weight.copy_(_randn((cfg.num_experts, h), h ** -0.5, seed, "router", 0, device))
        # noaux_tc's bias is non-zero in trained models; a zero bias would leave its code path untested.
        self.router.e_score_correction_bias.copy_(
            _randn((cfg.num_experts,), 0.05, seed, "bias", 0, device)
        )
        for local, expert in enumerate(self.local_expert_ids):
            self.experts.gate_up_proj[local].copy_(_randn((2 * i, h), h ** -0.5, seed, "gate_up", expert, device))
            self.experts.down_proj[local].copy_(_randn((h, i), i ** -0.5, seed, "down", expert, device))
        if self.shared_experts is not None:
            s = cfg.shared_intermediate_size
            self.shared_experts.gate_up_proj.copy_(_randn((2 * s, h), h ** -0.5, seed, "shared_gate_up", 0, device))
            self.shared_experts.down_proj.copy_(_randn((h, s), s ** -0.5, seed, "shared_down", 0, device))

    @torch.no_grad()
    def load_weights(self, weights: MoEWeights, *, expert_ids: range | None = None) -> None:
        """Set every weight from ``weights``.

        Routed experts: either all E (``gate_up_proj_E2IH`` [E, 2I, H]; this rank keeps its own
        slice) or exactly this rank's L experts ([L, 2I, H], in ``local_expert_ids`` order). Pass
        ``expert_ids`` to say which experts the tensors hold; it is then checked against
        ``local_expert_ids``, so one rank's read cannot be loaded into another rank's layer.
        """
        cfg = self.cfg
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        local = self.local_expert_ids
        held = weights.gate_up_proj_E2IH.shape[0]
        mine = _expert_rows(held, e, local, expert_ids)
        _check_shape("router_weight_EH", weights.router_weight_EH, (e, h))
        _check_shape("gate_up_proj_E2IH", weights.gate_up_proj_E2IH, (held, 2 * i, h))
        _check_shape("down_proj_EHI", weights.down_proj_EHI, (held, h, i))
        self.router.weight.copy_(weights.router_weight_EH)
        if weights.e_score_correction_bias_E is not None:
            _check_shape("e_score_correction_bias_E", weights.e_score_correction_bias_E, (e,))
            self.router.e_score_correction_bias.copy_(weights.e_score_correction_bias_E)
        self.experts.gate_up_proj.copy_(weights.gate_up_proj_E2IH[mine])
        self.experts.down_proj.copy_(weights.down_proj_EHI[mine])
        if self.shared_experts is not None:
            s = cfg.shared_intermediate_size
            if weights.shared_gate_up_proj_2SH is None or weights.shared_down_proj_HS is None:
                raise ValueError(
                    f"{cfg.name} has {cfg.num_shared_experts} shared experts, but the weights have none; "
                    "set shared_gate_up_proj_2SH and shared_down_proj_HS"
                )
            _check_shape("shared_gate_up_proj_2SH", weights.shared_gate_up_proj_2SH, (2 * s, h))
            _check_shape("shared_down_proj_HS", weights.shared_down_proj_HS, (h, s))
            self.shared_experts.gate_up_proj.copy_(weights.shared_gate_up_proj_2SH)
            self.shared_experts.down_proj.copy_(weights.shared_down_proj_HS)

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


def run_to_end(stages: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """Run a ``stages`` generator without pausing; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def _randn(shape: tuple[int, ...], std: float, seed: int, tag: str, index: int,
           device: torch.device) -> torch.Tensor:
    """Normal(0, std) values that depend only on (seed, tag, index, device type)."""
    tag_id = sum((n + 1) * ord(c) for n, c in enumerate(tag))  # stable across processes, unlike hash()
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + tag_id * 65_537 + index)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std


def _expert_rows(held: int, num_experts: int, local: range, expert_ids: range | None) -> slice:
    """Rows of routed-expert tensors holding ``held`` experts that belong to this rank's ``local`` ones."""
    if expert_ids is None:
        expert_ids = range(num_experts) if held == num_experts else local if held == len(local) else None
    elif len(expert_ids) != held:
        raise ValueError(f"expert_ids must name one expert per row, got {len(expert_ids)} ids for {held} rows")
    if expert_ids == range(num_experts):
        return slice(local.start, local.stop)
    if expert_ids != local:
        got = f"experts {expert_ids.start}..{expert_ids.stop - 1}" if expert_ids else f"{held} experts"
        raise ValueError(
            f"routed-expert weights must hold all {num_experts} experts or this rank's experts "
            f"{local.start}..{local.stop - 1}, got {got}; read the experts of layer.local_expert_ids"
        )
    return slice(None)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}; check the checkpoint's model")

"""Weights of one MoE layer: the Hugging Face-layout container, seeded random weights, and loading.

The hard part is agreement across ranks: every rank must hold bit-identical weights for the experts
it owns, so random weights are seeded per expert (``seeded_normal``), never per rank, and a per-rank
checkpoint read is checked against the experts the rank owns before anything is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import MoEConfig
from .experts import RoutedExperts, SharedExperts
from .quant.fp8 import FP8_BLOCK
from .routing.router import Router


@dataclass(frozen=True)
class MoEWeights:
    """Weights of one MoE layer, Hugging Face layout: every expert, or one rank's experts only.

    ``router_weight_EH`` [E, H]; ``e_score_correction_bias_E`` [E] or None; ``gate_up_proj_E2IH``
    [E, 2I, H] (gate rows first); ``down_proj_EHI`` [E, H, I]; ``shared_gate_up_proj_2JH`` [2J, H]
    and ``shared_down_proj_HJ`` [H, J] with J = I * num_shared_experts, or None without shared experts.
    A per-rank checkpoint read (``hf/checkpoint.py``) gives the two routed-expert tensors with L rows,
    this rank's experts in order, instead of E; ``MoELayer.load_weights`` accepts either.
    FP8 routed experts: the two tensors are float8 e4m3 and ``gate_up_proj_scale_inv`` [E, 2I/128,
    H/128] and ``down_proj_scale_inv`` [E, H/128, I/128] hold one float32 scale per 128x128 block
    (``quant/fp8.py``); a layer with dense experts dequantises them, one with FP8 experts keeps them.
    """

    router_weight_EH: torch.Tensor
    e_score_correction_bias_E: torch.Tensor | None
    gate_up_proj_E2IH: torch.Tensor
    down_proj_EHI: torch.Tensor
    shared_gate_up_proj_2JH: torch.Tensor | None = None
    shared_down_proj_HJ: torch.Tensor | None = None
    gate_up_proj_scale_inv: torch.Tensor | None = None
    down_proj_scale_inv: torch.Tensor | None = None


class LayerParts(Protocol):
    """The parts of an ``MoELayer`` that seeding and loading write (a structural type, so this module
    needs nothing from the layer that uses it)."""

    cfg: MoEConfig
    router: Router
    experts: RoutedExperts
    shared_experts: SharedExperts | None

    @property
    def local_expert_ids(self) -> Sequence[int]: ...


def seeded_normal(
    shape: tuple[int, ...], std: float, seed: int, tag: str, index: int, device: torch.device
) -> torch.Tensor:
    """float32 Normal(0, std) values that depend only on (seed, tag, index, device type)."""
    tag_id = sum((n + 1) * ord(c) for n, c in enumerate(tag))  # stable across processes, unlike hash()
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + tag_id * 65_537 + index)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std


def seeded_expert(cfg: MoEConfig, seed: int, expert: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed expert ``expert``'s seeded weights (gate_up [2I, H], down [H, I]) float32, as
    ``seed_weights`` gives them to whichever rank holds it."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return (
        seeded_normal((2 * i, h), h**-0.5, seed, "gate_up", expert, device),
        seeded_normal((h, i), i**-0.5, seed, "down", expert, device),
    )


@torch.no_grad()
def seed_weights(layer: LayerParts, seed: int) -> None:
    """Seeded random weights into ``layer``, one expert at a time (no second copy of all experts).

    Expert e gets the same values whichever rank owns it. The router bias is non-zero, as in trained
    models: a zero bias would leave ``noaux_tc``'s correction untested.
    """
    cfg, device = layer.cfg, layer.router.weight.device
    h = cfg.hidden_size
    layer.router.weight.copy_(seeded_normal((cfg.num_experts, h), h**-0.5, seed, "router", 0, device))
    layer.router.e_score_correction_bias.copy_(seeded_normal((cfg.num_experts,), 0.05, seed, "bias", 0, device))
    for local, expert in enumerate(layer.local_expert_ids):  # FP8 experts quantise each one in 128x128 blocks
        layer.experts.set_expert(local, *seeded_expert(cfg, seed, expert, device))
    if layer.shared_experts is not None:
        j = cfg.shared_intermediate_size
        layer.shared_experts.gate_up_proj.copy_(seeded_normal((2 * j, h), h**-0.5, seed, "shared_gate_up", 0, device))
        layer.shared_experts.down_proj.copy_(seeded_normal((h, j), j**-0.5, seed, "shared_down", 0, device))


@torch.no_grad()
def load_weights(layer: LayerParts, weights: MoEWeights, expert_ids: Sequence[int] | None = None) -> None:
    """Copy ``weights`` into ``layer`` (see ``MoELayer.load_weights``); shapes checked before any copy."""
    cfg = layer.cfg
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    held = weights.gate_up_proj_E2IH.shape[0]
    mine = expert_rows(held, e, layer.local_expert_ids, expert_ids)
    check_shape("router_weight_EH", weights.router_weight_EH, (e, h))
    check_shape("gate_up_proj_E2IH", weights.gate_up_proj_E2IH, (held, 2 * i, h))
    check_shape("down_proj_EHI", weights.down_proj_EHI, (held, h, i))
    layer.router.weight.copy_(weights.router_weight_EH)
    if weights.e_score_correction_bias_E is not None:
        check_shape("e_score_correction_bias_E", weights.e_score_correction_bias_E, (e,))
        layer.router.e_score_correction_bias.copy_(weights.e_score_correction_bias_E)
    scales = weights.gate_up_proj_scale_inv, weights.down_proj_scale_inv
    if (scales[0] is None) != (scales[1] is None):
        raise ValueError("FP8 routed experts need both gate_up_proj_scale_inv and down_proj_scale_inv, got one")
    if scales[0] is not None and scales[1] is not None:
        blocks = -(-2 * i // FP8_BLOCK), -(-h // FP8_BLOCK), -(-i // FP8_BLOCK)
        check_shape("gate_up_proj_scale_inv", scales[0], (held, blocks[0], blocks[1]))
        check_shape("down_proj_scale_inv", scales[1], (held, blocks[1], blocks[2]))
    if weights.gate_up_proj_E2IH is layer.experts.gate_up_proj and weights.down_proj_EHI is layer.experts.down_proj:
        mine = []  # read straight into this layer (LayerLoader): nothing to copy
    for local, row in enumerate(mine):  # one expert at a time: a format change copies one matrix
        layer.experts.set_expert(
            local,
            weights.gate_up_proj_E2IH[row],
            weights.down_proj_EHI[row],
            None if scales[0] is None else scales[0][row],
            None if scales[1] is None else scales[1][row],
        )
    if layer.shared_experts is not None:
        j = cfg.shared_intermediate_size
        if weights.shared_gate_up_proj_2JH is None or weights.shared_down_proj_HJ is None:
            raise ValueError(
                f"{cfg.name} has {cfg.num_shared_experts} shared experts, but the weights have none; "
                "set shared_gate_up_proj_2JH and shared_down_proj_HJ"
            )
        check_shape("shared_gate_up_proj_2JH", weights.shared_gate_up_proj_2JH, (2 * j, h))
        check_shape("shared_down_proj_HJ", weights.shared_down_proj_HJ, (h, j))
        layer.shared_experts.gate_up_proj.copy_(weights.shared_gate_up_proj_2JH)
        layer.shared_experts.down_proj.copy_(weights.shared_down_proj_HJ)


def layer_weights(layer: LayerParts) -> MoEWeights:
    """The weights ``layer`` holds, as ``MoEWeights`` with this rank's L experts (views, not copies);
    FP8 experts come with their block scales."""
    experts, shared = layer.experts, layer.shared_experts
    return MoEWeights(
        router_weight_EH=layer.router.weight,
        e_score_correction_bias_E=layer.router.e_score_correction_bias,
        gate_up_proj_E2IH=experts.gate_up_proj,
        down_proj_EHI=experts.down_proj,
        shared_gate_up_proj_2JH=None if shared is None else shared.gate_up_proj,
        shared_down_proj_HJ=None if shared is None else shared.down_proj,
        gate_up_proj_scale_inv=experts.gate_up_proj_scale_inv if experts.fp8 else None,
        down_proj_scale_inv=experts.down_proj_scale_inv if experts.fp8 else None,
    )


def expert_rows(held: int, num_experts: int, local: Sequence[int], expert_ids: Sequence[int] | None) -> list[int]:
    """Rows of routed-expert tensors holding ``held`` experts that this rank's slots take, in slot
    order: ``local`` (this rank's experts, one per slot) from all E rows, or every row when the tensors
    hold exactly this rank's experts."""
    if expert_ids is None:
        expert_ids = range(num_experts) if held == num_experts else local if held == len(local) else None
    elif len(expert_ids) != held:
        raise ValueError(f"expert_ids must name one expert per row, got {len(expert_ids)} ids for {held} rows")
    if expert_ids is not None and list(expert_ids) == list(range(num_experts)):
        return list(local)
    if expert_ids is None or list(expert_ids) != list(local):
        got = f"experts {_describe(expert_ids)}" if expert_ids else f"{held} experts"
        raise ValueError(
            f"routed-expert weights must hold all {num_experts} experts or this rank's experts "
            f"{_describe(local)}, got {got}; read the experts of layer.local_expert_ids"
        )
    return list(range(held))


def _describe(ids: Sequence[int]) -> str:
    """``3..7`` for a contiguous run, else the ids."""
    ids = list(ids)
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """``ValueError`` naming ``name`` unless ``tensor`` has shape ``expected``."""
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)}; check the checkpoint's model")

"""``transformers``' MoE blocks and ours: ``MoEWeights`` from a DeepSeek-V2/V3 or Qwen3-MoE block,
and the reverse, ``transformers``' own block built around given weights (the reference
``moe-sbo check`` and the parity tests compare with).

The hard part is building the reference without a second copy: the block is made on the meta device
and takes the given tensors as they are (``assign=True``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..weights import MoEWeights
from .config import model_family


@torch.no_grad()
def weights_from_hf_moe(block: torch.nn.Module) -> MoEWeights:
    """``MoEWeights`` of a ``transformers`` MoE block (``DeepseekV3MoE``, ``DeepseekV2Moe``,
    ``Qwen3MoeSparseMoeBlock``): router ``gate``, fused ``experts``, optional ``shared_experts``."""
    gate: Any = block.gate  # transformers' submodules, typed by nn.Module as Tensor | Module
    experts: Any = block.experts
    shared = getattr(block, "shared_experts", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    return MoEWeights(
        router_weight_EH=gate.weight.detach(),
        e_score_correction_bias_E=bias.detach() if bias is not None else None,
        gate_up_proj_E2IH=experts.gate_up_proj.detach(),
        down_proj_EHI=experts.down_proj.detach(),
        shared_gate_up_proj_2JH=(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach() if shared is not None else None
        ),
        shared_down_proj_HJ=shared.down_proj.weight.detach() if shared is not None else None,
    )


def reference_moe_block(config: dict, weights: MoEWeights) -> torch.nn.Module:
    """``transformers``' own MoE block for ``config`` (a ``config.json`` dict) holding ``weights``.

    ``weights`` must hold every expert. The block is built on the meta device and takes the given
    tensors without copying (``assign=True``), so the reference costs one copy of the layer's weights;
    it computes in the tensors' dtype (float32 for ``moe-sbo check``). Kimi-K2 uses DeepSeek-V3's
    classes, as its ``config.json`` says.
    """
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config_cls, block_cls = {
        "deepseek_v2": (DeepseekV2Config, DeepseekV2Moe),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3MoE),
        "kimi_k2": (DeepseekV3Config, DeepseekV3MoE),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock),
    }[model_family(config)]
    hf_config = config_cls(**{k: v for k, v in config.items() if k not in ("model_type", "auto_map")})
    hf_config._experts_implementation = "eager"  # the plain per-expert loop: the most literal reference
    state = {
        "gate.weight": weights.router_weight_EH,
        "experts.gate_up_proj": weights.gate_up_proj_E2IH,
        "experts.down_proj": weights.down_proj_EHI,
    }
    if weights.e_score_correction_bias_E is not None and block_cls is DeepseekV3MoE:
        state["gate.e_score_correction_bias"] = weights.e_score_correction_bias_E
    if block_cls is not Qwen3MoeSparseMoeBlock:
        if weights.shared_gate_up_proj_2JH is None or weights.shared_down_proj_HJ is None:
            raise ValueError(
                f"weights must hold shared experts for {block_cls.__name__} (it always has them), got "
                "shared_gate_up_proj_2JH or shared_down_proj_HJ None; pass the weights of the whole block"
            )
        gate_JH, up_JH = weights.shared_gate_up_proj_2JH.chunk(2)
        state.update(
            {
                "shared_experts.gate_proj.weight": gate_JH,
                "shared_experts.up_proj.weight": up_JH,
                "shared_experts.down_proj.weight": weights.shared_down_proj_HJ,
            }
        )
    with torch.device("meta"):
        block = block_cls(hf_config)
    block.load_state_dict(state, assign=True)
    return block.eval()

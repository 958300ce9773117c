"""Hugging Face interop: an ``MoEConfig`` from a ``transformers`` config (object or ``config.json``
dict), and ``MoEWeights`` from a ``transformers`` MoE block of DeepSeek-V2/V3 or Qwen3-MoE.

The hard part is that the families spell the same knob differently and leave some implicit:
DeepSeek-V3 (and Kimi-K2, which reuses its architecture) always routes with sigmoid ``noaux_tc``
whatever ``topk_method`` says; DeepSeek-V2 uses softmax with its ``topk_method``; Qwen3-MoE has no
groups, no shared experts and no scaling factor, and counts experts as ``num_experts``.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import MoEConfig
from .layer import MoEWeights

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "qwen3_moe")


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


ARCHITECTURE_MODEL_TYPES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def config_from_hf(config: Any, name: str | None = None) -> MoEConfig:
    """``MoEConfig`` from a ``transformers`` config object or a parsed ``config.json`` dict.

    The family comes from ``model_type`` (else ``architectures``); a file naming neither is read
    DeepSeek-style, with its own ``topk_method``/``scoring_func`` fields.
    """
    architectures = _get(config, "architectures", default=[]) or []
    model_type = _get(config, "model_type", default="") or next(
        (ARCHITECTURE_MODEL_TYPES[a] for a in architectures if a in ARCHITECTURE_MODEL_TYPES), "")
    if model_type and model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
            "moe-sbo reads DeepSeek-V2/V3, Kimi-K2 and Qwen3-MoE configs"
        )
    num_experts = _get(config, "n_routed_experts", "num_experts", "num_local_experts")
    for label, value in (("hidden_size", _get(config, "hidden_size")),
                         ("moe_intermediate_size", _get(config, "moe_intermediate_size")),
                         ("n_routed_experts or num_experts", num_experts),
                         ("num_experts_per_tok", _get(config, "num_experts_per_tok"))):
        if value is None:
            raise ValueError(
                f"model config must have {label}, got a config without it; pass the config.json of a "
                "DeepSeek-V2/V3, Kimi-K2 or Qwen3-MoE model, or a preset"
            )
    common = dict(
        name=name or model_type or "hf",
        hidden_size=int(_get(config, "hidden_size")),
        moe_intermediate_size=int(_get(config, "moe_intermediate_size")),
        num_experts=int(num_experts),
        num_experts_per_tok=int(_get(config, "num_experts_per_tok")),
        num_hidden_layers=int(_get(config, "num_hidden_layers", default=1)),
        norm_topk_prob=bool(_get(config, "norm_topk_prob", default=False)),
        hf_architecture=architectures[0] if architectures else "",
    )
    if model_type == "qwen3_moe":  # no groups, no shared experts, no scaling factor
        return MoEConfig(**common, num_shared_experts=0, topk_method="greedy", scoring_func="softmax",
                         first_k_dense_replace=0)
    # DeepSeek-V3's modelling code routes with sigmoid noaux_tc whatever the file says.
    v3_like = model_type in ("deepseek_v3", "kimi_k2")
    return MoEConfig(
        **common,
        num_shared_experts=int(_get(config, "n_shared_experts", default=0)),
        topk_method="noaux_tc" if v3_like else _get(config, "topk_method", default="greedy"),
        scoring_func="sigmoid" if v3_like else _get(config, "scoring_func", default="softmax"),
        routed_scaling_factor=float(_get(config, "routed_scaling_factor", default=1.0)),
        n_group=int(_get(config, "n_group", default=1)),
        topk_group=int(_get(config, "topk_group", default=1)),
        first_k_dense_replace=int(_get(config, "first_k_dense_replace", default=0)),
    )


@torch.no_grad()
def weights_from_hf_moe(block: torch.nn.Module) -> MoEWeights:
    """``MoEWeights`` of a ``transformers`` MoE block (``DeepseekV3MoE``, ``DeepseekV2Moe``,
    ``Qwen3MoeSparseMoeBlock``): router ``gate``, fused ``experts``, optional ``shared_experts``."""
    shared = getattr(block, "shared_experts", None)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    return MoEWeights(
        router_weight_EH=block.gate.weight.detach(),
        e_score_correction_bias_E=bias.detach() if bias is not None else None,
        gate_up_proj_E2IH=block.experts.gate_up_proj.detach(),
        down_proj_EHI=block.experts.down_proj.detach(),
        shared_gate_up_proj_2SH=(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach() if shared is not None else None
        ),
        shared_down_proj_HS=shared.down_proj.weight.detach() if shared is not None else None,
    )

"""Small randomly initialised ``transformers`` MoE blocks, the references no one here wrote."""

from __future__ import annotations

import torch


def make_hf_block(family: str, seed: int = 0, **overrides):
    """(block, hf_config) for family in deepseek_v3 / deepseek_v2_greedy / deepseek_v2_group / qwen3_moe."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=4)
    common.update(overrides)
    if family == "deepseek_v3":
        config = DeepseekV3Config(**common, n_routed_experts=16, n_shared_experts=2, n_group=4,
                                  topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                  first_k_dense_replace=1)
        block_cls = DeepseekV3MoE
    elif family.startswith("deepseek_v2"):
        grouped = family == "deepseek_v2_group"
        config = DeepseekV2Config(**common, n_routed_experts=16, n_shared_experts=2,
                                  n_group=4 if grouped else 1, topk_group=2 if grouped else 1,
                                  topk_method="group_limited_greedy" if grouped else "greedy",
                                  norm_topk_prob=False, routed_scaling_factor=16.0 if grouped else 1.0,
                                  first_k_dense_replace=1)
        block_cls = DeepseekV2Moe
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=16, norm_topk_prob=True)
        block_cls = Qwen3MoeSparseMoeBlock
    else:
        raise ValueError(family)
    generator = torch.Generator().manual_seed(seed)
    block = block_cls(config).float()
    with torch.no_grad():
        for name, param in block.named_parameters():
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=generator) * fan_in ** -0.5)
        gate = block.gate
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape,
                                                           generator=generator) * 0.1)
    return block.eval(), config


FAMILIES = ("deepseek_v3", "deepseek_v2_greedy", "deepseek_v2_group", "qwen3_moe")

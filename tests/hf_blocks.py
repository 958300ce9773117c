"""Small randomly initialised ``transformers`` MoE blocks, the references no one here wrote."""

from __future__ import annotations

import torch


def make_hf_block(family: str, seed: int = 0, **overrides):
    """(block, hf_config) for family in deepseek_v3 / deepseek_v2_greedy / deepseek_v2_group / qwen3_moe."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts_per_tok=4,
    )
    common.update(overrides)
    if family == "deepseek_v3":
        config = DeepseekV3Config(
            **common,
            n_routed_experts=16,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
        )
        block_cls = DeepseekV3MoE
    elif family.startswith("deepseek_v2"):
        grouped = family == "deepseek_v2_group"
        config = DeepseekV2Config(
            **common,
            n_routed_experts=16,
            n_shared_experts=2,
            n_group=4 if grouped else 1,
            topk_group=2 if grouped else 1,
            topk_method="group_limited_greedy" if grouped else "greedy",
            norm_topk_prob=False,
            routed_scaling_factor=16.0 if grouped else 1.0,
            first_k_dense_replace=1,
        )
        block_cls = DeepseekV2Moe
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=16, norm_topk_prob=True)
        block_cls = Qwen3MoeSparseMoeBlock
    else:
        raise ValueError(family)
    generator = torch.Generator().manual_seed(seed)
    block = block_cls(config).float()
    with torch.no_grad():
        for _name, param in block.named_parameters():
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=generator) * fan_in**-0.5)
        gate = block.gate
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(
                torch.randn(gate.e_score_correction_bias.shape, generator=generator) * 0.1
            )
    return block.eval(), config


FAMILIES = ("deepseek_v3", "deepseek_v2_greedy", "deepseek_v2_group", "qwen3_moe")


# ---- checkpoints on disk ---------------------------------------------------------------------------

# Attention shapes kept tiny: only the MoE layers matter here, but save_pretrained writes the whole model.
_SMALL_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=64)
_SMALL_MLA = dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def make_hf_model(family: str, seed: int = 0):
    """A 2-layer ``transformers`` causal LM of ``family`` (deepseek_v3, deepseek_v2, qwen3_moe) whose
    layer 1 is MoE and layer 0 dense, every parameter (and the V3 correction bias) seeded random."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_experts_per_tok=4,
        **_SMALL_ATTENTION,
    )
    if family == "deepseek_v3":
        model = DeepseekV3ForCausalLM(
            DeepseekV3Config(
                **common,
                **_SMALL_MLA,
                n_routed_experts=16,
                n_shared_experts=2,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                first_k_dense_replace=1,
            )
        )
    elif family == "deepseek_v2":  # group-limited greedy, as DeepSeek-V2 (not Lite) routes
        model = DeepseekV2ForCausalLM(
            DeepseekV2Config(
                **common,
                **_SMALL_MLA,
                n_routed_experts=16,
                n_shared_experts=2,
                n_group=4,
                topk_group=2,
                topk_method="group_limited_greedy",
                routed_scaling_factor=16.0,
                first_k_dense_replace=1,
            )
        )
    elif family == "qwen3_moe":  # layer 0 dense through mlp_only_layers, the Qwen3 way
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=16, norm_topk_prob=True, mlp_only_layers=[0]))
    else:
        raise ValueError(family)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and (name.endswith("e_score_correction_bias") or tensor.dim() > 1):
                scale = 0.1 if tensor.dim() == 1 else tensor.shape[-1] ** -0.5
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    return model.float().eval()


def quantize_fp8_blocks(w_OU: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's weight format: float8 e4m3 values and one float32 ``scale_inv`` per block x block
    tile (tile amax / 448), so that ``fp8 * scale_inv`` of the tile approximates ``w``."""
    rows, cols = w_OU.shape
    tiles_o, tiles_u = -(-rows // block), -(-cols // block)
    padded = torch.zeros(tiles_o * block, tiles_u * block)
    padded[:rows, :cols] = w_OU.float()
    tiles = padded.view(tiles_o, block, tiles_u, block)
    scale_ou = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (tiles / scale_ou[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_ou


def write_checkpoint(path, config: dict, tensors: dict, shards: list[list[str]] | None = None):
    """``config.json`` plus ``model.safetensors`` (``shards`` None) or one file per list of names
    in ``shards`` with ``model.safetensors.index.json``, as the Hub lays out sharded models."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if shards is None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for n, names in enumerate(shards, start=1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names}, str(path / file))
        weight_map.update({k: file for k in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def published_v3_config(hidden: int, inter: int, experts: int, fp8: bool) -> dict:
    """A ``config.json`` shaped like deepseek-ai/DeepSeek-V3's, at small sizes (layer 1 is the MoE one)."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": inter,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 64,
        "torch_dtype": "bfloat16",
    }
    if fp8:
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    return config


def write_published_v3(
    path, *, fp8: bool, layout: str = "per_expert", hidden: int = 160, inter: int = 96, experts: int = 8, seed: int = 0
):
    """A DeepSeek-V3-style checkpoint of MoE layer 1 only, in three shards: experts [0, E/2), experts
    [E/2, E), then router + shared experts. ``fp8``: expert and shared weights in float8 e4m3 with
    128x128 ``weight_scale_inv`` (router bf16, bias float32, as published). ``layout="stacked"``: the
    routed experts as ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] (not FP8).

    Returns (path, originals): originals maps each weight's name to its float32 values before quantising.
    """
    generator = torch.Generator().manual_seed(seed)
    p = "model.layers.1.mlp."

    def randn(*shape, std=None):
        return torch.randn(shape, generator=generator) * (std if std is not None else shape[-1] ** -0.5)

    originals = {
        p + "gate.weight": randn(experts, hidden).bfloat16().float(),
        p + "gate.e_score_correction_bias": randn(experts, std=0.1),
    }
    halves = [[], []]
    if layout == "stacked":
        originals[p + "experts.gate_up_proj"] = randn(experts, 2 * inter, hidden)
        originals[p + "experts.down_proj"] = randn(experts, hidden, inter)
        halves = [[p + "experts.gate_up_proj"], [p + "experts.down_proj"]]  # by projection, not by expert
    else:
        for e in range(experts):
            for proj, shape in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                originals[f"{p}experts.{e}.{proj}.weight"] = randn(*shape)
                halves[e * 2 // experts].append(f"{p}experts.{e}.{proj}.weight")
    shared = [f"{p}shared_experts.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
    originals[shared[0]], originals[shared[1]], originals[shared[2]] = (
        randn(inter, hidden),
        randn(inter, hidden),
        randn(hidden, inter),
    )
    tensors = dict(originals)
    tensors[p + "gate.weight"] = originals[p + "gate.weight"].bfloat16()
    shards = [list(halves[0]), list(halves[1]), [p + "gate.weight", p + "gate.e_score_correction_bias", *shared]]
    if fp8:
        for shard in shards:
            for name in list(shard):
                if name.endswith("proj.weight"):
                    tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(originals[name])
                    shard.append(name + "_scale_inv")
    write_checkpoint(path, published_v3_config(hidden, inter, experts, fp8), tensors, shards)
    return path, originals


def write_broken_v3(tmp_path, *, fp8: bool = False, drop=(), replace=None, sharded: bool = False):
    """``write_published_v3``'s checkpoint with tensors dropped or replaced, rewritten into one
    ``model.safetensors`` (or, ``sharded``, one shard named by an index). Returns its directory."""
    import json

    from safetensors.torch import load_file

    path, _ = write_published_v3(tmp_path / "src", fp8=fp8)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for name in drop:
        tensors.pop(name)
    tensors.update(replace or {})
    config = json.loads((path / "config.json").read_text())
    return write_checkpoint(tmp_path / "broken", config, tensors, [sorted(tensors)] if sharded else None)

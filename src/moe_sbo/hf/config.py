"""Hugging Face configs: an ``MoEConfig`` from a ``transformers`` config (object or ``config.json``
dict), and which layers of that model are MoE.

The hard part is that the families spell the same knob differently and leave some implicit:
DeepSeek-V3 (and Kimi-K2, which reuses its architecture) always routes with sigmoid ``noaux_tc``
whatever ``topk_method`` says; DeepSeek-V2 uses softmax with its ``topk_method``; Qwen3-MoE has no
groups, no shared experts and no scaling factor, counts experts as ``num_experts`` (``num_local_experts``
in files ``transformers`` 5 writes), and picks its MoE layers by ``decoder_sparse_step`` and
``mlp_only_layers`` where DeepSeek uses ``first_k_dense_replace`` and ``moe_layer_freq``.
"""

from __future__ import annotations

from typing import Any

from ..config import MoEConfig

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
        (ARCHITECTURE_MODEL_TYPES[a] for a in architectures if a in ARCHITECTURE_MODEL_TYPES), ""
    )
    if model_type and model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
            "moe-sbo reads DeepSeek-V2/V3, Kimi-K2 and Qwen3-MoE configs"
        )
    num_experts = _get(config, "n_routed_experts", "num_experts", "num_local_experts")
    for label, value in (
        ("hidden_size", _get(config, "hidden_size")),
        ("moe_intermediate_size", _get(config, "moe_intermediate_size")),
        ("n_routed_experts or num_experts", num_experts),
        ("num_experts_per_tok", _get(config, "num_experts_per_tok")),
    ):
        if value is None:
            raise ValueError(
                f"model config must have {label}, got a config without it; pass the config.json of a "
                "DeepSeek-V2/V3, Kimi-K2 or Qwen3-MoE model, or a preset"
            )
    common: dict[str, Any] = dict(
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
        return MoEConfig(
            **common, num_shared_experts=0, topk_method="greedy", scoring_func="softmax", first_k_dense_replace=0
        )
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


def model_family(config: Any) -> str:
    """The supported ``model_type`` of a config (read from ``model_type``, else ``architectures``).

    Stricter than ``config_from_hf``: a config naming no supported family is an error, because a
    checkpoint's tensor names and MoE layers depend on the family.
    """
    model_type = _get(config, "model_type", default="") or ""
    architectures = _get(config, "architectures", default=[]) or []
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    for architecture in architectures:
        if architecture in ARCHITECTURE_MODEL_TYPES:
            return ARCHITECTURE_MODEL_TYPES[architecture]
    raise ValueError(
        f"model must be one of the supported families (model_type {', '.join(SUPPORTED_MODEL_TYPES)}; "
        f"architectures {', '.join(ARCHITECTURE_MODEL_TYPES)}), got model_type {model_type or None!r}, "
        f"architectures {architectures}; moe-sbo loads DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2 and Qwen3-MoE"
    )


def moe_layer_indices(config: Any) -> list[int]:
    """Indices of the decoder layers whose MLP is an MoE, by the family's own rule (see ``moe_layer_rule``)."""
    family = model_family(config)
    num_layers = int(_get(config, "num_hidden_layers", default=1))
    if family == "qwen3_moe":  # transformers' Qwen3MoeDecoderLayer
        step = int(_get(config, "decoder_sparse_step", default=1))
        dense = set(_get(config, "mlp_only_layers", default=[]) or [])
        return [n for n in range(num_layers) if n not in dense and (n + 1) % step == 0]
    # DeepSeek's own modelling code; transformers drops moe_layer_freq, which every published file sets to 1.
    first = int(_get(config, "first_k_dense_replace", default=0))
    freq = int(_get(config, "moe_layer_freq", default=1))
    return [n for n in range(first, num_layers) if n % freq == 0]


def moe_layer_rule(config: Any) -> str:
    """The rule ``moe_layer_indices`` applies, in words with this config's values (for error messages)."""
    if model_family(config) == "qwen3_moe":
        return (
            f"MoE iff layer not in mlp_only_layers={_get(config, 'mlp_only_layers', default=[]) or []} "
            f"and (layer + 1) % decoder_sparse_step={_get(config, 'decoder_sparse_step', default=1)} == 0"
        )
    return (
        f"MoE iff layer >= first_k_dense_replace={_get(config, 'first_k_dense_replace', default=0)} "
        f"and layer % moe_layer_freq={_get(config, 'moe_layer_freq', default=1)} == 0"
    )


def resolve_moe_layer(config: Any, layer: int | None) -> int:
    """``layer`` checked to be an MoE layer of ``config`` (``None``: the first MoE layer)."""
    num_layers = int(_get(config, "num_hidden_layers", default=1))
    moe_layers = moe_layer_indices(config)
    if not moe_layers:
        raise ValueError(f"model must have an MoE layer, got none of {num_layers} layers ({moe_layer_rule(config)})")
    if layer is None:
        return moe_layers[0]
    if not 0 <= layer < num_layers:
        raise ValueError(
            f"layer must be in [0, {num_layers}) (num_hidden_layers={num_layers}), got {layer}; "
            f"MoE layers: {compact_indices(moe_layers)}"
        )
    if layer not in moe_layers:
        raise ValueError(
            f"layer must be an MoE layer, got dense layer {layer} ({moe_layer_rule(config)}); "
            f"MoE layers: {compact_indices(moe_layers)}"
        )
    return layer


def compact_indices(indices: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``: the MoE layers of a 61-layer model fit in an error message."""
    runs: list[list[int]] = []
    for n in indices:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)

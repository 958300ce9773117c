"""A whole ``transformers`` causal LM with moe-sbo's expert-parallel MoE layers: load it.

``load_model(DIR, group=...)`` builds the model of a Hugging Face checkpoint (DeepSeek-V2/V3,
Qwen3-MoE) on every rank of the expert-parallel group, the way SGLang deploys DP attention with EP
MoE: attention, dense layers, embeddings and head are whole on every rank, each rank runs its own
requests through them, and every sparse MoE block is replaced by an ``ExpertParallelMoE`` holding an
``MoELayer`` whose routed experts are split over the group (dispatcher, overlap and expert dtype are
options). The result is an ordinary ``transformers`` model; ``generate.py`` runs it on every rank in step.

The hard part is reading little. The model is built on the meta device (no weights allocated), each
MoE layer reads only this rank's experts (``LayerLoader``), and the rest is read tensor by tensor from
the safetensors files and assigned in place, so no rank ever holds another rank's experts or a second
copy of anything. FP8-stored dense weights are dequantised one tensor at a time; FP8 experts stay FP8
with ``expert_dtype="fp8"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..dispatch import Dispatcher, make_dispatcher
from ..eplb.runtime import EPLBOptions
from ..layer import MoELayer
from ..overlap.stages import run_to_end
from ..quant.fp8 import dequantize_fp8_blocks
from .checkpoint import Checkpoint, LayerLoader
from .config import model_family, moe_layer_indices
from .mla import absorb_mla_decode

WHOLE_MODEL_FAMILIES = ("deepseek_v2", "deepseek_v3", "qwen3_moe")  # transformers ships their classes
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class ExpertParallelMoE(nn.Module):
    """Stands in for a ``transformers`` sparse MoE block: ``[B, S, H] -> [B, S, H]`` through ``moe``.

    ``decode_dispatcher``: the dispatcher forwards use while ``decoding`` is set
    (``static_decode.decode_dispatchers``), over the same experts: prefill moves thousands of
    tokens with the main one, decode steps a few per rank with one a CUDA graph can capture
    (default: the main one). ``calls`` counts forwards (a rank with no work makes the same number,
    ``_idle``). ``elastic``: when set (``launch.elastic.ElasticMoE`` over ``moe``), forwards go
    through it, so that a lost rank is recovered inside them (eager forwards through ``moe``'s own
    dispatcher: the ``transformers`` decode loop)."""

    def __init__(self, moe: MoELayer, decode_dispatcher: Dispatcher | None = None):
        super().__init__()
        self.moe = moe
        self.decode_dispatcher = decode_dispatcher or moe.dispatcher
        self.decoding = False
        self.calls = 0
        self.elastic: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, shape[-1])
        if self.elastic is not None:
            return self.elastic(x_TH).reshape(shape)
        dispatcher = self.decode_dispatcher if self.decoding else self.moe.dispatcher
        return run_to_end(self.moe.stages(x_TH, dispatcher=dispatcher)).reshape(shape)


def moe_blocks(model: Any) -> list[ExpertParallelMoE]:
    """The model's expert-parallel blocks, in the order its forward calls them (layer order)."""
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, ExpertParallelMoE)]


@torch.no_grad()
def load_model(
    path: str | Path,
    *,
    group=None,
    dispatcher: str = "alltoall",
    dispatcher_options: dict | None = None,
    overlap: str = "none",
    expert_dtype: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    decode_dispatcher: str | None = None,
    decode_dispatcher_options: dict | None = None,
    absorb_mla: bool = True,
    eplb: EPLBOptions | None = None,
) -> nn.Module:
    """The causal LM of checkpoint ``path`` with every sparse MoE block expert-parallel over ``group``.

    Call it on every rank of ``group`` (``None``: the default group, or one rank). ``dtype`` of
    everything but FP8 experts (default: bfloat16 on CUDA, float32 on CPU). ``decode_dispatcher``
    (with its options): a second dispatcher for ``generate``'s static and CUDA-graph decode steps,
    e.g. ``"low_latency"`` with ``{"max_tokens_per_rank": 8}`` (the most prompts a rank decodes),
    while prefill uses ``dispatcher``; None: decode steps use ``dispatcher`` too. ``absorb_mla``:
    DeepSeek-V2/V3 attention decodes in the latent space (``mla.absorb_mla_decode``: the same
    logits, without expanding the whole cache every step); False keeps ``transformers``' step.
    ``eplb``: each MoE layer's expert load balancing (its redundant slots; elastic EP's spare slots). Raises
    ``ValueError`` before any collective for a family ``transformers`` has no model class for, or a
    checkpoint whose tensors do not cover the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = Checkpoint(path)
    family = model_family(checkpoint.hf_config)
    if family not in WHOLE_MODEL_FAMILIES:
        raise ValueError(
            f"whole models must be one of {WHOLE_MODEL_FAMILIES}, got {family} ({checkpoint.path}); "
            "load its MoE layers alone with moe_sbo.hf.checkpoint.LayerLoader"
        )
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = AutoConfig.from_pretrained(checkpoint.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    moe_indices = moe_layer_indices(checkpoint.hf_config)
    for index in moe_indices:  # each reads this rank's experts only
        moe = MoELayer(
            checkpoint.moe_config,
            dispatcher=dispatcher,
            dispatcher_options=dispatcher_options,
            group=group,
            overlap=overlap,
            dtype=dtype,
            device=device,
            expert_dtype=expert_dtype,
            seed=None,  # the checkpoint sets every weight
            eplb=eplb,
        )
        decode = None
        if decode_dispatcher is not None:
            decode = make_dispatcher(
                decode_dispatcher, moe.cfg.num_experts, moe.dispatcher.ep, **(decode_dispatcher_options or {})
            )
            decode.deliver_fp8 = moe.experts.fp8 and decode.sends_fp8
        model.model.layers[index].mlp = ExpertParallelMoE(LayerLoader(checkpoint, index)(moe), decode)

    state = _read_dense(checkpoint, set(moe_indices), config.num_hidden_layers, dtype, device)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if ".mlp.moe." not in k]
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{checkpoint.path} must hold every weight of its {type(model).__name__}, got "
            f"{len(missing)} missing (first: {missing[:3]}) and {len(result.unexpected_keys)} unexpected "
            f"(first: {result.unexpected_keys[:3]}); the files do not match config.json"
        )
    _rebuild_computed_buffers(model, device)
    if absorb_mla:
        absorb_mla_decode(model)
    return model.eval()


def _read_dense(
    checkpoint: Checkpoint, moe_indices: set[int], num_layers: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint but the MoE blocks' (read by ``LayerLoader``) and layers past
    ``num_layers`` (DeepSeek-V3's multi-token-prediction layer: generation does not run it), one at a
    time, FP8 ones dequantised, in ``dtype`` on ``device``. Peak host memory: what the rank keeps
    plus one tensor (measured: ``moe-sbo bench load-memory``)."""
    from safetensors import safe_open

    def wanted(name: str) -> bool:
        match = _LAYER_KEY.match(name)
        if match is None:
            return not name.endswith("_scale_inv")
        layer = int(match.group(1))
        in_moe_block = layer in moe_indices and name.startswith(f"model.layers.{layer}.mlp.")
        return layer < num_layers and not in_moe_block and not name.endswith("_scale_inv")

    def read(name: str) -> torch.Tensor:
        # One mapping per tensor: its pages are released when it is read (see Checkpoint._load_alone).
        with safe_open(str(checkpoint.path / checkpoint.weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    state: dict[str, torch.Tensor] = {}
    for name in filter(wanted, checkpoint.weight_map):
        tensor = read(name)
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8_blocks(tensor, read(name + "_scale_inv"), checkpoint.fp8_block)
        state[name] = tensor.to(device=device, dtype=dtype)
    return state


def _rebuild_computed_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers computed from the config, not stored (rotary frequencies), rebuilt on ``device``:
    on the meta device they were never computed."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                raise ValueError(f"{name} ({type(module).__name__}) has buffers no checkpoint holds; cannot build it")
            parent_name, _, attr = name.rpartition(".")
            with torch.device(device):
                rebuilt = type(module)(config=module.config)
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, rebuilt)


# ---- generation ------------------------------------------------------------------------------------

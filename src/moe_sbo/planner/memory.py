"""Weight memory per GPU: the whole model's weights, routed experts split over EP, in bf16 and in fp8.

Per GPU = routed experts of all MoE layers / EP + everything else, replicated on every GPU: attention
of every layer, the FFN of the ``first_k_dense_replace`` dense layers, shared experts, router,
embeddings, lm head and RMSNorms. Routed experts are priced two ways, as ``MoELayer`` can hold them:
bf16 (2 B per value), or fp8 in DeepSeek-V3's format -- e4m3 (1 B per value) with one float32 scale
per 128x128 block, so an [O, U] matrix takes O U + 4 ceil(O / 128) ceil(U / 128) bytes. Everything
else is bf16, as in this project, except the router, which it keeps in float32.

What is hard: **what is counted.** ``MoEConfig`` knows the MoE only; attention, the dense FFN width
and the vocabulary come from ``ModelShapes`` (a preset's published ``config.json``, or the user's
file), and any of them may be unknown. ``weight_memory`` never drops a part silently: each counted
part comes with its bytes and how they were computed (``parts``), each part it could not count is
named with the reason (``not_counted``), and both are printed under the table. Never counted: the
multi-token-prediction module(s) a checkpoint may hold (plain decoding does not run them), and
everything that is not a weight (KV cache, activations, communication buffers, CUDA context).

Units: ``_B`` bytes; GB = 1e9 B (SI, as the rest of the planner).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import MoEConfig, divisors
from .bytes import FP8_SCALE_B
from .inputs import ELEMENT_B, ModelShapes

FP8_WEIGHT_BLOCK = 128  # one scale per 128x128 weight tile: ``moe_sbo.quant.fp8.FP8_BLOCK`` (fp8.py needs torch)
EXPERT_DTYPES = ("bf16", "fp8")
ROUTER_B = 4  # the project's Router holds its gate weight and score bias in float32
# NVIDIA H200 SXM datasheet ("141GB HBM3e"), compared as 141e9 bytes: conservative, as the project's
# H200 reports more (torch total_memory 150,109,880,320 B; nvidia-smi 143,771 MiB).
H200_MEMORY_GB = 141.0


def expert_matrix_bytes(rows: int, cols: int, dtype: str) -> int:
    """Bytes of one [rows, cols] expert weight: bf16, or fp8 e4m3 plus a float32 scale per 128x128 block
    (edge blocks may be partial, as in DeepSeek-V3's checkpoint)."""
    if dtype == "bf16":
        return rows * cols * ELEMENT_B["bf16"]
    if dtype == "fp8":
        blocks = math.ceil(rows / FP8_WEIGHT_BLOCK) * math.ceil(cols / FP8_WEIGHT_BLOCK)
        return rows * cols * ELEMENT_B["fp8"] + blocks * FP8_SCALE_B
    raise ValueError(f"expert dtype must be one of {list(EXPERT_DTYPES)}, got {dtype!r}; pass bf16 or fp8")


def expert_bytes(cfg: MoEConfig, dtype: str) -> int:
    """One routed expert: gate [I, H], up [I, H], down [H, I]."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * expert_matrix_bytes(i, h, dtype) + expert_matrix_bytes(h, i, dtype)


@dataclass(frozen=True)
class WeightPart:
    """One replicated part of the model: its bytes (whole model = per GPU) and how they were counted."""

    name: str
    bytes_B: int
    how: str


@dataclass(frozen=True)
class WeightMemoryRow:
    """Weights on one GPU at EP size ``ep`` with routed experts in ``expert_dtype``.

    ``left_B`` = GPU memory - ``total_B`` (negative: that much over); ``fits``: ``left_B >= 0``.
    """

    expert_dtype: str
    ep: int
    experts_per_gpu: int
    routed_B: int
    other_B: int
    total_B: int
    left_B: int
    fits: bool


@dataclass(frozen=True)
class WeightMemory:
    """The model's weight memory per GPU at each EP size, bf16 and fp8 routed experts (``rows``).

    ``routed_total_B`` / ``model_total_B``: the whole model, by routed-expert dtype; ``fp8_scales_B``:
    the block scales inside ``routed_total_B["fp8"]``; ``other_B``: the replicated parts (``parts``),
    the same on every GPU; ``not_counted``: what is left out, each with its reason; ``notes``: caveats.
    """

    model: str
    num_layers: int
    moe_layers: int
    num_experts: int
    gpu_memory_B: int
    bytes_per_expert_B: dict[str, int]
    routed_total_B: dict[str, int]
    fp8_scales_B: int
    other_B: int
    model_total_B: dict[str, int]
    parts: tuple[WeightPart, ...]
    not_counted: tuple[str, ...]
    notes: tuple[str, ...]
    shapes_source: str
    rows: tuple[WeightMemoryRow, ...]


def _replicated_parts(cfg: MoEConfig, shapes: ModelShapes | None) -> tuple[list[WeightPart], list[str]]:
    """The parts every GPU holds whole, and the ones ``shapes`` does not let us count (with why)."""
    h, bf16 = cfg.hidden_size, ELEMENT_B["bf16"]
    layers, dense_layers, moe_layers = cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_moe_layers
    source = shapes.source if shapes is not None else f"{cfg.name}'s MoEConfig"
    parts, missing = [], []

    attention = shapes.attention if shapes is not None else None
    if attention is not None:
        params = attention.params(h)
        parts.append(WeightPart("attention", layers * params * bf16, f"{layers} layers x {attention.describe()}"))
    else:
        missing.append(f"attention of {layers} layers (no head sizes in {source})")

    if dense_layers:
        width = shapes.dense_intermediate_size if shapes is not None else None
        if width is not None:
            how = f"{dense_layers} layers x gate/up/down {h} x {width}"
            parts.append(WeightPart("dense FFN", dense_layers * 3 * h * width * bf16, how))
        else:
            missing.append(f"FFN of the first {dense_layers} dense layer(s) (no intermediate_size in {source})")

    if cfg.num_shared_experts:
        how = f"{moe_layers} layers x gate/up/down {h} x {cfg.shared_intermediate_size}"
        parts.append(WeightPart("shared experts", moe_layers * 3 * h * cfg.shared_intermediate_size * bf16, how))

    bias = cfg.num_experts if cfg.topk_method == "noaux_tc" else 0  # noaux_tc's e_score_correction_bias
    how = f"{moe_layers} layers x ({cfg.num_experts} x {h}" + (" + bias" if bias else "") + "), float32"
    parts.append(WeightPart("router", moe_layers * (cfg.num_experts * h + bias) * ROUTER_B, how))

    vocab = shapes.vocab_size if shapes is not None else None
    if vocab is not None:
        parts.append(WeightPart("embeddings", vocab * h * bf16, f"{vocab} x {h}"))
        if shapes is not None and shapes.tie_word_embeddings:
            parts.append(WeightPart("lm head", 0, "tied to the embeddings"))
        else:
            parts.append(WeightPart("lm head", vocab * h * bf16, f"{h} x {vocab}"))
    else:
        missing.append(f"embeddings and lm head (no vocab_size in {source})")

    # Two per layer (before attention and before the MLP) and the final one; MLA's and Qwen3's inner
    # norms are in the attention's count.
    parts.append(WeightPart("norms", (2 * layers + 1) * h * bf16, f"(2 x {layers} + 1) RMSNorms of {h}"))
    return parts, missing


def weight_memory(
    cfg: MoEConfig,
    ep_sizes: Sequence[int],
    shapes: ModelShapes | None = None,
    gpu_memory_GB: float = H200_MEMORY_GB,
) -> WeightMemory:
    """Weights per GPU of the whole model at each EP size in ``ep_sizes``, routed experts in bf16 and fp8.

    Per GPU: ``moe_layers x (E / EP) x bytes per expert`` of routed experts, plus every part in
    ``parts`` whole. Counted from ``cfg`` alone: routed and shared experts, router, RMSNorms. From
    ``shapes`` (None: not counted, and named in ``not_counted``): attention, the dense layers' FFN,
    embeddings and lm head. Never counted: multi-token-prediction modules, KV cache, activations,
    communication buffers, CUDA context.
    """
    if not ep_sizes or any(ep < 1 or cfg.num_experts % ep for ep in ep_sizes):
        raise ValueError(
            f"ep_sizes must divide the {cfg.num_experts} routed experts of {cfg.name}, got {list(ep_sizes)}; "
            f"choose among {divisors(cfg.num_experts)}"
        )
    if shapes is not None and shapes.hidden_size != cfg.hidden_size:
        raise ValueError(
            f"shapes must describe {cfg.name}, got hidden_size {shapes.hidden_size} from {shapes.source} for "
            f"its {cfg.hidden_size}; load the shapes from the same config"
        )
    parts, missing = _replicated_parts(cfg, shapes)
    other_B = sum(part.bytes_B for part in parts)
    per_expert = {dtype: expert_bytes(cfg, dtype) for dtype in EXPERT_DTYPES}
    routed_total = {dtype: cfg.num_moe_layers * cfg.num_experts * per_expert[dtype] for dtype in EXPERT_DTYPES}
    fp8_values_B = 3 * cfg.hidden_size * cfg.moe_intermediate_size * ELEMENT_B["fp8"]
    fp8_scales_B = cfg.num_moe_layers * cfg.num_experts * (per_expert["fp8"] - fp8_values_B)
    gpu_memory_B = round(gpu_memory_GB * 1e9)

    rows = []
    for dtype in EXPERT_DTYPES:
        for ep in ep_sizes:
            experts_per_gpu = cfg.experts_per_rank(ep)
            routed_B = cfg.num_moe_layers * experts_per_gpu * per_expert[dtype]
            total_B = routed_B + other_B
            rows.append(
                WeightMemoryRow(
                    expert_dtype=dtype,
                    ep=ep,
                    experts_per_gpu=experts_per_gpu,
                    routed_B=routed_B,
                    other_B=other_B,
                    total_B=total_B,
                    left_B=gpu_memory_B - total_B,
                    fits=total_B <= gpu_memory_B,
                )
            )

    not_counted = list(missing)
    if shapes is not None and shapes.mtp_layers:
        not_counted.append(
            f"{shapes.mtp_layers} multi-token-prediction layer(s) "
            "(num_nextn_predict_layers; decoding does not run them)"
        )
    not_counted.append("KV cache, activations, communication buffers, CUDA context (weights only)")
    notes = []
    unaligned = [
        f"{name} {size}"
        for name, size in (("hidden_size", cfg.hidden_size), ("moe_intermediate_size", cfg.moe_intermediate_size))
        if size % FP8_WEIGHT_BLOCK
    ]
    if unaligned:
        # The checkpoint format allows partial edge blocks; this project's FP8 experts do not.
        notes.append(
            f"fp8 rows count partial 128x128 blocks: {', '.join(unaligned)} not a multiple of {FP8_WEIGHT_BLOCK}, "
            "which MoELayer(expert_dtype='fp8') refuses"
        )
    return WeightMemory(
        model=cfg.name,
        num_layers=cfg.num_hidden_layers,
        moe_layers=cfg.num_moe_layers,
        num_experts=cfg.num_experts,
        gpu_memory_B=gpu_memory_B,
        bytes_per_expert_B=per_expert,
        routed_total_B=routed_total,
        fp8_scales_B=fp8_scales_B,
        other_B=other_B,
        model_total_B={dtype: routed_total[dtype] + other_B for dtype in EXPERT_DTYPES},
        parts=tuple(parts),
        not_counted=tuple(not_counted),
        notes=tuple(notes),
        shapes_source=shapes.source if shapes is not None else f"none, {cfg.name}'s MoEConfig only",
        rows=tuple(rows),
    )

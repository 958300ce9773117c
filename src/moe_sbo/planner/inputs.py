"""The planner's inputs: units, the hardware table, the model (preset or ``config.json``), ``PlanInputs``.

What is hard: one ``layers`` input, two conventions. The worked example counts an all-to-all in every layer
(``num_hidden_layers``, 61 for DeepSeek-V3); the byte model counts the MoE layers only
(``num_hidden_layers - first_k_dense_replace``, 58). ``layers=None`` keeps both (``seed_layers`` /
``model_layers``); an explicit ``layers`` sets both. Every input no plan can use is refused as the
``PlanInputs`` is built, with "<name> must <rule>, got <value>; <fix>" (the line the CLI prints).

The weight-memory line needs sizes ``MoEConfig`` does not carry (attention, the dense layers' FFN,
vocabulary): ``ModelShapes``, copied from the published ``config.json`` for presets (``PRESET_SHAPES``)
or read from the user's file (``shapes_from_hf``); a size neither gives is ``None``, and the line then
says which part it leaves out.

The hardware table mixes measured and datasheet figures (sources beside ``HARDWARE``) with *estimates*
(``latency_us``, ``SHARED_EXPERT_EFFICIENCY``); ``links.calibrate`` replaces the link figures by a fit.

Units legend: ``_B`` bytes, ``_us`` microseconds, ``_GBps`` 1e9 bytes/s (SI), ``_TFLOPs`` 1e12 FLOP/s.
1 GB/s = 1e3 bytes per microsecond. P = EP size (ranks), K = top-k, H = hidden size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import PRESETS, MoEConfig, divisors

# --------------------------------------------------------------------------------------------------
# Units and choices
# --------------------------------------------------------------------------------------------------

B_PER_US_PER_GBPS = 1e3  # 1 GB/s moves 1e3 bytes every microsecond.

# The inputs the worked example uses (DeepSeek-V3, batch 256, TPOT 20 ms, 61 layers, T = 320 us
# attention and t = 120 us MoE per layer, FP8 "7 KB" tokens).
SEED_INPUTS: dict[str, Any] = dict(
    model="deepseek-v3",
    batch=256,
    tpot_ms=20.0,
    layers=None,
    attn_us=320.0,
    moe_us=120.0,
    dispatch_dtype="fp8",
)

ELEMENT_B = {"fp8": 1, "bf16": 2}

# How the byte model counts destination ranks per token (see ``bytes.resolve_fanout``).
FANOUT_MODELS = ("uniform", "router", "max")

# EP sizes the weight-memory line shows by default: one 8-GPU node, and two.
DEFAULT_MEMORY_EP = (8, 16)


# --------------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """One GPU model in one kind of node, as the planner sees it.

    ``nvlink_GBps`` / ``nic_GBps``: per GPU, per direction, for traffic inside / between nodes
    (``gpus_per_node == 1`` means every peer is reached through the NIC). ``latency_us``: fixed cost of
    one all-to-all (launch + synchronisation), an *estimate* until ``calibrate`` measures it.
    """

    name: str
    description: str
    nvlink_GBps: float
    nic_GBps: float
    gpus_per_node: int
    latency_us: float
    bf16_TFLOPs: float
    fp8_TFLOPs: float
    hbm_GBps: float
    source: str


# Sources:
# - H800 NVLink ~160 GB/s per direction is *measured*: the worked example quotes it; DeepEP's README
#   (github.com/deepseek-ai/DeepEP, "Normal kernels" table) measures 153 GB/s dispatch / 158 GB/s combine
#   intranode EP8 on H800 (nominal H800 NVLink is 400 GB/s bidirectional).
# - H100/H200 SXM NVLink-4: 18 links x 50 GB/s = 900 GB/s bidirectional = 450 GB/s per direction
#   (NVIDIA H100/H200 datasheets).
# - ConnectX-7 NDR 400 Gb/s = 50 GB/s per direction, one NIC per GPU (NVIDIA ConnectX-7 datasheet);
#   DeepEP's README measures ~40-58 GB/s RDMA for internode dispatch/combine on it.
# - Compute and memory: H800/H100 SXM 989 dense BF16 TFLOP/s, 1979 dense FP8, HBM3 3.35 TB/s; H200 SXM
#   the same compute with HBM3e 4.8 TB/s (NVIDIA datasheets, dense = without sparsity).
# - latency_us: our estimate of one all-to-all's fixed cost (kernel launch + cross-GPU barrier) --
#   ~10 us over NVLink, ~20 us through an RDMA NIC. Not a datasheet number; use --calibrate.
HARDWARE: dict[str, Hardware] = {
    "h800": Hardware(
        "h800",
        "H800 SXM, NVLink ~160 GB/s measured, CX7 between nodes",
        nvlink_GBps=160.0,
        nic_GBps=50.0,
        gpus_per_node=8,
        latency_us=10.0,
        bf16_TFLOPs=989.0,
        fp8_TFLOPs=1979.0,
        hbm_GBps=3350.0,
        source="published decode analysis; DeepEP README intranode 153/158 GB/s",
    ),
    "h100": Hardware(
        "h100",
        "H100 SXM, NVLink-4 450 GB/s per direction, CX7 between nodes",
        nvlink_GBps=450.0,
        nic_GBps=50.0,
        gpus_per_node=8,
        latency_us=10.0,
        bf16_TFLOPs=989.0,
        fp8_TFLOPs=1979.0,
        hbm_GBps=3350.0,
        source="NVIDIA H100 datasheet (NVLink 900 GB/s bidirectional)",
    ),
    "h200": Hardware(
        "h200",
        "H200 SXM, NVLink-4 450 GB/s per direction, CX7 between nodes",
        nvlink_GBps=450.0,
        nic_GBps=50.0,
        gpus_per_node=8,
        latency_us=10.0,
        bf16_TFLOPs=989.0,
        fp8_TFLOPs=1979.0,
        hbm_GBps=4800.0,
        source="NVIDIA H200 datasheet (NVLink 900 GB/s bidirectional)",
    ),
    # Every peer over RDMA (DeepEP low-latency kernels go through the NIC even inside a node).
    "cx7": Hardware(
        "cx7",
        "H800 with every peer over ConnectX-7 400 Gb/s RDMA (~50 GB/s)",
        nvlink_GBps=50.0,
        nic_GBps=50.0,
        gpus_per_node=1,
        latency_us=20.0,
        bf16_TFLOPs=989.0,
        fp8_TFLOPs=1979.0,
        hbm_GBps=3350.0,
        source="ConnectX-7 datasheet; DeepEP README internode RDMA ~40-58 GB/s",
    ),
}

# Share of datasheet peak a real shared-expert MLP reaches. From this project's H200 probe: DeepSeek-V3's
# shared expert on 4096 tokens took 516 us on one H200, against a 365 us roofline (2*4096*3*7168*2048
# FLOP at 989 TFLOP/s) -> 0.71. Used for memory bandwidth too, for want of a measurement.
SHARED_EXPERT_EFFICIENCY = 0.7


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(
            f"hw must be one of {sorted(HARDWARE)}, got {name!r}; pick the closest machine with --hw "
            "and measure yours with --calibrate RESULT.json"
        )
    return HARDWARE[name]


# --------------------------------------------------------------------------------------------------
# Models: presets or a Hugging Face config.json
# --------------------------------------------------------------------------------------------------


def read_hf_config(spec: str) -> tuple[dict[str, Any], Path]:
    """The parsed Hugging Face ``config.json`` that ``spec`` (the file or its folder) names, and its path."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model must be a preset or a path to a Hugging Face config.json, got {spec!r}; "
            f"use one of {sorted(PRESETS)} or an existing file"
        )
    try:
        return json.loads(path.read_text()), path
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"model config must be valid JSON, got a parse error in {str(path)!r} ({exc}); pass the model's config.json"
        ) from None


def load_model(spec: str) -> MoEConfig:
    """A preset name (``deepseek-v3``...) or a path to a Hugging Face ``config.json`` (or its folder)."""
    from ..hf.config import config_from_hf  # lazy: the HF interop imports torch, a preset does not need it

    if spec in PRESETS:
        return PRESETS[spec]
    hf, path = read_hf_config(spec)
    return config_from_hf(hf, name=hf.get("_name_or_path") or path.parent.name or path.stem)


# --------------------------------------------------------------------------------------------------
# Whole-model shapes: what the weight-memory line needs beyond MoEConfig
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAShapes:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), sizes named as in their ``config.json``.

    ``q_lora_rank`` None: queries come from one ``q_proj`` [n (d_nope + d_rope), H] (DeepSeek-V2-Lite).
    """

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def params(self, hidden_size: int) -> int:
        """Weights of one layer's attention: projections and the two latent RMSNorms (no biases)."""
        n, qk_head = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            queries = hidden_size * n * qk_head
        else:  # q_a_proj, q_a_layernorm, q_b_proj
            queries = hidden_size * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk_head
        # kv_a_proj_with_mqa (latent + the shared rope key), kv_a_layernorm, kv_b_proj (keys' nope part, values)
        keys_values = (
            hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return queries + keys_values + n * self.v_head_dim * hidden_size  # + o_proj

    def describe(self) -> str:
        return f"MLA {self.num_heads} heads, q_lora_rank {self.q_lora_rank}, kv_lora_rank {self.kv_lora_rank}"


@dataclass(frozen=True)
class GQAShapes:
    """Grouped-query attention (Qwen3-MoE): q, k, v, o projections without biases; ``qk_norm``: an
    RMSNorm of ``head_dim`` on queries and one on keys, as Qwen3 has."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool

    def params(self, hidden_size: int) -> int:
        projections = 2 * hidden_size * self.head_dim * (self.num_heads + self.num_kv_heads)
        return projections + (2 * self.head_dim if self.qk_norm else 0)

    def describe(self) -> str:
        return f"GQA {self.num_heads} heads / {self.num_kv_heads} kv heads x {self.head_dim}"


@dataclass(frozen=True)
class ModelShapes:
    """The whole-model sizes ``MoEConfig`` does not carry; ``None`` where the source does not give one
    (the weight-memory line then names that part as not counted).

    ``dense_intermediate_size``: the FFN width of the ``first_k_dense_replace`` dense layers
    (``intermediate_size`` in ``config.json``); ``mtp_layers``: multi-token-prediction modules
    (``num_nextn_predict_layers``), which the checkpoint holds but plain decoding does not run;
    ``hidden_size``: to check the shapes belong to the ``MoEConfig`` they are used with.
    """

    hidden_size: int
    attention: MLAShapes | GQAShapes | None
    dense_intermediate_size: int | None
    vocab_size: int | None
    tie_word_embeddings: bool
    mtp_layers: int
    source: str


def _mla(num_heads: int, q_lora_rank: int | None) -> MLAShapes:
    # Every published MLA model here has kv_lora_rank 512 and 128 + 64 query/key, 128 value head dims.
    return MLAShapes(
        num_heads, q_lora_rank, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )


# Copied from the published config.json of each preset (the files named beside ``config.PRESETS``);
# ``tiny`` is this project's own test shape, with no attention or vocabulary to copy.
PRESET_SHAPES: dict[str, ModelShapes] = {
    "deepseek-v2-lite": ModelShapes(
        2048, _mla(16, None), 10944, 102400, False, 0, "deepseek-ai/DeepSeek-V2-Lite/config.json"
    ),
    "deepseek-v2": ModelShapes(5120, _mla(128, 1536), 12288, 102400, False, 0, "deepseek-ai/DeepSeek-V2/config.json"),
    "deepseek-v3": ModelShapes(7168, _mla(128, 1536), 18432, 129280, False, 1, "deepseek-ai/DeepSeek-V3/config.json"),
    "qwen3-30b-a3b": ModelShapes(
        2048, GQAShapes(32, 4, 128, True), 6144, 151936, False, 0, "Qwen/Qwen3-30B-A3B/config.json"
    ),
    "kimi-k2": ModelShapes(7168, _mla(64, 1536), 18432, 163840, False, 0, "moonshotai/Kimi-K2-Instruct/config.json"),
}


def preset_shapes(model: MoEConfig) -> ModelShapes | None:
    """The published shapes of ``model`` if it is a preset, unchanged (a changed copy may not match them)."""
    if model.name in PRESET_SHAPES and PRESETS.get(model.name) == model:
        return PRESET_SHAPES[model.name]
    return None


def shapes_from_hf(hf: dict[str, Any], source: str) -> ModelShapes:
    """``ModelShapes`` from a parsed ``config.json``; a size the file lacks stays ``None``.

    Attention is read as the family builds it, the same way ``hf.config.config_from_hf`` picks the
    family: Qwen3-MoE (``model_type`` or ``architectures``) has GQA with q/k norms; anything else is
    read DeepSeek-style, with MLA, and needs all of ``num_attention_heads``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` (``q_lora_rank`` may be null).
    """
    if not hf.get("hidden_size"):
        raise ValueError(
            f"model config must have hidden_size, got a config without it in {source}; pass its config.json"
        )
    hidden = int(hf["hidden_size"])
    heads = hf.get("num_attention_heads")
    attention: MLAShapes | GQAShapes | None = None
    if hf.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (hf.get("architectures") or []):
        if heads:
            kv_heads = hf.get("num_key_value_heads") or heads
            attention = GQAShapes(int(heads), int(kv_heads), int(hf.get("head_dim") or hidden // heads), True)
    else:
        mla_keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if heads and all(hf.get(k) for k in mla_keys):
            q_lora_rank = hf.get("q_lora_rank")
            kv_lora_rank, qk_nope, qk_rope, v_head = (int(hf[k]) for k in mla_keys)
            q_rank = None if q_lora_rank is None else int(q_lora_rank)
            attention = MLAShapes(int(heads), q_rank, kv_lora_rank, qk_nope, qk_rope, v_head)
    dense = hf.get("intermediate_size")
    vocab = hf.get("vocab_size")
    return ModelShapes(
        hidden_size=hidden,
        attention=attention,
        dense_intermediate_size=None if dense is None else int(dense),
        vocab_size=None if vocab is None else int(vocab),
        # Every supported family defaults to separate embeddings and lm head.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
        source=source,
    )


def load_shapes(spec: str) -> ModelShapes | None:
    """``ModelShapes`` for ``--model``: a preset's published ones (None for ``tiny``) or its ``config.json``'s."""
    if spec in PRESETS:
        return PRESET_SHAPES.get(spec)
    hf, path = read_hf_config(spec)
    return shapes_from_hf(hf, source=str(path))


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on. Defaults are the worked example at EP8 on H800.

    ``layers``: layers that run an all-to-all; ``None`` means the worked example's convention counts every layer
    (``num_hidden_layers``, 61 for V3, as the worked example does) and the byte model counts the MoE layers only
    (``num_hidden_layers - first_k_dense_replace``, 58 for V3). ``attn_us`` / ``moe_us``: the worked example's T
    and t, per layer, taken as given in every mode. ``micro_batches``: 1 (no TBO) or 2 (TBO).
    ``memory_ep``: the EP sizes of the weight-memory line (``None``: see ``memory_ep_sizes``);
    ``shapes``: the whole-model sizes it uses (``None``: see ``model_shapes``).
    """

    model: MoEConfig
    batch: int = 256
    tpot_ms: float = 20.0
    layers: int | None = None
    attn_us: float = 320.0
    moe_us: float = 120.0
    ep: int = 8
    hw: str = "h800"
    dispatch_dtype: str = "fp8"
    combine_dtype: str = "bf16"
    micro_batches: int = 2
    weight_dtype: str = "bf16"
    fanout_model: str = "uniform"
    memory_ep: tuple[int, ...] | None = None
    shapes: ModelShapes | None = None

    def __post_init__(self) -> None:
        validate_inputs(self)

    @property
    def memory_ep_sizes(self) -> tuple[int, ...]:
        """``memory_ep`` if given, else those of ``DEFAULT_MEMORY_EP`` that divide the experts, else ``ep``."""
        if self.memory_ep is not None:
            return self.memory_ep
        return tuple(p for p in DEFAULT_MEMORY_EP if self.model.num_experts % p == 0) or (self.ep,)

    @property
    def model_shapes(self) -> ModelShapes | None:
        """``shapes`` if given, else the preset's published shapes (``preset_shapes``), else None."""
        return self.shapes if self.shapes is not None else preset_shapes(self.model)

    @property
    def seed_layers(self) -> int:
        return self.layers if self.layers is not None else self.model.num_hidden_layers

    @property
    def model_layers(self) -> int:
        return self.layers if self.layers is not None else self.model.num_moe_layers

    @property
    def is_seed_example(self) -> bool:
        """True when the inputs are the worked example's, so its printed figures apply."""
        return (
            self.model == PRESETS[SEED_INPUTS["model"]]
            and self.batch == SEED_INPUTS["batch"]
            and self.tpot_ms == SEED_INPUTS["tpot_ms"]
            and self.seed_layers == PRESETS[SEED_INPUTS["model"]].num_hidden_layers
            and self.attn_us == SEED_INPUTS["attn_us"]
            and self.moe_us == SEED_INPUTS["moe_us"]
            and self.dispatch_dtype == SEED_INPUTS["dispatch_dtype"]
        )


def validate_inputs(inp: PlanInputs) -> None:
    """Raise ``ValueError`` "<name> must <rule>, got <value>; <fix>" for inputs no plan can use."""
    if not isinstance(inp.batch, int) or inp.batch < 1:
        raise ValueError(f"batch must be a positive number of tokens per GPU, got {inp.batch}; pass --batch >= 1")
    if not inp.tpot_ms > 0:
        raise ValueError(f"tpot_ms must be > 0, got {inp.tpot_ms}; pass the per-token SLO, e.g. --tpot-ms 20")
    if inp.layers is not None and inp.layers < 1:
        raise ValueError(f"layers must be >= 1, got {inp.layers}; omit --layers to use the model's count")
    for name in ("attn_us", "moe_us"):
        if getattr(inp, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(inp, name)}; pass a per-layer time in us")
    if inp.ep < 1 or inp.model.num_experts % inp.ep:
        raise ValueError(
            f"ep must divide the {inp.model.num_experts} routed experts of {inp.model.name}, got {inp.ep}; "
            f"choose --ep among {divisors(inp.model.num_experts)}"
        )
    get_hardware(inp.hw)
    for name in ("dispatch_dtype", "combine_dtype", "weight_dtype"):
        if getattr(inp, name) not in ELEMENT_B:
            raise ValueError(f"{name} must be fp8 or bf16, got {getattr(inp, name)!r}; pass fp8 or bf16")
    if inp.fanout_model not in FANOUT_MODELS:
        raise ValueError(
            f"fanout_model must be one of {list(FANOUT_MODELS)}, got {inp.fanout_model!r}; pass --fanout uniform"
        )
    if inp.memory_ep is not None and (
        not inp.memory_ep or any(ep < 1 or inp.model.num_experts % ep for ep in inp.memory_ep)
    ):
        raise ValueError(
            f"memory_ep must be EP sizes that divide the {inp.model.num_experts} routed experts of "
            f"{inp.model.name}, got {list(inp.memory_ep)}; choose --memory-ep among {divisors(inp.model.num_experts)}"
        )
    if inp.shapes is not None and inp.shapes.hidden_size != inp.model.hidden_size:
        raise ValueError(
            f"shapes must describe the planned model, got hidden_size {inp.shapes.hidden_size} from "
            f"{inp.shapes.source} for {inp.model.name}'s {inp.model.hidden_size}; load both from the same config"
        )
    if inp.micro_batches not in (1, 2):
        raise ValueError(
            f"micro_batches must be 1 or 2, got {inp.micro_batches}; the (T - t) / 2 rule is derived for "
            "two micro-batches (pass 2 for TBO, 1 without)"
        )
    if inp.micro_batches > inp.batch:
        raise ValueError(
            f"batch must hold at least one token per micro-batch, got batch {inp.batch} for "
            f"{inp.micro_batches} micro-batches; raise --batch or pass --micro-batches 1"
        )

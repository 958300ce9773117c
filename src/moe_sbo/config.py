"""Model shapes: the MoE part of a DeepSeek-V2/V3-family (or Qwen3-MoE) layer, and presets; and the
names the library's string options take (dispatchers, overlap modes, decode loops, MLA decode steps).

The hard part is that the published models disagree on routing: softmax greedy (V2-Lite, Qwen3),
softmax group-limited greedy with the group score = the group's best expert (V2), and sigmoid
``noaux_tc`` with a selection-only bias and group score = sum of the group's top-2 (V3, Kimi-K2).
``MoEConfig`` names each of these knobs once; ``routing/router.py`` interprets them.

The names are plain tuples, importable without torch (as this whole module is): the command line
offers them in its ``--help`` before torch, seconds to import, is loaded. The modules that implement
them import their names from here; the dispatcher registry checks itself against
``DISPATCHER_NAMES`` when it loads.

Preset values are copied from each model's published ``config.json`` (Hugging Face Hub); the file
names are given beside each preset. ``tests/test_config.py`` pins them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

# The names the string options take (the module docstring says why they live here).
DISPATCHER_NAMES: tuple[str, ...] = ("allgather", "alltoall", "local", "low_latency", "node_aware")
FIXED_MODES: tuple[str, ...] = ("none", "dispatch", "combine", "combine_sm", "split")
OVERLAP_MODES: tuple[str, ...] = (*FIXED_MODES, "auto")
DECODE_LOOPS: tuple[str, ...] = ("transformers", "static", "cuda_graph")
# The decode steps a loaded MLA model can take (``load_model(absorb_mla=...)``): ``hf/mla.py``'s, or
# ``transformers``' own.
MLA_STEPS: tuple[str, ...] = ("absorbed", "transformers")

TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
ScoringFunc = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class MoEConfig:
    """Shapes and routing of one MoE layer.

    Sizes: ``hidden_size`` H, ``moe_intermediate_size`` I (per routed expert), ``num_experts`` E
    (routed, global), ``num_experts_per_tok`` K, ``num_shared_experts`` (their MLP has
    ``I * num_shared_experts`` intermediate width, as DeepSeek builds it).
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    topk_method: TopkMethod
    scoring_func: ScoringFunc
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # Whole-model facts the planner and the checkpoint loader need.
    num_hidden_layers: int = 1
    first_k_dense_replace: int = 0
    hf_architecture: str = ""

    def __post_init__(self) -> None:
        validate_config(self)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def replace(self, **changes) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_num_experts(self, num_experts: int) -> MoEConfig:
        """This model with ``num_experts`` routed experts (benchmarks at a per-GPU-realistic count),
        its groups adjusted so top-k still routes: the most groups <= this config's with >= 2 experts
        each (noaux_tc scores a group by its top 2), then the fewest kept groups >= this config's that
        still hold top-k experts."""
        k = self.num_experts_per_tok
        if k > num_experts:
            raise ValueError(f"num_experts must be >= top-k {k}, got {num_experts}; use more experts")
        if self.topk_method == "greedy":
            return self.replace(num_experts=num_experts)
        n_group = max(g for g in range(1, self.n_group + 1) if num_experts % g == 0 and num_experts // g >= 2)
        topk_group = next(
            t for t in range(min(self.topk_group, n_group), n_group + 1) if t * (num_experts // n_group) >= k
        )
        return self.replace(num_experts=num_experts, n_group=n_group, topk_group=topk_group)

    def experts_per_rank(self, ep_size: int) -> int:
        """Routed experts each rank owns at EP size ``ep_size`` (raises if they do not divide)."""
        if ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {ep_size}")
        if self.num_experts % ep_size:
            raise ValueError(
                f"num_experts must be divisible by the EP size, got {self.num_experts} experts on "
                f"{ep_size} ranks; choose an EP size among {divisors(self.num_experts)}"
            )
        return self.num_experts // ep_size


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_config(cfg: MoEConfig) -> None:
    """Raise ``ValueError`` naming the field and the fix when ``cfg`` cannot describe a real layer."""
    for field in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"):
        if getattr(cfg, field) < 1:
            raise ValueError(f"{field} must be >= 1, got {getattr(cfg, field)}")
    if cfg.num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be >= 0, got {cfg.num_shared_experts}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ValueError(
            f"num_experts_per_tok (top-k) must be <= num_experts, got top-k {cfg.num_experts_per_tok} "
            f"with {cfg.num_experts} experts; lower top-k or add experts"
        )
    if cfg.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"topk_method must be one of greedy, group_limited_greedy, noaux_tc, got {cfg.topk_method!r}")
    if cfg.scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func must be softmax or sigmoid, got {cfg.scoring_func!r}")
    if cfg.n_group < 1 or cfg.num_experts % cfg.n_group:
        raise ValueError(
            f"n_group must divide num_experts, got {cfg.n_group} groups for {cfg.num_experts} experts; "
            f"choose n_group among {divisors(cfg.num_experts)}"
        )
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise ValueError(f"topk_group must be in [1, n_group={cfg.n_group}], got {cfg.topk_group}")
    if cfg.topk_method != "greedy" and cfg.num_experts_per_tok > cfg.topk_group * cfg.experts_per_group:
        raise ValueError(
            f"top-k {cfg.num_experts_per_tok} cannot be chosen from {cfg.topk_group} groups of "
            f"{cfg.experts_per_group} experts; raise topk_group or lower num_experts_per_tok"
        )
    if cfg.topk_method == "noaux_tc" and cfg.experts_per_group < 2:
        raise ValueError(
            "noaux_tc scores a group by the sum of its top-2 experts, so each group needs >= 2 experts, "
            f"got {cfg.experts_per_group}; lower n_group"
        )


PRESETS: dict[str, MoEConfig] = {
    # deepseek-ai/DeepSeek-V2-Lite/config.json
    "deepseek-v2-lite": MoEConfig(
        name="deepseek-v2-lite",
        hidden_size=2048,
        moe_intermediate_size=1408,
        num_experts=64,
        num_experts_per_tok=6,
        num_shared_experts=2,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        num_hidden_layers=27,
        first_k_dense_replace=1,
        hf_architecture="DeepseekV2ForCausalLM",
    ),
    # deepseek-ai/DeepSeek-V2/config.json
    "deepseek-v2": MoEConfig(
        name="deepseek-v2",
        hidden_size=5120,
        moe_intermediate_size=1536,
        num_experts=160,
        num_experts_per_tok=6,
        num_shared_experts=2,
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        n_group=8,
        topk_group=3,
        num_hidden_layers=60,
        first_k_dense_replace=1,
        hf_architecture="DeepseekV2ForCausalLM",
    ),
    # deepseek-ai/DeepSeek-V3/config.json (DeepSeek-R1 has the same MoE shapes)
    "deepseek-v3": MoEConfig(
        name="deepseek-v3",
        hidden_size=7168,
        moe_intermediate_size=2048,
        num_experts=256,
        num_experts_per_tok=8,
        num_shared_experts=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        hf_architecture="DeepseekV3ForCausalLM",
    ),
    # Qwen/Qwen3-30B-A3B/config.json (no shared experts, no scaling factor)
    "qwen3-30b-a3b": MoEConfig(
        name="qwen3-30b-a3b",
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_shared_experts=0,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        num_hidden_layers=48,
        first_k_dense_replace=0,
        hf_architecture="Qwen3MoeForCausalLM",
    ),
    # moonshotai/Kimi-K2-Instruct/config.json (DeepSeek-V3 architecture, 384 experts, one group)
    "kimi-k2": MoEConfig(
        name="kimi-k2",
        hidden_size=7168,
        moe_intermediate_size=2048,
        num_experts=384,
        num_experts_per_tok=8,
        num_shared_experts=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        n_group=1,
        topk_group=1,
        num_hidden_layers=61,
        first_k_dense_replace=1,
        hf_architecture="DeepseekV3ForCausalLM",
    ),
    # DeepSeek-V3's routing structure (sigmoid noaux_tc, 4 groups, 2 kept) at CPU-friendly sizes.
    "tiny": MoEConfig(
        name="tiny",
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=16,
        num_experts_per_tok=4,
        num_shared_experts=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        hf_architecture="DeepseekV3ForCausalLM",
    ),
}


def get_preset(name: str) -> MoEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}") from None

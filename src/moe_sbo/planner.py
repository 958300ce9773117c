"""Communication-budget planner: model shape + batch + SLO + hardware -> bytes, bandwidth, overlap verdicts.

It starts from the seed's back-of-envelope decode analysis for DeepSeek-V3 (a token is "7 KB", one
all-to-all of 256 tokens is "1.78 MB", dispatch + combine "3.56 MB" per layer, 61 layers "218 MB" per
decode step, "10.9 GB/s" per GPU at TPOT 20 ms, and each all-to-all must finish in (T - t) / 2 = 100 us
when two micro-batches overlap attention with MoE) and keeps two things side by side:

* the **seed convention** -- ``hidden_size`` bytes per token, one send per token, the same bytes for
  dispatch and combine -- evaluated exactly, so each of the seed's figures can be checked (they agree
  within 1 %, see ``seed_figures``);
* the **byte model** -- what a DeepEP-"normal"-style all-to-all really moves per GPU: an FP8 row with
  per-128 fp32 scales and the token's routing (``topk_ids`` int64 + ``topk_weights`` fp32) on dispatch,
  a BF16 row on combine, each token sent once per *remote* destination rank.

What is hard:

1. **Units.** The seed mixes conventions: 1 KB = 1024 B (7168 B = "7 KB") but 1 MB = 1000 KB
   (256 x 7 KB = 1792 KB = "1.78 MB") and 1 GB = 1000 MB. Judged in SI units "1.78 MB" is 3.0 % below
   1.835 MB; judged in its own units it is 0.7 % below 1.792. Everything here is kept in bytes; the
   seed's units appear only in ``seed_figures`` and in the ``seed_*`` fields of the JSON.
2. **Fan-out under group limits.** A token goes to each *rank* that owns one of its top-k experts, so
   bytes scale with the expected number of distinct destination ranks, not with k. With DeepSeek-V3 at
   EP8 a group of 32 experts is exactly one rank and 4 groups are kept, so at most 4 ranks. We compute
   the expectation *exactly* (``expected_fanout``: rational arithmetic over group choices) under the
   uniform-routing model "topk_group groups chosen uniformly, then top-k uniformly among their experts".
   The real group-limited router on i.i.d. scores is not that model (kept groups were kept *because*
   their best experts score high, so each tends to contribute one); ``simulate_fanout`` runs the
   project's router on seeded random scores to show the gap. Local traffic is excluded exactly: for a
   uniformly placed source rank, (P - 1) / P of the expected destinations are remote.
3. **Estimates vs datasheets vs measurements.** Link bandwidths are measured or datasheet figures (with
   sources); fixed per-all-to-all latencies and the shared-expert time (a roofline at datasheet peak,
   scaled by an efficiency from this project's own H200 probe) are *estimates*. ``calibrate`` replaces
   the link numbers with a fit over a benchmark result file of this project.

Units legend: ``_B`` bytes, ``_us`` microseconds, ``_GBps`` 1e9 bytes/s (SI), ``_TFLOPs`` 1e12 FLOP/s.
1 GB/s = 1e3 bytes per microsecond. P = EP size (ranks), K = top-k, H = hidden size.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from .config import PRESETS, MoEConfig, divisors
from .hf import config_from_hf

# --------------------------------------------------------------------------------------------------
# Units and the seed's figures
# --------------------------------------------------------------------------------------------------

B_PER_US_PER_GBPS = 1e3  # 1 GB/s moves 1e3 bytes every microsecond.

# The seed's own arithmetic: KB = 1024 B, then MB = 1000 KB and GB = 1000 MB (see module docstring).
SEED_KB_B = 1024
SEED_MB_B = 1000 * SEED_KB_B
SEED_GB_B = 1000 * SEED_MB_B

# The inputs the seed's worked example uses (DeepSeek-V3, batch 256, TPOT 20 ms, 61 layers, T = 320 us
# attention and t = 120 us MoE per layer, FP8 "7 KB" tokens).
SEED_INPUTS = dict(
    model="deepseek-v3", batch=256, tpot_ms=20.0, layers=None, attn_us=320.0, moe_us=120.0,
    dispatch_dtype="fp8",
)

# The figures exactly as the seed prints them: key -> (value, the seed's unit). These are the reference
# the planner is checked against, not results: every exact value is computed by ``seed_figures``.
SEED_PRINTED = {
    "bytes_per_token": (7.0, "KB"),
    "bytes_per_a2a": (1.78, "MB"),
    "bytes_per_layer": (3.56, "MB"),
    "bytes_per_step": (218.0, "MB"),
    "required_GBps_per_gpu": (10.9, "GB/s"),
    "a2a_budget_us": (100.0, "us"),
}

ELEMENT_B = {"fp8": 1, "bf16": 2}
FP8_SCALE_BLOCK = 128  # DeepSeek-V3 / DeepEP quantise activations per 1x128 block ...
FP8_SCALE_B = 4  # ... with one fp32 scale per block.
TOPK_ID_B = 8  # topk_ids travel as int64 (DeepEP normal dispatch sends the [T, K] int64 tensor) ...
TOPK_WEIGHT_B = 4  # ... and topk_weights as float32.


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
# - H800 NVLink ~160 GB/s per direction is *measured*: the seed quotes it; DeepEP's README
#   (github.com/deepseek-ai/DeepEP, "Normal kernels" table) measures 153 GB/s dispatch / 158 GB/s combine
#   intranode EP8 on H800 (nominal H800 NVLink is 400 GB/s bidirectional).
# - H100/H200 SXM NVLink-4: 18 links x 50 GB/s = 900 GB/s bidirectional = 450 GB/s per direction
#   (NVIDIA H100/H200 datasheets; DESIGN.md section 6).
# - ConnectX-7 NDR 400 Gb/s = 50 GB/s per direction, one NIC per GPU (NVIDIA ConnectX-7 datasheet);
#   DeepEP's README measures ~40-58 GB/s RDMA for internode dispatch/combine on it.
# - Compute and memory: H800/H100 SXM 989 dense BF16 TFLOP/s, 1979 dense FP8, HBM3 3.35 TB/s; H200 SXM
#   the same compute with HBM3e 4.8 TB/s (NVIDIA datasheets, dense = without sparsity).
# - latency_us: our estimate of one all-to-all's fixed cost (kernel launch + cross-GPU barrier) --
#   ~10 us over NVLink, ~20 us through an RDMA NIC. Not a datasheet number; use --calibrate.
HARDWARE: dict[str, Hardware] = {
    "h800": Hardware(
        "h800", "H800 SXM, NVLink ~160 GB/s measured, CX7 between nodes",
        nvlink_GBps=160.0, nic_GBps=50.0, gpus_per_node=8, latency_us=10.0,
        bf16_TFLOPs=989.0, fp8_TFLOPs=1979.0, hbm_GBps=3350.0,
        source="seed; DeepEP README intranode 153/158 GB/s",
    ),
    "h100": Hardware(
        "h100", "H100 SXM, NVLink-4 450 GB/s per direction, CX7 between nodes",
        nvlink_GBps=450.0, nic_GBps=50.0, gpus_per_node=8, latency_us=10.0,
        bf16_TFLOPs=989.0, fp8_TFLOPs=1979.0, hbm_GBps=3350.0,
        source="NVIDIA H100 datasheet (NVLink 900 GB/s bidirectional)",
    ),
    "h200": Hardware(
        "h200", "H200 SXM, NVLink-4 450 GB/s per direction, CX7 between nodes",
        nvlink_GBps=450.0, nic_GBps=50.0, gpus_per_node=8, latency_us=10.0,
        bf16_TFLOPs=989.0, fp8_TFLOPs=1979.0, hbm_GBps=4800.0,
        source="NVIDIA H200 datasheet (NVLink 900 GB/s bidirectional)",
    ),
    # Every peer over RDMA (DeepEP low-latency kernels go through the NIC even inside a node).
    "cx7": Hardware(
        "cx7", "H800 with every peer over ConnectX-7 400 Gb/s RDMA (~50 GB/s)",
        nvlink_GBps=50.0, nic_GBps=50.0, gpus_per_node=1, latency_us=20.0,
        bf16_TFLOPs=989.0, fp8_TFLOPs=1979.0, hbm_GBps=3350.0,
        source="ConnectX-7 datasheet; DeepEP README internode RDMA ~40-58 GB/s",
    ),
}

# Share of datasheet peak a real shared-expert MLP reaches. From DESIGN.md section 6: DeepSeek-V3's
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


def load_model(spec: str) -> MoEConfig:
    """A preset name (``deepseek-v3``...) or a path to a Hugging Face ``config.json`` (or its folder)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model must be a preset or a path to a Hugging Face config.json, got {spec!r}; "
            f"use one of {sorted(PRESETS)} or an existing file"
        )
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"model config must be valid JSON, got a parse error in {str(path)!r} ({exc}); "
            "pass the model's config.json"
        ) from None
    return config_from_hf(hf, name=hf.get("_name_or_path") or path.parent.name or path.stem)


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on. Defaults are the seed's worked example at EP8 on H800.

    ``layers``: layers that run an all-to-all; ``None`` means the seed convention counts every layer
    (``num_hidden_layers``, 61 for V3, as the seed does) and the byte model counts the MoE layers only
    (``num_hidden_layers - first_k_dense_replace``, 58 for V3). ``attn_us`` / ``moe_us``: the seed's T
    and t, per layer, taken as given in every mode. ``micro_batches``: 1 (no TBO) or 2 (TBO).
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

    def __post_init__(self) -> None:
        validate_inputs(self)

    @property
    def seed_layers(self) -> int:
        return self.layers if self.layers is not None else self.model.num_hidden_layers

    @property
    def model_layers(self) -> int:
        return self.layers if self.layers is not None else self.model.num_moe_layers

    @property
    def is_seed_example(self) -> bool:
        """True when the inputs are the seed's, so its printed figures apply."""
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
        raise ValueError(
            f"batch must be a positive number of tokens per GPU, got {inp.batch}; pass --batch >= 1"
        )
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


# --------------------------------------------------------------------------------------------------
# Byte model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowBytes:
    """Bytes of one token row sent to one destination rank."""

    payload_B: int
    scales_B: int
    metadata_B: int

    @property
    def total_B(self) -> int:
        return self.payload_B + self.scales_B + self.metadata_B


def _activation_row(hidden_size: int, dtype: str) -> tuple[int, int]:
    payload_B = hidden_size * ELEMENT_B[dtype]
    scales_B = math.ceil(hidden_size / FP8_SCALE_BLOCK) * FP8_SCALE_B if dtype == "fp8" else 0
    return payload_B, scales_B


def dispatch_row_bytes(cfg: MoEConfig, dtype: str = "fp8") -> RowBytes:
    """Dispatch row: the activation (+ per-128 fp32 scales for FP8) and the token's routing.

    Metadata counted: the token's K ``topk_ids`` (int64) and K ``topk_weights`` (fp32), as DeepEP's
    normal dispatch sends them. Not counted: the per-rank token counts exchanged before the data
    (P integers per rank per all-to-all, not per token).
    """
    payload_B, scales_B = _activation_row(cfg.hidden_size, dtype)
    return RowBytes(payload_B, scales_B, cfg.num_experts_per_tok * (TOPK_ID_B + TOPK_WEIGHT_B))


def combine_row_bytes(cfg: MoEConfig, dtype: str = "bf16") -> RowBytes:
    """Combine row: one partial output per (token, rank), already reduced over that rank's experts.

    No metadata: the receiver places rows by the layout it kept from dispatch.
    """
    payload_B, scales_B = _activation_row(cfg.hidden_size, dtype)
    return RowBytes(payload_B, scales_B, 0)


# --------------------------------------------------------------------------------------------------
# Fan-out: expected distinct destination ranks per token
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fanout:
    """Destinations of one token at EP size ``ep`` under uniform routing with the model's group limit.

    ``expected_ranks``: distinct ranks owning >= 1 of the token's experts (the local rank included);
    ``expected_remote_ranks`` = (P - 1) / P of it (exact for a uniformly placed source rank);
    ``expected_intranode_ranks`` / ``expected_internode_ranks`` split the remote ones by node;
    ``max_ranks``: the most ranks a token can reach; ``hit_probability_by_rank`` per rank (exact).
    """

    ep: int
    expected_ranks: float
    expected_remote_ranks: float
    expected_intranode_ranks: float
    expected_internode_ranks: float
    max_ranks: int
    expected_remote_experts: float
    hit_probability_by_rank: tuple[float, ...]
    method: str


def _routing_pool(cfg: MoEConfig) -> tuple[int, int, int]:
    """(groups G, experts per group g, groups kept M) as uniform routing sees them."""
    if cfg.topk_method == "greedy":
        # Greedy routing ignores groups: one pool of all experts.
        return 1, cfg.num_experts, 1
    return cfg.n_group, cfg.experts_per_group, cfg.topk_group


def _overlap(lo_a: int, hi_a: int, lo_b: int, hi_b: int) -> int:
    return max(0, min(hi_a, hi_b) - max(lo_a, lo_b))


def _rank_hit_probabilities(cfg: MoEConfig, ep: int) -> list[Fraction]:
    """P(rank r owns >= 1 of a token's experts), exactly, for every rank r.

    Model: the M kept groups are a uniform M-subset of the G groups; the K experts are a uniform
    K-subset of the M*g experts in them. For a given subset S, rank r is missed with probability
    C(M*g - c_r(S), K) / C(M*g, K), where c_r(S) = experts of r inside S. A DP over the groups counts
    the M-subsets by c_r, so the average over all C(G, M) subsets is exact without enumerating them.
    """
    num_groups, group_size, kept = _routing_pool(cfg)
    experts_per_rank = cfg.experts_per_rank(ep)
    k = cfg.num_experts_per_tok
    pool = kept * group_size
    total_subsets = math.comb(num_groups, kept)
    probabilities = []
    for rank in range(ep):
        lo, hi = rank * experts_per_rank, (rank + 1) * experts_per_rank
        # count[m][c] = number of m-subsets of the groups seen so far holding c of this rank's experts.
        count = [[0] * (experts_per_rank + 1) for _ in range(kept + 1)]
        count[0][0] = 1
        for group in range(num_groups):
            inside = _overlap(group * group_size, (group + 1) * group_size, lo, hi)
            for m in range(min(group + 1, kept), 0, -1):
                for c in range(experts_per_rank, inside - 1, -1):
                    count[m][c] += count[m - 1][c - inside]
        miss = Fraction(0)
        for c, subsets in enumerate(count[kept]):
            if subsets:
                miss += Fraction(subsets * math.comb(pool - c, k), total_subsets * math.comb(pool, k))
        probabilities.append(1 - miss)
    return probabilities


def max_destination_ranks(cfg: MoEConfig, ep: int) -> int:
    """The most ranks one token can reach: min(K, P, ranks spanned by the M widest kept groups)."""
    num_groups, group_size, kept = _routing_pool(cfg)
    experts_per_rank = cfg.experts_per_rank(ep)
    spans = sorted(
        (
            sum(
                1 for r in range(ep)
                if _overlap(g * group_size, (g + 1) * group_size, r * experts_per_rank, (r + 1) * experts_per_rank)
            )
            for g in range(num_groups)
        ),
        reverse=True,
    )
    return min(cfg.num_experts_per_tok, ep, sum(spans[:kept]))


def _node_sizes(ep: int, gpus_per_node: int) -> list[int]:
    """Size of the node each rank sits in (ranks fill nodes in order; the last may be partial)."""
    per_node = max(1, gpus_per_node)
    return [min(per_node, ep - (r // per_node) * per_node) for r in range(ep)]


def expected_fanout(cfg: MoEConfig, ep: int, gpus_per_node: int = 8) -> Fanout:
    """Exact expected destination ranks per token (see ``_rank_hit_probabilities`` for the model).

    Remote and intra/inter-node splits average over a uniformly placed source rank s: rank r is
    remote for P - 1 of the P sources, and in s's node for (node size - 1) of them.
    """
    hits = _rank_hit_probabilities(cfg, ep)
    nodes = _node_sizes(ep, gpus_per_node)
    total = sum(hits)
    remote = total * Fraction(ep - 1, ep)
    intranode = sum(p * Fraction(n - 1, ep) for p, n in zip(hits, nodes))
    return Fanout(
        ep=ep,
        expected_ranks=float(total),
        expected_remote_ranks=float(remote),
        expected_intranode_ranks=float(intranode),
        expected_internode_ranks=float(remote - intranode),
        max_ranks=max_destination_ranks(cfg, ep),
        expected_remote_experts=cfg.num_experts_per_tok * (ep - 1) / ep,
        hit_probability_by_rank=tuple(float(p) for p in hits),
        method="exact (rational arithmetic): uniform topk_group groups, then uniform top-k among their experts",
    )


FANOUT_MODELS = ("uniform", "router", "max")


def resolve_fanout(cfg: MoEConfig, ep: int, gpus_per_node: int = 8, fanout_model: str = "uniform") -> Fanout:
    """The fan-out the byte model uses: ``uniform`` (exact, default), ``router`` (Monte-Carlo of the
    project's router on i.i.d. logits, seed 0) or ``max`` (the worst case). The last two rescale the
    exact per-rank split, which is exact when ranks are symmetric (every preset at every EP)."""
    exact = expected_fanout(cfg, ep, gpus_per_node)
    if fanout_model == "uniform":
        return exact
    if fanout_model == "router":
        target, method = simulate_fanout(cfg, ep), "Monte-Carlo: project router on i.i.d. N(0,1) logits, 20000 tokens, seed 0"
    else:
        target, method = float(exact.max_ranks), "worst case: every token reaches max_ranks ranks"
    scale = target / exact.expected_ranks
    return Fanout(
        ep=ep, expected_ranks=target, expected_remote_ranks=exact.expected_remote_ranks * scale,
        expected_intranode_ranks=exact.expected_intranode_ranks * scale,
        expected_internode_ranks=exact.expected_internode_ranks * scale, max_ranks=exact.max_ranks,
        expected_remote_experts=exact.expected_remote_experts,
        hit_probability_by_rank=tuple(min(1.0, p * scale) for p in exact.hit_probability_by_rank), method=method,
    )


def simulate_fanout(cfg: MoEConfig, ep: int, num_tokens: int = 20000, seed: int = 0) -> float:
    """Mean distinct destination ranks when the project's router sees i.i.d. N(0, 1) gate logits.

    A Monte-Carlo check of the uniform model (``torch.Generator`` seeded with ``seed``): for greedy
    routing the two agree (top-k of i.i.d. scores is a uniform k-subset); for group-limited routing the
    router concentrates experts on fewer groups per kept group than uniform choice would, so this is
    usually *higher* than ``expected_fanout`` (each kept group tends to contribute its best expert).
    """
    import torch

    from .routing import select_experts

    generator = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(num_tokens, cfg.num_experts, generator=generator)
    topk_ids_TK = select_experts(logits_TE, cfg).topk_ids_TK
    ranks_TK = topk_ids_TK // cfg.experts_per_rank(ep)
    hit_TP = torch.zeros(num_tokens, ep, dtype=torch.bool)
    hit_TP.scatter_(1, ranks_TK, True)
    return hit_TP.sum(dim=1).double().mean().item()


# --------------------------------------------------------------------------------------------------
# Seed reproduction
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedFigure:
    """One figure of the seed's example: its formula, the exact value, and the seed's rounding.

    ``exact``: in bytes, bytes/s or us (``exact_unit``); ``exact_seed_units``: the same in the seed's
    units (KB = 1024 B, MB = 1000 KB, GB = 1000 MB); ``seed_rounded``: that to 3 significant figures;
    ``seed_printed``: what the seed wrote (only for the seed's own inputs); ``agreement``:
    seed_printed / exact_seed_units - 1; ``exact_si``: the exact value in SI units.
    """

    key: str
    label: str
    formula: str
    exact: float
    exact_unit: str
    seed_unit: str
    exact_seed_units: float
    seed_rounded: float
    seed_printed: float | None
    agreement: float | None
    exact_si: float
    si_unit: str


def round_sig(value: float, digits: int = 3) -> float:
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def seed_figures(inp: PlanInputs) -> list[SeedFigure]:
    """The seed's six figures, each from its formula on ``inp`` in the seed's convention.

    Seed convention: a token is H elements of the dispatch dtype (FP8: H bytes), sent once, the same
    bytes for dispatch and combine, every layer counted, the whole batch in one all-to-all.
    """
    cfg = inp.model
    h, elem = cfg.hidden_size, ELEMENT_B[inp.dispatch_dtype]
    token_B = h * elem
    a2a_B = inp.batch * token_B
    layer_B = 2 * a2a_B
    step_B = inp.seed_layers * layer_B
    per_second_Bps = step_B * 1000.0 / inp.tpot_ms
    budget_us = (inp.attn_us - inp.moe_us) / 2
    rows = [
        ("bytes_per_token", "token on the wire", f"hidden_size x {elem} B = {h} x {elem}",
         token_B, "B", SEED_KB_B, "KB", 1e3, "kB"),
        ("bytes_per_a2a", "one all-to-all", f"batch x token = {inp.batch} x {token_B} B",
         a2a_B, "B", SEED_MB_B, "MB", 1e6, "MB"),
        ("bytes_per_layer", "dispatch + combine per layer", f"2 x a2a = 2 x {a2a_B} B",
         layer_B, "B", SEED_MB_B, "MB", 1e6, "MB"),
        ("bytes_per_step", "all layers per decode step", f"layers x layer = {inp.seed_layers} x {layer_B} B",
         step_B, "B", SEED_MB_B, "MB", 1e6, "MB"),
        ("required_GBps_per_gpu", "per-GPU bandwidth at TPOT",
         f"step / TPOT = {step_B} B x (1000 / {inp.tpot_ms:g} ms)",
         per_second_Bps, "B/s", SEED_GB_B, "GB/s", 1e9, "GB/s"),
        ("a2a_budget_us", "TBO per-all-to-all budget", f"(T - t) / 2 = ({inp.attn_us:g} - {inp.moe_us:g}) / 2",
         budget_us, "us", 1, "us", 1, "us"),
    ]
    figures = []
    for key, label, formula, exact, unit, seed_div, seed_unit, si_div, si_unit in rows:
        in_seed_units = exact / seed_div
        printed = SEED_PRINTED[key][0] if inp.is_seed_example else None
        agreement = None
        if printed is not None:
            agreement = printed / in_seed_units - 1 if in_seed_units else 0.0
        figures.append(SeedFigure(
            key=key, label=label, formula=formula, exact=exact, exact_unit=unit, seed_unit=seed_unit,
            exact_seed_units=in_seed_units, seed_rounded=round_sig(in_seed_units), seed_printed=printed,
            agreement=agreement, exact_si=exact / si_div, si_unit=si_unit,
        ))
    return figures


# --------------------------------------------------------------------------------------------------
# Links, transfer time, calibration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """Bandwidths (per GPU, per direction) and fixed latency the plan predicts with."""

    nvlink_GBps: float
    nic_GBps: float
    gpus_per_node: int
    latency_us: float
    source: str


def datasheet_link(hw: Hardware) -> Link:
    return Link(hw.nvlink_GBps, hw.nic_GBps, hw.gpus_per_node, hw.latency_us, f"datasheet/measured: {hw.source}")


@dataclass(frozen=True)
class Calibration:
    """Bandwidth and latency measured by a benchmark result file of this project."""

    GBps: float
    latency_us: float
    num_rows: int
    method: str
    path: str

    def link(self, hw: Hardware) -> Link:
        # One measured effective bandwidth replaces both link classes: calibrate at the EP you plan for.
        return Link(self.GBps, self.GBps, hw.gpus_per_node, self.latency_us, f"calibrated: {self.path} ({self.method})")


def _positive(row: dict, key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _row_time_us(row: dict) -> float | None:
    """The time the row's ``bytes_sent`` took: t_comm_us, else dispatch + combine, else either one."""
    t_comm = _positive(row, "t_comm_us")
    if t_comm is not None:
        return t_comm
    t_dispatch, t_combine = _positive(row, "t_dispatch_us"), _positive(row, "t_combine_us")
    if t_dispatch is not None and t_combine is not None:
        return t_dispatch + t_combine
    return t_dispatch if t_dispatch is not None else t_combine


def calibrate(path: str | Path, ep: int | None = None) -> Calibration:
    """Fit bandwidth and fixed latency to a result file ``{"meta": {...}, "rows": [...]}`` (DESIGN.md s7).

    With rows of >= 2 distinct ``bytes_sent`` that carry a time, a least-squares fit of
    t_us = latency_us + bytes / (GBps * 1e3) gives both (``algbw`` = bytes / t would fold the latency
    into the bandwidth). Otherwise the bandwidth is the median ``algbw_GBps`` (or ``ref_algbw_GBps``, or
    bytes / t) and the latency 0. Rows whose ``ep`` equals ``ep`` are used when there are any.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"calibrate file must exist, got {str(path)!r}; run a benchmark to write a result JSON "
            "(benchmarks/results/) or drop --calibrate"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"calibrate file must be JSON, got a parse error in {str(path)!r} ({exc}); pass a benchmark result file"
        ) from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(
            f'calibrate file must be {{"meta": {{...}}, "rows": [...]}}, got {type(data).__name__} without '
            f"a rows list in {str(path)!r}; pass a result file written by this project's benchmarks"
        )
    rows = [row for row in rows if isinstance(row, dict)]
    if ep is not None and any(row.get("ep") == ep for row in rows):
        rows = [row for row in rows if row.get("ep") == ep]

    pairs = [
        (_positive(row, "bytes_sent"), _row_time_us(row)) for row in rows
        if _positive(row, "bytes_sent") is not None and _row_time_us(row) is not None
    ]
    if len({b for b, _ in pairs}) >= 2:
        n = len(pairs)
        mean_b = sum(b for b, _ in pairs) / n
        mean_t = sum(t for _, t in pairs) / n
        slope_us_per_B = sum((b - mean_b) * (t - mean_t) for b, t in pairs) / sum((b - mean_b) ** 2 for b, _ in pairs)
        if slope_us_per_B > 0:
            latency_us = max(0.0, mean_t - slope_us_per_B * mean_b)
            return Calibration(
                GBps=1.0 / (slope_us_per_B * B_PER_US_PER_GBPS), latency_us=latency_us, num_rows=n,
                method=f"least-squares t = a + bytes/bw over {n} rows, {len({b for b, _ in pairs})} sizes",
                path=str(path),
            )
    for key in ("algbw_GBps", "ref_algbw_GBps"):
        values = [v for v in (_positive(row, key) for row in rows) if v is not None]
        if values:
            return Calibration(statistics.median(values), 0.0, len(values), f"median {key}, latency 0", str(path))
    if pairs:
        values = [b / (t * B_PER_US_PER_GBPS) for b, t in pairs]
        return Calibration(statistics.median(values), 0.0, len(values), "median bytes_sent / t, latency 0", str(path))
    raise ValueError(
        f"calibrate file must hold rows with algbw_GBps, or bytes_sent with t_comm_us / t_dispatch_us / "
        f"t_combine_us, got none usable among {len(rows)} rows in {str(path)!r}; run a communication "
        "benchmark that records them"
    )


def transfer_time_us(intranode_B: float, internode_B: float, link: Link) -> float:
    """One all-to-all: fixed latency + the slower of the NVLink and NIC parts (they run in parallel)."""
    return link.latency_us + max(intranode_B / link.nvlink_GBps, internode_B / link.nic_GBps) / B_PER_US_PER_GBPS


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteModel:
    """What one GPU sends per decode step under the byte model (the seed's quantities, refined).

    Per all-to-all: one micro-batch (``tokens_per_a2a`` = ceil(batch / micro_batches)) x the expected
    remote ranks x the row. Per layer and step: the whole batch (all micro-batches).
    """

    dispatch_row: RowBytes
    combine_row: RowBytes
    fanout: Fanout
    tokens_per_a2a: int
    bytes_per_token_B: float
    dispatch_bytes_per_a2a_B: float
    combine_bytes_per_a2a_B: float
    bytes_per_layer_B: float
    layers: int
    bytes_per_step_B: float
    required_GBps_per_gpu: float


def byte_model(inp: PlanInputs, gpus_per_node: int | None = None) -> ByteModel:
    cfg = inp.model
    nodes = get_hardware(inp.hw).gpus_per_node if gpus_per_node is None else gpus_per_node
    fanout = resolve_fanout(cfg, inp.ep, nodes, inp.fanout_model)
    d_row, c_row = dispatch_row_bytes(cfg, inp.dispatch_dtype), combine_row_bytes(cfg, inp.combine_dtype)
    per_token_B = fanout.expected_remote_ranks * (d_row.total_B + c_row.total_B)
    tokens_per_a2a = math.ceil(inp.batch / inp.micro_batches)
    layer_B = inp.batch * per_token_B
    step_B = inp.model_layers * layer_B
    return ByteModel(
        dispatch_row=d_row, combine_row=c_row, fanout=fanout, tokens_per_a2a=tokens_per_a2a,
        bytes_per_token_B=per_token_B,
        dispatch_bytes_per_a2a_B=tokens_per_a2a * fanout.expected_remote_ranks * d_row.total_B,
        combine_bytes_per_a2a_B=tokens_per_a2a * fanout.expected_remote_ranks * c_row.total_B,
        bytes_per_layer_B=layer_B, layers=inp.model_layers, bytes_per_step_B=step_B,
        required_GBps_per_gpu=step_B * 1000.0 / inp.tpot_ms / 1e9,
    )


def a2a_time_us(tokens: int, row: RowBytes, fanout: Fanout, link: Link) -> float:
    """Predicted time of one all-to-all of ``tokens`` rows of ``row`` bytes under ``fanout``."""
    return transfer_time_us(
        tokens * fanout.expected_intranode_ranks * row.total_B,
        tokens * fanout.expected_internode_ranks * row.total_B,
        link,
    )


@dataclass(frozen=True)
class SharedExpertEstimate:
    """Roofline *estimate* of the shared-expert MLP (gate, up, down) on ``tokens`` tokens."""

    tokens: int
    flops: float
    bytes_moved_B: float
    compute_us: float
    memory_us: float
    time_us: float
    bound: str
    note: str


def shared_expert_time_us(cfg: MoEConfig, tokens: int, hw: Hardware, weight_dtype: str = "bf16") -> SharedExpertEstimate:
    """max(FLOPs / peak, bytes / HBM) / efficiency: the weights are read once, activations in bf16."""
    inter = cfg.shared_intermediate_size
    weights = 3 * cfg.hidden_size * inter
    flops = 2.0 * tokens * weights
    bytes_moved_B = weights * ELEMENT_B[weight_dtype] + tokens * (2 * cfg.hidden_size + 3 * inter) * 2
    peak_TFLOPs = hw.fp8_TFLOPs if weight_dtype == "fp8" else hw.bf16_TFLOPs
    compute_us = flops / (peak_TFLOPs * 1e6) / SHARED_EXPERT_EFFICIENCY
    memory_us = bytes_moved_B / (hw.hbm_GBps * B_PER_US_PER_GBPS) / SHARED_EXPERT_EFFICIENCY
    return SharedExpertEstimate(
        tokens=tokens, flops=flops, bytes_moved_B=bytes_moved_B, compute_us=compute_us, memory_us=memory_us,
        time_us=max(compute_us, memory_us), bound="compute" if compute_us >= memory_us else "memory",
        note=f"estimate: roofline at {hw.name} datasheet peak x {SHARED_EXPERT_EFFICIENCY} efficiency",
    )


@dataclass(frozen=True)
class OverlapVerdict:
    """Can ``work_us`` hide inside ``window_us``? ``left_us`` = window - work (negative: exposed)."""

    mode: str
    window_us: float | None
    work_us: float | None
    left_us: float | None
    fits: bool | None
    explanation: str


def overlap_verdicts(inp: PlanInputs, model: ByteModel, link: Link, hw: Hardware) -> list[OverlapVerdict]:
    """none, SBO (dispatch, combine) and TBO, each as a window, the work to fit in it, and what is left."""
    cfg, fan = inp.model, model.fanout
    t_dispatch_us = a2a_time_us(inp.batch, model.dispatch_row, fan, link)
    t_combine_us = a2a_time_us(inp.batch, model.combine_row, fan, link)
    verdicts = []

    # none: communication is serial with compute; its window is what TPOT leaves after compute.
    layer_share_us = inp.tpot_ms * 1000.0 / model.layers
    window = (layer_share_us - inp.attn_us - inp.moe_us) / 2
    work = max(t_dispatch_us, t_combine_us)
    verdicts.append(OverlapVerdict(
        "none", window, work, window - work, window >= work,
        f"per a2a: (TPOT/layers - T - t) / 2 = ({layer_share_us:.0f} - {inp.attn_us:g} - {inp.moe_us:g}) / 2 us "
        f"vs slower a2a of the batch ({t_dispatch_us:.1f} dispatch / {t_combine_us:.1f} combine us)"
        + ("; compute alone exceeds the TPOT share" if window < 0 else ""),
    ))

    # SBO: the shared expert hides behind the transfer it runs beside.
    if cfg.num_shared_experts == 0:
        for mode in ("sbo-dispatch", "sbo-combine"):
            verdicts.append(OverlapVerdict(mode, None, None, None, None, f"n/a: {cfg.name} has no shared expert"))
    else:
        shared = shared_expert_time_us(cfg, inp.batch, hw, inp.weight_dtype)
        for mode, transfer_us in (("sbo-dispatch", t_dispatch_us), ("sbo-combine", t_combine_us)):
            left = transfer_us - shared.time_us
            verdicts.append(OverlapVerdict(
                mode, transfer_us, shared.time_us, left, left >= 0,
                f"shared expert {shared.time_us:.1f} us ({shared.bound}-bound {shared.note}) inside the "
                f"{mode.split('-')[1]} transfer {transfer_us:.1f} us; hides {min(transfer_us, shared.time_us):.1f} us",
            ))

    # TBO: with two micro-batches, each a2a must finish in (T - t) / 2 (the seed's rule).
    if inp.micro_batches == 2:
        window = (inp.attn_us - inp.moe_us) / 2
        td = a2a_time_us(model.tokens_per_a2a, model.dispatch_row, fan, link)
        tc = a2a_time_us(model.tokens_per_a2a, model.combine_row, fan, link)
        work = max(td, tc)
        verdicts.append(OverlapVerdict(
            "tbo", window, work, window - work, window >= work,
            f"(T - t) / 2 = {window:g} us vs the slower a2a of a {model.tokens_per_a2a}-token micro-batch "
            f"({td:.1f} dispatch / {tc:.1f} combine us); sum form td + tc = {td + tc:.1f} <= T - t = "
            f"{inp.attn_us - inp.moe_us:g} us is {'met' if td + tc <= inp.attn_us - inp.moe_us else 'not met'}",
        ))
    else:
        verdicts.append(OverlapVerdict("tbo", None, None, None, None, "off: --micro-batches 1"))
    return verdicts


@dataclass(frozen=True)
class SchemeRow:
    """Per-GPU bytes and predicted time per layer (dispatch + combine) for the two schemes at one EP."""

    ep: int
    expected_remote_ranks: float
    allgather_B: float
    alltoall_B: float
    ratio: float
    allgather_us: float
    alltoall_us: float


@dataclass(frozen=True)
class SchemeComparison:
    rows: tuple[SchemeRow, ...]
    crossover_ep: int | None
    note: str


def scheme_comparison(inp: PlanInputs, link: Link, max_ep: int = 256) -> SchemeComparison:
    """allgather + reduce-scatter (every token to every rank) vs alltoall (each token to its ranks).

    allgather: each GPU sends its T rows to the P - 1 others and receives back (P - 1) x T combine rows'
    worth in the reduce-scatter: (P - 1) x T x (dispatch row + combine row). alltoall: expected remote
    ranks x T x the same rows, plus one extra latency for the count exchange before the data.
    Crossover: the smallest EP at which the alltoall's predicted time beats the allgather's.
    """
    cfg = inp.model
    d_B = dispatch_row_bytes(cfg, inp.dispatch_dtype).total_B
    c_B = combine_row_bytes(cfg, inp.combine_dtype).total_B
    rows = []
    for ep in (p for p in divisors(cfg.num_experts) if 2 <= p <= max_ep):
        fan = resolve_fanout(cfg, ep, link.gpus_per_node, inp.fanout_model)
        nodes = _node_sizes(ep, link.gpus_per_node)
        # allgather peers: (node size - 1) inside the node, the rest through the NIC, averaged over ranks.
        ag_intra = sum(n - 1 for n in nodes) / ep
        ag_inter = (ep - 1) - ag_intra
        ag_us = sum(
            transfer_time_us(inp.batch * ag_intra * row_B, inp.batch * ag_inter * row_B, link) for row_B in (d_B, c_B)
        )
        a2a_us = link.latency_us + sum(
            transfer_time_us(
                inp.batch * fan.expected_intranode_ranks * row_B, inp.batch * fan.expected_internode_ranks * row_B, link
            )
            for row_B in (d_B, c_B)
        )
        ag_B = (ep - 1) * inp.batch * (d_B + c_B)
        a2a_B = fan.expected_remote_ranks * inp.batch * (d_B + c_B)
        rows.append(SchemeRow(ep, fan.expected_remote_ranks, ag_B, a2a_B, ag_B / a2a_B, ag_us, a2a_us))
    crossover = next((row.ep for row in rows if row.alltoall_us < row.allgather_us), None)
    note = (
        f"alltoall beats allgather from EP{crossover} at batch {inp.batch}" if crossover
        else f"allgather is never slower up to EP{max_ep} at batch {inp.batch}"
    )
    return SchemeComparison(tuple(rows), crossover, note)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    hardware: Hardware
    link: Link
    seed: tuple[SeedFigure, ...]
    bytes: ByteModel
    t_dispatch_us: float
    t_combine_us: float
    comm_ms_per_step: float
    verdicts: tuple[OverlapVerdict, ...]
    schemes: SchemeComparison
    notes: tuple[str, ...] = field(default_factory=tuple)


def make_plan(inp: PlanInputs, calibration: Calibration | None = None) -> Plan:
    hw = get_hardware(inp.hw)
    link = calibration.link(hw) if calibration is not None else datasheet_link(hw)
    model = byte_model(inp, link.gpus_per_node)
    td = a2a_time_us(inp.batch, model.dispatch_row, model.fanout, link)
    tc = a2a_time_us(inp.batch, model.combine_row, model.fanout, link)
    notes = []
    if hw.gpus_per_node > 1 and inp.ep > hw.gpus_per_node:
        notes.append(
            f"EP{inp.ep} spans {math.ceil(inp.ep / hw.gpus_per_node)} nodes: "
            f"{model.fanout.expected_internode_ranks:.2f} of {model.fanout.expected_remote_ranks:.2f} remote "
            f"ranks per token go through the {link.nic_GBps:g} GB/s NIC"
        )
    if inp.attn_us and model.layers * (inp.attn_us + inp.moe_us) > inp.tpot_ms * 1000:
        notes.append(
            f"compute alone, layers x (T + t) = {model.layers} x {inp.attn_us + inp.moe_us:g} us = "
            f"{model.layers * (inp.attn_us + inp.moe_us) / 1000:.1f} ms, exceeds TPOT {inp.tpot_ms:g} ms"
        )
    return Plan(
        inputs=inp, hardware=hw, link=link, seed=tuple(seed_figures(inp)), bytes=model,
        t_dispatch_us=td, t_combine_us=tc, comm_ms_per_step=model.layers * (td + tc) / 1000,
        verdicts=tuple(overlap_verdicts(inp, model, link, hw)), schemes=scheme_comparison(inp, link),
        notes=tuple(notes),
    )


def plan_to_json(plan: Plan) -> dict:
    """Inputs, the six seed quantities (seed convention and rounding beside the byte model), the rest."""
    inp, model = plan.inputs, plan.bytes
    seed = {fig.key: fig for fig in plan.seed}

    def metric(key: str, model_value) -> dict:
        fig = seed[key]
        return {
            "formula": fig.formula,
            "seed_exact": fig.exact, "seed_exact_unit": fig.exact_unit,
            "seed_rounded": fig.seed_rounded, "seed_unit": fig.seed_unit,
            "seed_printed": fig.seed_printed, "seed_agreement": fig.agreement,
            "exact_si": fig.exact_si, "si_unit": fig.si_unit,
            "model": model_value,
        }

    td_mb = a2a_time_us(model.tokens_per_a2a, model.dispatch_row, model.fanout, plan.link)
    tc_mb = a2a_time_us(model.tokens_per_a2a, model.combine_row, model.fanout, plan.link)
    inputs = {k: v for k, v in asdict(inp).items() if k != "model"}
    inputs.update(model=inp.model.name, seed_layers=inp.seed_layers, model_layers=inp.model_layers)
    return {
        "meta": {"tool": "moe_sbo.planner", "units": "bytes, us, GBps = 1e9 B/s; seed units KB=1024 B, MB=1000 KB, GB=1000 MB"},
        "inputs": inputs,
        "model_config": asdict(inp.model),
        "hardware": asdict(plan.hardware),
        "link": asdict(plan.link),
        "bytes_per_token": metric("bytes_per_token", {
            "dispatch_row_B": asdict(model.dispatch_row) | {"total_B": model.dispatch_row.total_B},
            "combine_row_B": asdict(model.combine_row) | {"total_B": model.combine_row.total_B},
            "expected_remote_ranks": model.fanout.expected_remote_ranks,
            "per_token_all_destinations_B": model.bytes_per_token_B,
        }),
        "bytes_per_a2a": metric("bytes_per_a2a", {
            "tokens_per_a2a": model.tokens_per_a2a,
            "dispatch_B": model.dispatch_bytes_per_a2a_B, "combine_B": model.combine_bytes_per_a2a_B,
        }),
        "bytes_per_layer": metric("bytes_per_layer", {"B": model.bytes_per_layer_B}),
        "bytes_per_step": metric("bytes_per_step", {"B": model.bytes_per_step_B, "layers": model.layers}),
        "required_GBps_per_gpu": metric("required_GBps_per_gpu", {"GBps": model.required_GBps_per_gpu}),
        "a2a_budget_us": metric("a2a_budget_us", {
            "budget_us": (inp.attn_us - inp.moe_us) / 2,
            "micro_batch_dispatch_us": td_mb, "micro_batch_combine_us": tc_mb,
        }),
        "fanout": {k: v for k, v in asdict(model.fanout).items()},
        "transfer": {
            "t_dispatch_us": plan.t_dispatch_us, "t_combine_us": plan.t_combine_us,
            "comm_ms_per_step": plan.comm_ms_per_step,
        },
        "verdicts": [asdict(v) for v in plan.verdicts],
        "schemes": {
            "rows": [asdict(r) for r in plan.schemes.rows],
            "crossover_ep": plan.schemes.crossover_ep, "note": plan.schemes.note,
        },
        "notes": list(plan.notes),
    }


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    t_dispatch_us: float
    t_combine_us: float
    micro_batch_a2a_us: float
    required_GBps_per_gpu: float
    seed_required_GBps_per_gpu: float
    tbo_required_GBps: float | None


def sweep_batches(inp: PlanInputs, batches: list[int], link: Link) -> list[SweepPoint]:
    """The plan at each batch size: a2a times on ``link`` and the bandwidth each budget requires.

    ``tbo_required_GBps``: the link speed at which a micro-batch's slower a2a just fits (T - t) / 2
    after the fixed latency (None when the latency alone does not fit).
    """
    points = []
    window_us = (inp.attn_us - inp.moe_us) / 2
    for batch in batches:
        point_inp = PlanInputs(**{**{f: getattr(inp, f) for f in inp.__dataclass_fields__}, "batch": batch,
                                  "micro_batches": min(inp.micro_batches, batch)})
        model = byte_model(point_inp, link.gpus_per_node)
        fan = model.fanout
        td = a2a_time_us(batch, model.dispatch_row, fan, link)
        tc = a2a_time_us(batch, model.combine_row, fan, link)
        mb = max(a2a_time_us(model.tokens_per_a2a, row, fan, link) for row in (model.dispatch_row, model.combine_row))
        mb_B = max(model.dispatch_bytes_per_a2a_B, model.combine_bytes_per_a2a_B)
        usable_us = window_us - link.latency_us
        seed_step = next(f.exact for f in seed_figures(point_inp) if f.key == "bytes_per_step")
        points.append(SweepPoint(
            batch=batch, t_dispatch_us=td, t_combine_us=tc, micro_batch_a2a_us=mb,
            required_GBps_per_gpu=model.required_GBps_per_gpu,
            seed_required_GBps_per_gpu=seed_step * 1000.0 / inp.tpot_ms / 1e9,
            tbo_required_GBps=mb_B / usable_us / B_PER_US_PER_GBPS if usable_us > 0 else None,
        ))
    return points

"""The byte model: what a DeepEP-"normal"-style all-to-all really moves per GPU, and how long it takes.

Per token and destination: an FP8 row with per-128 fp32 scales and the token's routing (``topk_ids``
int64 + ``topk_weights`` fp32) on dispatch, a BF16 row on combine, each token sent once per *remote*
destination rank.

What is hard: **fan-out under group limits.** A token goes to each *rank* that owns one of its top-k
experts, so bytes scale with the expected number of distinct destination ranks, not with k. With
DeepSeek-V3 at EP8 a group of 32 experts is exactly one rank and 4 groups are kept, so at most 4 ranks.
We compute the expectation *exactly* (``expected_fanout``: rational arithmetic over group choices) under
the uniform-routing model "topk_group groups chosen uniformly, then top-k uniformly among their
experts". The real group-limited router on i.i.d. scores is not that model (kept groups were kept
*because* their best experts score high, so each tends to contribute one); ``simulate_fanout`` runs the
project's router on seeded random scores to show the gap. Local traffic is excluded exactly: for a
uniformly placed source rank, (P - 1) / P of the expected destinations are remote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ..config import MoEConfig
from .inputs import ELEMENT_B, PlanInputs, get_hardware
from .links import Link, transfer_time_us

# --------------------------------------------------------------------------------------------------
# Rows: bytes of one token to one destination rank
# --------------------------------------------------------------------------------------------------

FP8_SCALE_BLOCK = 128  # DeepSeek-V3 / DeepEP quantise activations per 1x128 block ...
FP8_SCALE_B = 4  # ... with one fp32 scale per block.
TOPK_ID_B = 8  # topk_ids travel as int64 (DeepEP normal dispatch sends the [T, K] int64 tensor) ...
TOPK_WEIGHT_B = 4  # ... and topk_weights as float32.


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


def rank_hit_probabilities(cfg: MoEConfig, ep: int) -> list[Fraction]:
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
                1
                for r in range(ep)
                if _overlap(g * group_size, (g + 1) * group_size, r * experts_per_rank, (r + 1) * experts_per_rank)
            )
            for g in range(num_groups)
        ),
        reverse=True,
    )
    return min(cfg.num_experts_per_tok, ep, sum(spans[:kept]))


def node_sizes(ep: int, gpus_per_node: int) -> list[int]:
    """Size of the node each rank sits in (ranks fill nodes in order; the last may be partial)."""
    per_node = max(1, gpus_per_node)
    return [min(per_node, ep - (r // per_node) * per_node) for r in range(ep)]


def expected_fanout(cfg: MoEConfig, ep: int, gpus_per_node: int = 8) -> Fanout:
    """Exact expected destination ranks per token (see ``rank_hit_probabilities`` for the model).

    Remote and intra/inter-node splits average over a uniformly placed source rank s: rank r is
    remote for P - 1 of the P sources, and in s's node for (node size - 1) of them.
    """
    hits = rank_hit_probabilities(cfg, ep)
    nodes = node_sizes(ep, gpus_per_node)
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


def resolve_fanout(cfg: MoEConfig, ep: int, gpus_per_node: int = 8, fanout_model: str = "uniform") -> Fanout:
    """The fan-out the byte model uses: ``uniform`` (exact, default), ``router`` (Monte-Carlo of the
    project's router on i.i.d. logits, seed 0) or ``max`` (the worst case). The last two rescale the
    exact per-rank split, which is exact when ranks are symmetric (every preset at every EP)."""
    exact = expected_fanout(cfg, ep, gpus_per_node)
    if fanout_model == "uniform":
        return exact
    if fanout_model == "router":
        target, method = (
            simulate_fanout(cfg, ep),
            "Monte-Carlo: project router on i.i.d. N(0,1) logits, 20000 tokens, seed 0",
        )
    else:
        target, method = float(exact.max_ranks), "worst case: every token reaches max_ranks ranks"
    scale = target / exact.expected_ranks
    return Fanout(
        ep=ep,
        expected_ranks=target,
        expected_remote_ranks=exact.expected_remote_ranks * scale,
        expected_intranode_ranks=exact.expected_intranode_ranks * scale,
        expected_internode_ranks=exact.expected_internode_ranks * scale,
        max_ranks=exact.max_ranks,
        expected_remote_experts=exact.expected_remote_experts,
        hit_probability_by_rank=tuple(min(1.0, p * scale) for p in exact.hit_probability_by_rank),
        method=method,
    )


def simulate_fanout(cfg: MoEConfig, ep: int, num_tokens: int = 20000, seed: int = 0) -> float:
    """Mean distinct destination ranks when the project's router sees i.i.d. N(0, 1) gate logits.

    A Monte-Carlo check of the uniform model (``torch.Generator`` seeded with ``seed``): for greedy
    routing the two agree (top-k of i.i.d. scores is a uniform k-subset); for group-limited routing the
    router concentrates experts on fewer groups per kept group than uniform choice would, so this is
    usually *higher* than ``expected_fanout`` (each kept group tends to contribute its best expert).
    """
    import torch

    from ..routing.router import select_experts

    generator = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(num_tokens, cfg.num_experts, generator=generator)
    topk_ids_TK = select_experts(logits_TE, cfg).topk_ids_TK
    ranks_TK = topk_ids_TK // cfg.experts_per_rank(ep)
    hit_TP = torch.zeros(num_tokens, ep, dtype=torch.bool)
    hit_TP.scatter_(1, ranks_TK, True)
    return hit_TP.sum(dim=1).double().mean().item()


# --------------------------------------------------------------------------------------------------
# The byte model per step, and the time of one all-to-all
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteModel:
    """What one GPU sends per decode step under the byte model (the worked example's quantities, refined).

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
        dispatch_row=d_row,
        combine_row=c_row,
        fanout=fanout,
        tokens_per_a2a=tokens_per_a2a,
        bytes_per_token_B=per_token_B,
        dispatch_bytes_per_a2a_B=tokens_per_a2a * fanout.expected_remote_ranks * d_row.total_B,
        combine_bytes_per_a2a_B=tokens_per_a2a * fanout.expected_remote_ranks * c_row.total_B,
        bytes_per_layer_B=layer_B,
        layers=inp.model_layers,
        bytes_per_step_B=step_B,
        required_GBps_per_gpu=step_B * 1000.0 / inp.tpot_ms / 1e9,
    )


def a2a_time_us(tokens: int, row: RowBytes, fanout: Fanout, link: Link) -> float:
    """Predicted time of one all-to-all of ``tokens`` rows of ``row`` bytes under ``fanout``."""
    return transfer_time_us(
        tokens * fanout.expected_intranode_ranks * row.total_B,
        tokens * fanout.expected_internode_ranks * row.total_B,
        link,
    )

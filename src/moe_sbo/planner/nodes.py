"""Node-aware dispatch in the byte model: how many times a token crosses between nodes, flat against
node-aware, and what each costs on an NVLink + NIC pair.

Flat (``alltoall``): a token goes to every rank owning one of its experts, so it crosses once per
distinct rank on another node. Node-aware (``node_aware``): it crosses once per distinct *node* with
one of its experts, to the same-rail rank there, which forwards it over NVLink to the node's other
ranks that need it. Combine mirrors dispatch with one partial sum per crossing.

What is hard: **crossings under group limits.** DeepSeek-V3 keeps 4 of 8 expert groups per token; when
the nodes hold whole groups (8 groups over 2, 4 or 8 nodes) a token reaches at most 4 nodes, however
many ranks. The expected count comes from the same exact model as the flat fan-out
(``bytes.rank_hit_probabilities`` with nodes in place of ranks: a node is a "rank" owning E / N
experts), so the two are compared under one assumption; ``simulate_fanout`` gives the router's own.

Per GPU and token, with R the expected distinct ranks hit, N nodes of G ranks, and ``n`` the expected
distinct nodes hit:

- flat: R (P - 1) / P rows leave the rank; of them R (P - G) / P cross nodes, R (G - 1) / P stay;
- node-aware: n (N - 1) / N rows cross (leg 1); each node a token reaches forwards it to the ranks hit
  there other than the forwarder, R (1 - 1/G) rows per token inside nodes (leg 2; the forwarder is hit
  with the probability of any rank, R / P, by symmetry).

Time of one phase: flat runs both link classes at once, latency + max(intra / NVLink, inter / NIC);
node-aware's legs follow each other per chunk, so one chunk costs 2 latencies + intra / NVLink + inter /
NIC, and with chunks pipelined the slower leg sets the pace: 2 latencies + max(...). Both are printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..config import MoEConfig
from .bytes import RowBytes, combine_row_bytes, dispatch_row_bytes, rank_hit_probabilities
from .inputs import B_PER_US_PER_GBPS
from .links import Link


@dataclass(frozen=True)
class Crossings:
    """Rows per token that one GPU sends, by link class, flat and node-aware, at EP ``ep`` with
    ``gpus_per_node`` ranks per node."""

    ep: int
    gpus_per_node: int
    expected_ranks: float
    expected_nodes: float
    max_nodes: int
    flat_internode: float
    flat_intranode: float
    node_aware_internode: float
    node_aware_intranode: float

    @property
    def num_nodes(self) -> int:
        return self.ep // self.gpus_per_node

    @property
    def internode_ratio(self) -> float:
        """Flat crossings / node-aware crossings (how many times fewer bytes cross nodes)."""
        return self.flat_internode / self.node_aware_internode if self.node_aware_internode else float("inf")


def crossings(cfg: MoEConfig, ep: int, gpus_per_node: int = 8) -> Crossings:
    """Expected rows per token by link class (exact, uniform routing with the model's group limit)."""
    if ep % gpus_per_node or cfg.num_experts % ep:
        raise ValueError(
            f"the EP size must be whole nodes of {gpus_per_node} GPUs and divide {cfg.num_experts} experts, got "
            f"EP{ep}; choose an EP size that is a multiple of {gpus_per_node} and divides the experts"
        )
    nodes = ep // gpus_per_node
    ranks_hit = sum(rank_hit_probabilities(cfg, ep), Fraction(0))
    nodes_hit = sum(rank_hit_probabilities(cfg, nodes), Fraction(0))
    return Crossings(
        ep=ep,
        gpus_per_node=gpus_per_node,
        expected_ranks=float(ranks_hit),
        expected_nodes=float(nodes_hit),
        max_nodes=max_nodes(cfg, nodes),
        flat_internode=float(ranks_hit * Fraction(ep - gpus_per_node, ep)),
        flat_intranode=float(ranks_hit * Fraction(gpus_per_node - 1, ep)),
        node_aware_internode=float(nodes_hit * Fraction(nodes - 1, nodes)),
        node_aware_intranode=float(ranks_hit * (1 - Fraction(1, gpus_per_node))),
    )


def max_nodes(cfg: MoEConfig, num_nodes: int) -> int:
    """The most nodes one token can reach (the kept groups' span, at most K and N)."""
    from .bytes import max_destination_ranks

    return max_destination_ranks(cfg, num_nodes)


@dataclass(frozen=True)
class PhaseTimes:
    """One phase (dispatch or combine) of ``tokens`` tokens per GPU, µs: flat; node-aware with its legs
    one after the other, and with chunks pipelined (the slower leg sets the pace)."""

    flat_us: float
    node_aware_us: float
    node_aware_pipelined_us: float


def phase_times(tokens: int, row: RowBytes, c: Crossings, link: Link) -> PhaseTimes:
    def us(rows: float, GBps: float) -> float:
        return tokens * rows * row.total_B / GBps / B_PER_US_PER_GBPS

    flat = link.latency_us + max(us(c.flat_intranode, link.nvlink_GBps), us(c.flat_internode, link.nic_GBps))
    across, inside = us(c.node_aware_internode, link.nic_GBps), us(c.node_aware_intranode, link.nvlink_GBps)
    return PhaseTimes(flat, 2 * link.latency_us + across + inside, 2 * link.latency_us + max(across, inside))


@dataclass(frozen=True)
class NodeAwareRow:
    """Dispatch + combine at one EP size: crossings and times, flat vs node-aware."""

    crossings: Crossings
    dispatch: PhaseTimes
    combine: PhaseTimes

    @property
    def flat_us(self) -> float:
        return self.dispatch.flat_us + self.combine.flat_us

    @property
    def node_aware_us(self) -> float:
        return self.dispatch.node_aware_pipelined_us + self.combine.node_aware_pipelined_us


def compare(
    cfg: MoEConfig,
    ep_sizes: tuple[int, ...],
    tokens: int,
    link: Link,
    dispatch_dtype: str = "fp8",
    combine_dtype: str = "bf16",
) -> list[NodeAwareRow]:
    """Flat vs node-aware dispatch + combine of ``tokens`` tokens per GPU at each EP size (whole nodes
    of ``link.gpus_per_node``)."""
    d_row, c_row = dispatch_row_bytes(cfg, dispatch_dtype), combine_row_bytes(cfg, combine_dtype)
    rows = []
    for ep in ep_sizes:
        c = crossings(cfg, ep, link.gpus_per_node)
        rows.append(NodeAwareRow(c, phase_times(tokens, d_row, c, link), phase_times(tokens, c_row, c, link)))
    return rows

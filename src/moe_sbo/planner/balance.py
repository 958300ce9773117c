"""Expert load balance per EP size: how evenly each placement policy spreads a per-expert load over the
ranks (max over mean of the rank loads), and what that predicts for the MoE's expert time.

Every rank waits for the most loaded one at combine, so at a fixed total the routed experts' time
scales with the max over mean of the rank loads: ``gain`` = trivial's max/mean ÷ the policy's is the
predicted speed-up of that phase. Not counted: the weights the redundant slots hold and the transfer a
rebalance costs (``moe-sbo bench eplb`` measures both). Placements are ``moe_sbo.eplb``'s (imported
when a plan asks, so the planner imports no torch until then).

The hard part is which placements exist: ``hierarchical`` puts whole expert groups on nodes
(num_nodes = EP / 8 from EP16, the model's ``n_group`` groups), which needs the groups to split evenly
over the nodes and enough experts per node for the redundant slots; a cell that cannot be placed is
``None`` with the reason in ``notes``, never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import MoEConfig, divisors

DEFAULT_BALANCE_EP = (8, 32, 64)
DEFAULT_REDUNDANT = (0, 1, 2)
GPUS_PER_NODE = 8  # the node size hierarchical placement assumes (DeepSeek's, an 8-GPU node)


@dataclass(frozen=True)
class BalanceRow:
    """One EP size and redundant count: max/mean rank load per policy (None: cannot be placed) and
    ``gain_*`` = trivial's / the policy's."""

    ep: int
    redundant_per_rank: int
    num_nodes: int
    trivial: float
    global_: float | None
    hierarchical: float | None
    gain_global: float | None
    gain_hierarchical: float | None


@dataclass(frozen=True)
class LoadBalance:
    """The balance table for one model and load: ``source`` (a load file, or ``zipf:S``), the load's own
    max/mean over experts, its rows, and why cells are empty (``notes``: the cells, then the reason)."""

    model: str
    num_experts: int
    source: str
    expert_max_over_mean: float
    rows: list[BalanceRow]
    notes: list[str]


def nodes_for(ep: int) -> int:
    """Nodes of ``GPUS_PER_NODE`` GPUs an EP group spans for hierarchical placement: 1 below EP16."""
    return ep // GPUS_PER_NODE if ep >= 2 * GPUS_PER_NODE and ep % GPUS_PER_NODE == 0 else 1


def check_balance_sizes(model: MoEConfig, ep_sizes: Sequence[int], redundant: Sequence[int]) -> None:
    """``ValueError`` naming the option and the fix for EP sizes that do not divide the experts or
    negative redundant counts."""
    bad = [ep for ep in ep_sizes if ep < 1 or model.num_experts % ep]
    if not ep_sizes or bad:
        raise ValueError(
            f"--eplb-ep must be EP sizes that divide the {model.num_experts} routed experts of {model.name}, "
            f"got {list(ep_sizes)}; choose among {divisors(model.num_experts)}"
        )
    if not redundant or min(redundant) < 0:
        raise ValueError(f"--redundant must be counts >= 0 (extra expert slots per rank), got {list(redundant)}")


def load_balance(
    model: MoEConfig,
    load_E: Sequence[float],
    source: str,
    ep_sizes: Sequence[int] | None = None,
    redundant: Sequence[int] = DEFAULT_REDUNDANT,
) -> LoadBalance:
    """Max/mean rank load of ``load_E`` [E] under trivial, global and hierarchical placement at each EP
    size (default: those of ``DEFAULT_BALANCE_EP`` that divide the experts) and redundant count."""
    import torch

    from ..eplb import placement_for, trivial_placement

    if ep_sizes is None:
        ep_sizes = [ep for ep in DEFAULT_BALANCE_EP if model.num_experts % ep == 0] or [1]
    check_balance_sizes(model, ep_sizes, redundant)
    if len(load_E) != model.num_experts:
        raise ValueError(
            f"the load must have one entry per expert of {model.name} ({model.num_experts}), got {len(load_E)}; "
            "use a load recorded with the same model"
        )
    load = torch.tensor(list(load_E), dtype=torch.float64)
    rows: list[BalanceRow] = []
    why_not: dict[str, list[str]] = {}  # reason -> the cells it empties
    for ep in ep_sizes:
        trivial = trivial_placement(model.num_experts, ep).balance(load)
        nodes = nodes_for(ep)
        for extra in redundant:
            cells: dict[str, float | None] = {}
            for policy in ("global", "hierarchical"):
                try:
                    placement = placement_for(policy, load, ep, extra, num_nodes=nodes, num_groups=model.n_group)
                except ValueError as err:
                    cells[policy] = None
                    why_not.setdefault(str(err), []).append(f"EP{ep} +{extra}")
                    continue
                cells[policy] = placement.balance(load)
            rows.append(
                BalanceRow(
                    ep=ep,
                    redundant_per_rank=extra,
                    num_nodes=nodes,
                    trivial=trivial,
                    global_=cells["global"],
                    hierarchical=cells["hierarchical"],
                    gain_global=None if cells["global"] is None else trivial / cells["global"],
                    gain_hierarchical=None if cells["hierarchical"] is None else trivial / cells["hierarchical"],
                )
            )
    notes = [f"{', '.join(cells)}: {reason}" for reason, cells in why_not.items()]
    mean = float(load.mean())
    return LoadBalance(
        model=model.name,
        num_experts=model.num_experts,
        source=source,
        expert_max_over_mean=float(load.max()) / mean if mean > 0 else 1.0,
        rows=rows,
        notes=notes,
    )

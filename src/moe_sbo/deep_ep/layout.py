"""``get_dispatch_layout``'s counts: where each token goes, computed from its top-k expert ids.

Legend: see ``moe_sbo/__init__.py``; here N is the nodes of the EP group (DeepEP's "RDMA ranks") and
G the ranks of one node (P = N * G). The hard part is -1: an id of -1 is "no expert", so a token may
go to fewer ranks than it has choices, or to none; every count skips it without a host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch.layout import count_per_key


@dataclass(frozen=True)
class DispatchLayout:
    """``num_tokens_per_rank_P`` int32 [P]: tokens with at least one expert on each rank;
    ``num_tokens_per_node_N`` int32 [N] (None when N = 1): tokens with one on each node;
    ``num_tokens_per_expert_E`` int32 [E]: (token, choice) pairs per expert;
    ``is_token_in_rank_TP`` bool [T, P]: whether token t goes to rank p."""

    num_tokens_per_rank_P: torch.Tensor
    num_tokens_per_node_N: torch.Tensor | None
    num_tokens_per_expert_E: torch.Tensor
    is_token_in_rank_TP: torch.Tensor


def check_topk_idx(topk_idx_TK: torch.Tensor, name: str = "topk_idx") -> None:
    """Shape and dtype of a top-k id tensor (its values are data, checked where they are used)."""
    if not isinstance(topk_idx_TK, torch.Tensor) or topk_idx_TK.dim() != 2:
        shape = tuple(topk_idx_TK.shape) if isinstance(topk_idx_TK, torch.Tensor) else type(topk_idx_TK).__name__
        raise ValueError(f"{name} must be a [num_tokens, num_topk] tensor, got {shape}")
    if topk_idx_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int64 (deep_ep.topk_idx_t) or int32, got {topk_idx_TK.dtype}")


def dispatch_layout(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int) -> DispatchLayout:
    """The counts of ``Buffer.get_dispatch_layout`` for ids in ``[-1, num_experts)``.

    Sync: device operations on the current stream, no host read; CUDA-graph safe."""
    check_topk_idx(topk_idx_TK)
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts must be a positive multiple of the EP size {num_ranks}, got {num_experts}")
    num_tokens = topk_idx_TK.shape[0]
    ids_TK = topk_idx_TK.long()
    is_chosen_TK = ids_TK >= 0
    # Column P (and expert E) collect the -1 choices, so every scatter stays in range without a read.
    owner_TK = torch.where(is_chosen_TK, torch.div(ids_TK, num_experts // num_ranks, rounding_mode="floor"), num_ranks)
    is_token_in_rank_TP = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=ids_TK.device)
    is_token_in_rank_TP = is_token_in_rank_TP.scatter_(1, owner_TK, True)[:, :num_ranks]
    per_expert = count_per_key(torch.where(is_chosen_TK, ids_TK, num_experts).reshape(-1), num_experts + 1)
    num_nodes = num_ranks // ranks_per_node
    per_node = None
    if num_nodes > 1:
        is_in_node_TN = is_token_in_rank_TP.view(num_tokens, num_nodes, ranks_per_node).any(dim=2)
        per_node = is_in_node_TN.sum(dim=0, dtype=torch.int32)
    return DispatchLayout(
        num_tokens_per_rank_P=is_token_in_rank_TP.sum(dim=0, dtype=torch.int32),
        num_tokens_per_node_N=per_node,
        num_tokens_per_expert_E=per_expert[:num_experts].int(),
        is_token_in_rank_TP=is_token_in_rank_TP,
    )


def align_counts(counts: list[int], alignment: int) -> list[int]:
    """Each count rounded up to a multiple of ``alignment`` (DeepEP's ``expert_alignment``)."""
    return [-(-c // alignment) * alignment for c in counts]

"""``low_latency``'s torch reference path: the send plan, the receiver's fixed-shape expert layout and
combine's per-slot reduction, as chains of torch ops with no host read (any device). The fused
kernels (``kernels/``) produce the same bytes and indices; the tests hold them to this.

Legend: see ``moe_sbo/__init__.py``.

The hard part is the receiver's layout: grouped GEMM needs rows grouped by expert, but the number of
rows per expert is data. A fixed R = S * K rows are laid out expert-major with the real rows first and
the per-expert counts on the device, so no shape depends on data and nothing is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import ExpertLayout


@dataclass(frozen=True)
class SendPlan:
    """Where each token goes. ``slot_TP`` int64 [T, P]: the slot ``p * C + row`` of token t in block p,
    or S when t has no expert on rank p. ``token_S`` int64 [S]: the token in each slot, or T (the
    padding row) for an empty slot."""

    slot_TP: torch.Tensor
    token_S: torch.Tensor


def plan_send(ids_TK: torch.Tensor, num_local_experts: int, num_ranks: int, capacity: int) -> SendPlan:
    """Rank-deduplicated placement of ``T <= capacity`` tokens into P blocks of ``capacity`` rows.

    Ids of -1 ("no expert") send nothing. All on the device, no host read: a token's row in block p
    is how many earlier tokens also go to p (a cumulative sum), so blocks keep token order.
    """
    num_tokens = ids_TK.shape[0]
    device = ids_TK.device
    num_slots = num_ranks * capacity
    ids_TK = ids_TK.long()
    # Column P collects "no expert", so scatter needs no mask; it is dropped after.
    owner_TK = torch.where(ids_TK >= 0, torch.div(ids_TK, num_local_experts, rounding_mode="floor"), num_ranks)
    is_sent_TP = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=device)
    is_sent_TP = is_sent_TP.scatter_(1, owner_TK, True)[:, :num_ranks]
    # Prefix sum along the contiguous dimension: a scan down few columns of many rows is sequential on CUDA.
    row_TP = (is_sent_TP.t().long().cumsum(dim=1) - 1).t()
    first_slot_P = torch.arange(num_ranks, device=device) * capacity
    slot_TP = torch.where(is_sent_TP, first_slot_P + row_TP, num_slots)
    # Slot S is scratch: every "not sent" (t, p) lands there, and it is cut off.
    token_S = torch.full((num_slots + 1,), num_tokens, dtype=torch.int64, device=device)
    token_TP = torch.arange(num_tokens, device=device)[:, None].expand(num_tokens, num_ranks)
    token_S.scatter_(0, slot_TP.reshape(-1), token_TP.reshape(-1))
    return SendPlan(slot_TP=slot_TP, token_S=token_S[:num_slots])


@dataclass(frozen=True)
class FixedLayout:
    """The receiver's expert-major layout of R = S * K rows, and its inverse for combine.

    ``layout.row_R``: slot of each expert row (S, the zero padding slot, for padding rows);
    ``layout.weight_R`` float32 (0 on padding rows); ``layout.num_rows_per_expert_L`` int64 real
    rows per local expert, on the device. ``pair_row_SK``: the expert row of pair (slot, k);
    ``pair_weight_SK`` float32 its weight, 0 where the pair is not a local expert's;
    ``is_local_SK`` bool.
    """

    layout: ExpertLayout
    pair_row_SK: torch.Tensor
    pair_weight_SK: torch.Tensor
    is_local_SK: torch.Tensor


def group_slots_by_expert(local_ids_SK: torch.Tensor, weights_SK: torch.Tensor, num_local_experts: int) -> FixedLayout:
    """Every (slot, k) pair in expert order (stable: slot order inside an expert), real pairs first,
    pairs with local id -1 after them. Fixed shapes, no host read.

    X: the S * K pairs, flattened; Y: the L + 1 sort keys (each local expert, then "not local").
    """
    num_slots, k = local_ids_SK.shape
    device = local_ids_SK.device
    is_local_SK = local_ids_SK >= 0
    # Non-local pairs get key L: a counting sort puts them after every expert's rows.
    key_X = torch.where(is_local_SK, local_ids_SK.long(), num_local_experts).reshape(-1)
    # Counting sort by one-hot prefix sums, not torch.sort, whose radix sort is the slower at decode
    # sizes. The one-hot is [keys, pairs] so each prefix sum runs along the contiguous dimension (on
    # CUDA a scan down a few columns of many rows is sequential).
    # A comparison, not F.one_hot, which may read the keys' range on the host.
    one_hot_YX = (torch.arange(num_local_experts + 1, device=device)[:, None] == key_X[None, :]).to(torch.int32)
    seen_YX = one_hot_YX.cumsum(dim=1, dtype=torch.int32)
    counts_Y = (
        seen_YX[:, -1].long() if key_X.numel() else torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    )
    start_Y = counts_Y.cumsum(0) - counts_Y
    rank_in_key_X = seen_YX.gather(0, key_X[None, :]).squeeze(0).long() - 1
    pair_row_X = start_Y[key_X] + rank_in_key_X  # where pair x lands in expert order
    order_R = torch.empty_like(pair_row_X).scatter_(0, pair_row_X, torch.arange(key_X.shape[0], device=device))
    is_real_R = torch.arange(key_X.shape[0], device=device) < start_Y[num_local_experts]
    row_R = torch.where(is_real_R, torch.div(order_R, k, rounding_mode="floor"), num_slots)
    pair_weight_SK = torch.where(is_local_SK, weights_SK.float(), 0.0)
    layout = ExpertLayout(
        row_R=row_R, weight_R=pair_weight_SK.reshape(-1)[order_R], num_rows_per_expert_L=counts_Y[:num_local_experts]
    )
    return FixedLayout(layout, pair_row_X.view(num_slots, k), pair_weight_SK, is_local_SK)


def reduce_pairs(expert_y_RH: torch.Tensor, fixed: FixedLayout) -> torch.Tensor:
    """Each slot's weighted sum over its local experts' outputs: ``[S, H]`` in ``expert_y``'s dtype.

    A gather back to slot order, then one batched ``[1, K] x [K, H]`` product per slot: no atomics,
    and the product accumulates in float32 (the weights are rounded to the activation dtype first).
    Non-local pairs gather padding rows, whose outputs are undefined: they are zeroed, not weighted.
    """
    num_slots, k = fixed.pair_row_SK.shape
    y_SKH = expert_y_RH.index_select(0, fixed.pair_row_SK.reshape(-1)).view(num_slots, k, -1)
    y_SKH.masked_fill_(~fixed.is_local_SK[:, :, None], 0)
    weights_S1K = fixed.pair_weight_SK.to(expert_y_RH.dtype)[:, None, :]
    return torch.bmm(weights_S1K, y_SKH).squeeze(1)

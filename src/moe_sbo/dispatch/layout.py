"""Index logic every dispatcher shares: group moved token rows by local expert, and fold them back.

Legend: see ``moe_sbo/__init__.py``.

A token row carries K local expert ids (``-1`` where the choice belongs to another rank). The
expert-major layout lists every (row, k) pair with a local expert, sorted by expert and, inside an
expert, by row (a stable sort, so the order is deterministic). Combining is the inverse: each pair's
expert output times its weight, summed into its row, accumulated in float32 in a fixed order
(``reduce.gather_sum``: no float atomics, the same bits every run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reduce import gather_sum


@dataclass(frozen=True)
class ExpertLayout:
    """Where each expert input row comes from.

    ``row_R`` int64 index into the M moved rows; ``weight_R`` float32 top-k weight of the pair;
    ``num_rows_per_expert_L`` int64 (same device) rows per local expert, in expert order;
    ``pair_MK`` int64, the inverse of ``row_R``: the pair index of row m's k-th choice, R where that
    choice is not local (what ``combine_rows`` reads; None in layouts combined by other means).
    """

    row_R: torch.Tensor
    weight_R: torch.Tensor
    num_rows_per_expert_L: torch.Tensor
    pair_MK: torch.Tensor | None = None


def count_per_key(keys_X: torch.Tensor, num_keys: int) -> torch.Tensor:
    """How many of ``keys_X`` (int64, each in ``[0, num_keys)``) take each value: int64 ``[num_keys]``.

    ``scatter_add_`` rather than ``torch.bincount``: bincount sizes its output from the data, which
    on CUDA is a host read of the maximum, a synchronisation on every dispatch.
    """
    counts = torch.zeros(num_keys, dtype=torch.int64, device=keys_X.device)
    return counts.scatter_add_(0, keys_X, torch.ones_like(keys_X))


def nonzero_static(mask: torch.Tensor, size: int) -> torch.Tensor:
    """``mask.nonzero()`` when the count is already known: no device-to-host read."""
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(mask, size=size)
    return mask.nonzero()


def group_rows_by_expert(
    local_ids_MK: torch.Tensor,
    weights_MK: torch.Tensor,
    num_local_experts: int,
    num_pairs: int | None = None,
) -> ExpertLayout:
    """Expert-major layout of the (row, k) pairs whose ``local_ids_MK`` is in ``[0, L)``.

    Pairs marked ``-1`` are not this rank's. ``num_pairs`` (R), when the caller already knows it
    on the host, saves the one host synchronisation this otherwise needs. X: the M * K pairs, flattened.
    """
    num_rows, k = local_ids_MK.shape
    ids_X = local_ids_MK.reshape(-1).long()
    is_local_X = ids_X >= 0
    # Non-local pairs get key L so a stable sort puts them after every local expert's rows.
    key_X = torch.where(is_local_X, ids_X, num_local_experts)
    counts = count_per_key(key_X, num_local_experts + 1)
    if num_pairs is None:
        num_pairs = int(is_local_X.sum().item())
    order_R = torch.sort(key_X, stable=True).indices[:num_pairs]
    pair_X = torch.full_like(ids_X, num_pairs)  # non-local choices point one past the last pair
    pair_X[order_R] = torch.arange(num_pairs, device=ids_X.device)
    return ExpertLayout(
        row_R=torch.div(order_R, k, rounding_mode="floor"),
        weight_R=weights_MK.reshape(-1)[order_R].float(),
        num_rows_per_expert_L=counts[:num_local_experts],
        pair_MK=pair_X.view(num_rows, k),
    )


def combine_rows(
    expert_y_RH: torch.Tensor, layout: ExpertLayout, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weighted sum of expert outputs into their rows: ``[M, H]`` in ``out_dtype``, summed in float32
    over each row's choices in top-k order (rows with no local choice are zero)."""
    if layout.pair_MK is None:
        raise ValueError(
            "combine_rows needs a layout from group_rows_by_expert (one with pair_MK); "
            "low_latency's layouts are combined by its own reduce_pairs"
        )
    return gather_sum(expert_y_RH, layout.pair_MK, layout.weight_R, out_dtype=out_dtype)


def pack_topk(ids_MK: torch.Tensor, weights_MK: torch.Tensor) -> torch.Tensor:
    """One int32 ``[M, 2K]`` tensor: ids, then the float32 weights' bits (one transfer, not two)."""
    return torch.cat([ids_MK.to(torch.int32), weights_MK.float().contiguous().view(torch.int32)], dim=1)


def unpack_topk(meta_M2K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_topk``: (ids int64 ``[M, K]``, weights float32 ``[M, K]``)."""
    k = meta_M2K.shape[1] // 2
    return meta_M2K[:, :k].long(), meta_M2K[:, k:].contiguous().view(torch.float32)

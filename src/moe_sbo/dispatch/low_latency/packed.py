"""A ``low_latency`` dispatch's expert rows in the packed per-expert layout, and its combine read from
there: for callers whose experts take [L, N, H] with per-expert counts (DeepEP's low-latency layout,
DeepGEMM's "masked" grouped GEMM), ``moe_sbo.deep_ep`` among them.

Legend: see ``moe_sbo/__init__.py``; here R = S * K grouped expert rows (the dispatcher's, padding
included) and N the rows each expert has in the packed layout (expert l's j-th row at l * N + j,
rows of one expert in slot order, so grouped by source rank).

::

    dispatch_wait -> DispatchOutput (grouped rows, real ones first, counts [L])
    pack_rows     -> rows copied into the caller's [L * N + 1, H] (and scales), counts int32 [L];
                     fused kernels: the round's layout rewritten to the packed rows (each (slot, k)
                     pair's packed row), torch: the packed row of each grouped row kept
    experts       read [L, N, H], write their outputs in the same layout
    combine_input -> what ``combine_launch`` takes: the packed outputs themselves (fused kernels:
                     no copy), or the outputs gathered back into grouped order (torch)

The hard part is that nothing may read the counts on the host, so the packed index of a row is
derived on the device from the counts alone (``kernels/packed.py``: one launch), and the combine of
the fused path reads the outputs where the caller left them instead of gathering them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernel_choice import HAS_TRITON
from ..records import DispatchHandle, DispatchOutput

if HAS_TRITON:  # Triton comes with CUDA builds of torch; without it the torch rows run
    from .kernels import KernelLayout
    from .kernels.packed import pack_per_expert


@dataclass(frozen=True)
class PackedRows:
    """What ``pack_rows`` left: the ``output`` it packed, ``rows_per_expert`` (N), and ``pos_R``: None
    on the fused path (the round's layout now reads the packed rows itself), or int64 [R] on the
    torch path (the packed row of each grouped row, L * N for padding)."""

    output: DispatchOutput
    rows_per_expert: int
    pos_R: torch.Tensor | None = None


def pack_rows(
    output: DispatchOutput,
    rows_per_expert: int,
    x_NH: torch.Tensor,
    scales_NQ: torch.Tensor | None,
    count_L: torch.Tensor,
    ok_1: torch.Tensor | None = None,
) -> PackedRows:
    """Copy ``output``'s real rows into ``x_NH`` ([L * N + 1, H], the dispatched dtype; the last row
    is scratch) and, with fp8 rows, their scales into ``scales_NQ``; ``count_L`` (int32 [L]) gets
    the counts. An expert given more than N rows (a token that names one expert twice) raises
    (CPU) or fails a device assert (CUDA): no row is dropped silently. ``ok_1``: an int32 [1] of 1
    the caller keeps for this (made here when None; after a failed assert the process is done).

    On the fused path the round's layout is rewritten in place to read the packed rows: from here
    on its combine takes the experts' outputs in the packed layout (``combine_input``), not the
    grouped one. Sync: device operations only (one kernel and one assert on the fused path)."""
    num_local = output.num_rows_per_expert_L.shape[0]
    dump = num_local * rows_per_expert
    fixed = getattr(output.handle, "fixed", None)
    if HAS_TRITON and isinstance(fixed, KernelLayout):
        if ok_1 is None:
            ok_1 = torch.ones(1, dtype=torch.int32, device=x_NH.device)
        pack_per_expert(
            output.expert_x_RH,
            output.expert_rows_R,
            output.expert_scales_RQ,
            output.num_rows_per_expert_L,
            fixed.pair_row_SK.view(-1),
            fixed.num_real_1,
            x_NH,
            scales_NQ,
            count_L,
            ok_1,
            rows_per_expert,
        )
        _check(ok_1, rows_per_expert)
        output.handle.round.packed_rows = dump  # type: ignore[attr-defined]  # combine: the packed [L * N, H]
        return PackedRows(output, rows_per_expert)
    counts_L = output.num_rows_per_expert_L
    rows_RH = output.rows_RH()
    row_R = torch.arange(rows_RH.shape[0], device=counts_L.device)
    ends_L = counts_L.cumsum(0)
    expert_R = torch.searchsorted(ends_L, row_R, right=True)  # L: padding
    is_real_R = expert_R < num_local
    expert_R = expert_R.clamp(max=num_local - 1)
    inside_R = row_R - (ends_L - counts_L)[expert_R]
    _check(~(is_real_R & (inside_R >= rows_per_expert)).any(), rows_per_expert)
    pos_R = torch.where(is_real_R, expert_R * rows_per_expert + inside_R, dump)
    if x_NH.dtype.itemsize == 1:  # fp8 rows move as bytes (index_copy_ has no fp8 kernel on every device)
        x_NH.view(torch.uint8).index_copy_(0, pos_R, rows_RH.contiguous().view(torch.uint8))
    else:
        x_NH.index_copy_(0, pos_R, rows_RH.to(x_NH.dtype))
    if scales_NQ is not None:
        scales_RQ = output.expert_scales_RQ
        assert scales_RQ is not None, "fp8 rows come with their scales"
        if output.expert_rows_R is not None:  # in place: the receive buffer's scales, read through the index
            scales_RQ = scales_RQ.index_select(0, output.expert_rows_R)
        scales_NQ.index_copy_(0, pos_R, scales_RQ.float())
    count_L.copy_(counts_L)
    return PackedRows(output, rows_per_expert, pos_R=pos_R)


def _check(ok: torch.Tensor, rows_per_expert: int) -> None:
    """``ok`` (nonzero: no expert got more than N rows): raise on CPU, assert on the device."""
    message = (
        f"an expert received more than its {rows_per_expert} packed rows: a token named one expert twice in "
        "its top-k ids"
    )
    if ok.device.type == "cpu":
        if not bool(ok.all()):
            raise ValueError(message)
    else:
        torch._assert_async(ok.reshape(()), message)


def combine_input(packed: PackedRows, y_NH: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
    """The experts' outputs ``y_NH`` [L * N, H] (packed as the rows were) as ``combine_launch``'s
    arguments: on the fused path ``y_NH`` itself (the round's layout already reads the packed rows,
    and its combine expects them: no copy); on the torch path the outputs gathered back into grouped
    order (padding rows read row 0: combine masks them). Both with the dispatch's handle.

    Sync: none (fused), or one gather on the current stream (torch)."""
    handle = packed.output.handle
    if packed.pos_R is not None:
        return y_NH.index_select(0, torch.where(packed.pos_R < y_NH.shape[0], packed.pos_R, 0)), handle
    return y_NH, handle


def rows_per_source(packed: PackedRows, slots_per_rank: int, num_ranks: int) -> torch.Tensor:
    """int64 [L, P]: how many of each expert's packed rows came from each source rank (the rows of
    one expert are in slot order, so those of one source are contiguous).

    Sync: device operations only."""
    output = packed.output
    counts_L = output.num_rows_per_expert_L
    num_local, device = counts_L.shape[0], counts_L.device
    slot_R = output.handle.layout.row_R if output.expert_rows_R is None else output.expert_rows_R
    row_R = torch.arange(slot_R.shape[0], device=device)
    expert_R = torch.searchsorted(counts_L.cumsum(0), row_R, right=True)  # L: padding
    source_R = torch.div(slot_R, slots_per_rank, rounding_mode="floor").clamp(max=num_ranks - 1)
    key_R = torch.where(expert_R < num_local, expert_R * num_ranks + source_R, num_local * num_ranks)
    counts = torch.zeros(num_local * num_ranks + 1, dtype=torch.int64, device=device)
    return counts.scatter_add_(0, key_R, torch.ones_like(key_R))[:-1].view(num_local, num_ranks)

"""Fixed-order sums of gathered rows: the combine reductions, with no float atomics.

``gather_sum`` computes, for every output row y of Y, from X source rows::

    out[y] = sum over k = 0 .. K-1 of  weight[index[y, k]] * src[index[y, k]]     (index == X: skipped)

accumulated in float32 and rounded once to the output dtype. Each output row is written by one
program that reads its K sources in a fixed order, so the result does not depend on scheduling:
the same inputs give the same bits on every run, on CPU and GPU. ``index_add_`` (float atomics on
CUDA) gave no such promise, and needed an R x H float32 temporary besides.

Callers: the expert-output combine of ``local``/``allgather``/``alltoall`` (src = expert outputs,
index = the pair of each (row, k), weight = the pairs' top-k weights), ``alltoall``'s sum of the rows
each rank returns, and ``low_latency``'s sum of the P returned rows (no weight).

On CUDA a Triton kernel does it in one pass (grid Y x H/BLOCK_H); elsewhere, or with
``kernels="torch"``, K gathers summed in order. The two agree to float32 rounding, not bit for bit
(the kernel's sum is a tree over k, the torch one a chain); each is deterministic on its own.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..kernel_choice import HAS_TRITON, next_power_of_2, use_triton

if HAS_TRITON:  # else the torch path serves; kernels="triton" then raises
    import triton
    import triton.language as tl


class AddressTable(Protocol):
    """Where a replayed CUDA graph's kernel reads values the host rewrites before each replay
    (``low_latency.addresses.CallerAddresses`` is one): ``table`` int64 on the device, whose
    addresses are 16-byte offsets from ``anchor``."""

    anchor: torch.Tensor
    table: torch.Tensor


if HAS_TRITON:

    @triton.jit
    def _gather_sum_kernel(
        src_ptr,
        index_ptr,
        weight_ptr,
        out_ptr,
        num_src,
        anchor_ptr,
        table_ptr,
        HIDDEN: tl.constexpr,
        TOP_K: tl.constexpr,
        K_P2: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ADDRESSED: tl.constexpr,
    ):
        # ADDRESSED (a replayed graph, an ``AddressTable``): the real row count and the
        # output's address come from ``table_ptr`` (count, then a 16-byte offset from ``anchor_ptr``);
        # ``out_ptr`` only gives the output's dtype, and rows past the count are left alone.
        y = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        num_cols = HIDDEN
        if ADDRESSED:
            num_cols = tl.where(y < tl.load(table_ptr), HIDDEN, 0)  # a bound, not a scalar in the mask: one dtype
            out_ptr = (anchor_ptr + tl.load(table_ptr + 1) * 16).to(out_ptr.dtype)
        live_H = h < num_cols
        offs_k = tl.arange(0, K_P2)
        index_K = tl.load(index_ptr + y.to(tl.int64) * TOP_K + offs_k, mask=offs_k < TOP_K, other=num_src)
        valid_K = index_K < num_src
        src_KH = tl.load(
            src_ptr + index_K[:, None] * HIDDEN + h[None, :], mask=valid_K[:, None] & live_H[None, :], other=0.0
        ).to(tl.float32)
        if HAS_WEIGHT:
            w_K = tl.load(weight_ptr + index_K, mask=valid_K, other=0.0).to(tl.float32)
            src_KH = src_KH * w_K[:, None]
        tl.store(
            out_ptr + y.to(tl.int64) * HIDDEN + h, tl.sum(src_KH, axis=0).to(out_ptr.dtype.element_ty), mask=live_H
        )


def block_h_for(hidden: int, k_p2: int, min_block: int = 16) -> int:
    """Columns per program for kernels that hold ``k_p2`` (a power of two) rows of a block in
    registers: at most 1024 (7 steps for DeepSeek-V3's 7168) and at most 8192 float32 values in all."""
    return max(min(next_power_of_2(max(hidden, 1)), 8192 // k_p2, 1024), min_block)


def launch_gather_sum(
    src_XH: torch.Tensor,
    index_YK: torch.Tensor,
    weight_X: torch.Tensor | None,
    out_YH: torch.Tensor,
    addresses: AddressTable | None = None,
) -> None:
    """Queue the Triton kernel of ``gather_sum`` over contiguous tensors (int64 ``index_YK``).

    ``addresses`` (inside a replayed graph): the real row count and the output's address come from
    its table (count, then offset); ``out_YH`` then only gives the output's dtype, and rows past the
    count are left alone."""
    num_rows, top_k = index_YK.shape
    num_src, hidden = src_XH.shape
    k_p2 = triton.next_power_of_2(top_k)
    block_h = block_h_for(hidden, k_p2)
    _gather_sum_kernel[(num_rows, triton.cdiv(hidden, block_h))](
        src_XH,
        index_YK,
        src_XH if weight_X is None else weight_X,
        out_YH,
        num_src,
        src_XH if addresses is None else addresses.anchor,
        index_YK if addresses is None else addresses.table,
        HIDDEN=hidden,
        TOP_K=top_k,
        K_P2=k_p2,
        HAS_WEIGHT=weight_X is not None,
        BLOCK_H=block_h,
        ADDRESSED=addresses is not None,
    )


def gather_sum(
    src_XH: torch.Tensor,
    index_YK: torch.Tensor,
    weight_X: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    kernels: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[Y, H]`` in ``out_dtype``: row y is the (weighted) sum of ``src_XH[index_YK[y, k]]`` over k.

    Y: the output rows. ``index_YK`` integer, each in ``[0, X]``; X (one past the last row) marks "no
    source" and adds nothing. ``weight_X`` float32 ``[X]``: a weight per source row, or None for a plain sum.
    ``out``: a contiguous [Y, H] tensor of ``out_dtype`` to write into (returned), else a new one.
    """
    num_rows, top_k = index_YK.shape
    num_src, hidden = src_XH.shape
    out_ok = out is None or (tuple(out.shape) == (num_rows, hidden) and out.dtype == out_dtype and out.is_contiguous())
    if out is not None and not out_ok:
        raise ValueError(
            f"out must be a contiguous {out_dtype} [{num_rows}, {hidden}], got {out.dtype} {tuple(out.shape)}"
        )
    out_YH = torch.empty(num_rows, hidden, dtype=out_dtype, device=src_XH.device) if out is None else out
    if num_rows == 0:
        return out_YH
    if num_src == 0 or top_k == 0:
        return out_YH.zero_()
    index_YK = index_YK.long()  # the kernel's row offsets index * H must not wrap at 2**31
    if use_triton(kernels, src_XH.device):
        weights = None if weight_X is None else weight_X.contiguous()
        launch_gather_sum(src_XH.contiguous(), index_YK.contiguous(), weights, out_YH)
        return out_YH
    # Accumulate in float32: in the output itself when it is float32, else in a temporary.
    acc_YH = out_YH.zero_() if out_dtype == torch.float32 else torch.zeros_like(out_YH, dtype=torch.float32)
    for k in range(top_k):  # a chain over k: the same order every run
        index_Y = index_YK[:, k]
        valid_Y = index_Y < num_src
        safe_Y = torch.where(valid_Y, index_Y, 0)
        rows_YH = src_XH[safe_Y].float()
        if weight_X is not None:
            rows_YH.mul_(weight_X[safe_Y].float()[:, None])
        acc_YH.add_(rows_YH.masked_fill_(~valid_Y[:, None], 0.0))
    return acc_YH if acc_YH is out_YH else out_YH.copy_(acc_YH)

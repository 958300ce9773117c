"""The block-scaled FP8 grouped GEMM in torch: cuBLAS's block-wise ``torch._scaled_mm`` once per expert
(sm90; prefill sizes), and the float32 reference that CPU ranks run and the Triton kernel
(``fp8_gemm.py``) is tested against.

Legend: see ``moe_sbo/__init__.py``; N and K are a GEMM's output and reduction features, L the experts.

The hard part is cuBLAS's row alignment: it takes row counts in multiples of 4 and scales laid out
"outer-dim-major", so each expert's window is widened into its neighbours' rows and cut back after.
"""

from __future__ import annotations

import torch

from ..quant.fp8 import dequantize_fp8, dequantize_fp8_blocks


def grouped_linear_fp8(
    q_RK: torch.Tensor,
    scales_RQ: torch.Tensor,
    w_LNK: torch.Tensor,
    w_scale_inv_LNQ: torch.Tensor,
    offsets_L: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The torch path (and reference) of ``fp8_gemm.grouped_gemm``: e4m3 rows grouped by expert
    times each expert's e4m3 block-scaled weight transposed -> ``[R, N]`` in ``out_dtype``.

    Both operands are dequantised to float32, one expert at a time, and multiplied in float32: the
    kernel's block-scaled sum, up to summation order. Needs the counts on the host (``offsets_L``
    int cumulative row ends); rows past the last end are left unwritten.
    """
    out_RN = q_RK.new_empty(q_RK.shape[0], w_LNK.shape[1], dtype=out_dtype)
    start = 0
    for expert, end in enumerate(offsets_L.tolist()):
        if end > start:
            x_XK = dequantize_fp8(q_RK[start:end], scales_RQ[start:end], torch.float32)
            w_NK = dequantize_fp8_blocks(w_LNK[expert], w_scale_inv_LNQ[expert])
            out_RN[start:end] = (x_XK @ w_NK.T).to(out_dtype)
        start = end
    return out_RN


SCALED_MM_ROW_ALIGN = 4  # cuBLAS's block-wise FP8 GEMM refuses row counts that are not multiples of 4


def grouped_scaled_mm(
    q_RK: torch.Tensor,
    scales_RQ: torch.Tensor,
    w_LNK: torch.Tensor,
    w_scale_inv_LNQ: torch.Tensor,
    counts: list[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``grouped_linear_fp8`` by cuBLAS: one block-scaled ``torch._scaled_mm`` per expert (sm90).

    ``counts``: each expert's rows, on the host (so the caller has read them from the device once);
    ``q_RK`` needs at least 4 rows. Each call costs host time, so ``experts.select`` runs this
    route only eagerly and from ``SCALED_MM_MIN_ROWS_PER_EXPERT`` rows per expert.
    """
    num_rows = q_RK.shape[0]
    if num_rows < SCALED_MM_ROW_ALIGN:
        raise ValueError(f"grouped_scaled_mm needs >= {SCALED_MM_ROW_ALIGN} rows, got {num_rows}; use grouped_gemm")
    out_RN = q_RK.new_empty(num_rows, w_LNK.shape[1], dtype=out_dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            # cuBLAS takes row counts in multiples of 4: widen the window into the neighbours' rows
            # (forwards, or backwards at the end) and keep only this expert's outputs.
            width = -(-count // SCALED_MM_ROW_ALIGN) * SCALED_MM_ROW_ALIGN
            first = min(start, num_rows - width)
            # cuBLAS reads the 1x128 scales "outer-dim-major": [rows, K/128] with stride (1, rows).
            scales_XQ = scales_RQ[first : first + width].t().contiguous().t()
            out_XN = torch._scaled_mm(
                q_RK[first : first + width],
                w_LNK[expert].t(),
                scale_a=scales_XQ,
                scale_b=w_scale_inv_LNQ[expert].t(),
                out_dtype=out_dtype,
            )
            out_RN[start:end] = out_XN[start - first : start - first + count]
            start = end
    return out_RN

"""FP8 e4m3 formats, in torch: activations with one scale per token and 128 values, weights with one
scale per 128x128 block (DeepSeek-V3/R1's published format).

Legend: see ``moe_sbo/__init__.py``; lowercase ``q`` and ``ou`` count groups and blocks, not values:
``scales_XQ`` has one scale per 128 values of a row, ``scale_inv_ou`` one per 128x128 tile of a weight.

Both are the scales FP8 tensor-core GEMMs consume (DeepGEMM, vLLM's block-FP8 ``fused_moe``): the
product of two 128-value groups is exact in float32, so a GEMM multiplies each K-block's partial sum
by one activation scale and one weight scale. ``low_latency``'s fp8 dispatch sends activations in
this format; the routed experts (``experts/fp8_gemm.py``) read them, and their weights, without dequantising.
"""

from __future__ import annotations

import torch

FP8_GROUP = 128  # activation values sharing one scale (per token), as DeepEP's low-latency dispatch
FP8_BLOCK = 128  # weight tiles are FP8_BLOCK x FP8_BLOCK, as DeepSeek-V3's weight_block_size
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def sizes_off_blocks(hidden_size: int, moe_intermediate_size: int) -> dict[str, int]:
    """The expert sizes that are not multiples of ``FP8_BLOCK`` (FP8 experts need none: gate and up
    rows are stacked, so a partial block of gate rows would have no scale row of its own)."""
    sizes = {"hidden_size": hidden_size, "moe_intermediate_size": moe_intermediate_size}
    return {name: size for name, size in sizes.items() if size % FP8_BLOCK}


def quantize_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_TH`` [T, H] (H a multiple of 128) -> (``q_TH`` e4m3 [T, H], ``scales_TQ`` float32 [T, Q]).

    One scale per token and 128 consecutive values: amax / 448, so x ~= q * scale with e4m3's 3
    mantissa bits: relative error <= 2^-4 down to amax * 2^-6 / 448 (e4m3's smallest normal), below
    that an absolute error <= scale * 2^-10.
    """
    num_tokens, hidden = x_TH.shape
    x_TQV = x_TH.float().view(num_tokens, hidden // FP8_GROUP, FP8_GROUP)
    # The floor keeps an all-zero group finite (0 / 0 would be NaN); it is far below any real amax.
    scales_TQ1 = x_TQV.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    # Clamp: amax / scale can round a hair above 448, and e4m3fn has no inf (it would become NaN).
    q_TQV = (x_TQV / scales_TQ1).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q_TQV.view(num_tokens, hidden), scales_TQ1.view(num_tokens, hidden // FP8_GROUP)


# Activation scales laid out K-major: ``[X, Q]`` views of ``[Q, X rounded up to K_MAJOR_ROW_ALIGN]``
# storage, each group's scales of consecutive rows contiguous, as Hopper's block-scaled GEMMs load
# them (the sm90 kernel by TMA, whose row strides are multiples of 16 bytes; cuBLAS and DeepGEMM take
# the same layout).
K_MAJOR_ROW_ALIGN = 4


def empty_k_major_scales(num_rows: int, groups: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Uninitialised float32 scales ``[X, Q]`` laid out K-major (strides ``(1, X rounded up to 4)``)."""
    padded = -(-num_rows // K_MAJOR_ROW_ALIGN) * K_MAJOR_ROW_ALIGN
    return torch.empty(groups, padded, dtype=torch.float32, device=device)[:, :num_rows].t()


def k_major_scales(scales_XQ: torch.Tensor) -> torch.Tensor:
    """``scales_XQ`` transposed, ``[Q, X]`` float32 with unit stride along X and a row stride that is a
    multiple of ``K_MAJOR_ROW_ALIGN``: a view where ``scales_XQ`` is laid out K-major already
    (``empty_k_major_scales``, the quantisers' ``k_major`` output), else a copy."""
    scales_QX = scales_XQ.t()
    if (
        scales_XQ.dtype == torch.float32
        and scales_QX.stride(1) == 1
        and scales_QX.stride(0) % K_MAJOR_ROW_ALIGN == 0
        and scales_QX.data_ptr() % 16 == 0
    ):
        return scales_QX
    num_rows, groups = scales_XQ.shape
    return empty_k_major_scales(num_rows, groups, scales_XQ.device).t().copy_(scales_QX)


def dequantize_fp8(q_XH: torch.Tensor, scales_XQ: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: ``[X, H]`` in ``dtype``."""
    num_rows, hidden = q_XH.shape
    x_XQV = q_XH.float().view(num_rows, hidden // FP8_GROUP, FP8_GROUP) * scales_XQ[:, :, None]
    return x_XQV.view(num_rows, hidden).to(dtype)


def quantize_fp8_blocks(
    weight_OU: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight ``[..., O, U]`` -> (e4m3 ``[..., O, U]``, float32 ``scale_inv_ou`` ``[..., ceil(O/b0), ceil(U/b1)]``).

    One scale per ``block`` tile, tile amax / 448 (floored so an all-zero tile stays finite), so that
    ``dequantize_fp8_blocks`` gives back the weight within e4m3's rounding (relative 2^-4 per value).
    Edge tiles may be partial. Works one leading index at a time when given ``[E, O, U]``, so a float32
    copy of one matrix, never of all experts, is made.
    """
    if weight_OU.dim() > 2:
        pairs = [quantize_fp8_blocks(w, block) for w in weight_OU]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    b_out, b_in = block
    rows, cols = weight_OU.shape
    tiles_o, tiles_u = -(-rows // b_out), -(-cols // b_in)
    padded = weight_OU.new_zeros(tiles_o * b_out, tiles_u * b_in, dtype=torch.float32)
    padded[:rows, :cols] = weight_OU
    tiles = padded.view(tiles_o, b_out, tiles_u, b_in)
    scale_inv_ou = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-30) / FP8_MAX
    q = (tiles / scale_inv_ou[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view_as(padded)[:rows, :cols].contiguous(), scale_inv_ou


def dequantize_fp8_blocks(
    weight_OU: torch.Tensor, scale_inv_ou: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> torch.Tensor:
    """FP8 block-quantised weight -> float32 ``weight * scale`` of its block, as DeepSeek-V3 stores them.

    ``weight_OU`` [..., O, U] float8_e4m3fn; ``scale_inv_ou`` [..., ceil(O/b0), ceil(U/b1)] float32,
    one factor per ``block`` = (b0, b1) tile (DeepSeek calls it ``scale_inv`` because quantisation
    divided by it). Edge tiles are cropped: O and U need not be multiples of the block.
    """
    b_out, b_in = block
    rows, cols = weight_OU.shape[-2:]
    scale_OU = scale_inv_ou.float().repeat_interleave(b_out, dim=-2).repeat_interleave(b_in, dim=-1)
    return weight_OU.float() * scale_OU[..., :rows, :cols]

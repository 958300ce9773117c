"""The routes of the routed experts' MLP: one object per way of running its two grouped GEMMs (and
what sits between them), each saying what it supports.

Legend: see ``moe_sbo/__init__.py``.

===============  ===  ===================================================================  =======
route            FP8  GEMMs                                                                capture
===============  ===  ===================================================================  =======
``gemv``         no   ``gemv.grouped_gemv``: Triton, one weight read per expert            yes
``tiled``        no   ``tiled_gemm.grouped_gemm``: Triton row tiles; reads rows via index  yes
``grouped_mm``   no   ``torch._grouped_mm`` (bf16 on sm90+ CUDA, CPU)                      yes
``expert_loop``  no   one ``F.linear`` per expert (counts read on the host)                no
``fp8_triton``   yes  ``fp8_gemm.grouped_gemm``: Triton, device counts                     yes
``fp8_sm90``     yes  ``fp8_gemm_sm90.grouped_gemm``: warp-specialised Gluon, sm90         yes
``scaled_mm``    yes  ``fp8_torch.grouped_scaled_mm``: cuBLAS per expert, sm90 (host)      no
``fp8_torch``    yes  ``fp8_torch.grouped_linear_fp8``: float32 reference (host counts)    no
===============  ===  ===================================================================  =======

Between the GEMMs the dense routes run SwiGLU (``swiglu.py``: one Triton launch where the GEMMs are
Triton's, ``"auto"`` or torch's for the torch GEMMs); the FP8 routes but ``fp8_torch`` quantise
around them with ``quant.kernels`` (``quantize_rows`` and ``silu_mul_quantize``, the scales K-major
for ``fp8_sm90``). ``supports(conditions)`` returns None where a route runs, else the reason it
cannot; which supported route runs is ``select.py``'s rule table. The hard part: a route that reads
the counts on the host cannot be captured in a CUDA graph, and one that runs only on some operands
(``fp8_sm90``: 16-byte aligned ones) must fall back inside ``run`` without changing the numbers'
contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernel_choice import HAS_TRITON
from ..quant.fp8 import quantize_fp8
from .fp8_torch import grouped_linear_fp8, grouped_scaled_mm
from .swiglu import swiglu

if HAS_TRITON:
    from ..quant import kernels as quant_kernels
    from . import fp8_gemm, fp8_gemm_sm90, gemv, tiled_gemm

from .conditions import Conditions

Quantized = tuple[Tensor, Tensor]  # e4m3 values and their float32 scales


class ExpertWeights(Protocol):
    """What a route reads of ``RoutedExperts``: the weights (and FP8 block scales), and ``dtype``,
    the activation dtype of FP8 experts' outputs."""

    @property
    def gate_up_proj(self) -> torch.Tensor: ...  # [L, 2I, H]
    @property
    def down_proj(self) -> torch.Tensor: ...  # [L, H, I]
    @property
    def gate_up_proj_scale_inv(self) -> torch.Tensor: ...  # [L, 2I/128, H/128], FP8 only
    @property
    def down_proj_scale_inv(self) -> torch.Tensor: ...  # [L, H/128, I/128], FP8 only
    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class ExpertRows:
    """One forward's rows, as a route takes them: ``x_RH`` grouped by local expert (e4m3 when
    ``scales_RQ``, float32 [R, H/128], came with them), read as ``x_RH[rows_R]`` where ``rows_R`` is
    given (only for a route that ``reads_index``); ``offsets_L`` int32 cumulative row ends on the
    device; ``counts_L`` the counts as given (any device); ``rows_per_expert`` the real rows to expect
    per expert, which the tiles are chosen for."""

    x_RH: torch.Tensor
    offsets_L: torch.Tensor
    counts_L: torch.Tensor
    rows_per_expert: float
    scales_RQ: torch.Tensor | None = None
    rows_R: torch.Tensor | None = None


def _needs_triton(c: Conditions) -> str | None:
    if not c.triton:
        return "needs Triton (pip install triton)"
    if c.device_type != "cuda" and not c.interpreting:
        return "needs CUDA tensors, or TRITON_INTERPRET=1 (Triton's CPU interpreter)"
    return None


def _host_counts(c: Conditions) -> str | None:
    return "reads the counts on the host, which a CUDA graph capture cannot" if c.capture else None


@dataclass(frozen=True)
class Route:
    """One way of running the experts' MLP. ``name``: what ``RoutedExperts.kernels`` forces it by;
    ``fp8``: for FP8 weights (else dense); ``reads_index``: reads rows through ``rows_R`` (the others
    take them gathered)."""

    name: str
    fp8: bool = False
    reads_index: bool = False

    def supports(self, c: Conditions) -> str | None:
        """None where this route runs under ``c``, else why it cannot."""
        if c.fp8 != self.fp8:
            return "is for FP8 weights" if self.fp8 else "is for dense (not FP8) weights"
        return self.requires(c)

    def requires(self, c: Conditions) -> str | None:
        """The route's own needs beyond the weights' kind."""
        return None

    def run(self, weights: ExpertWeights, rows: ExpertRows) -> torch.Tensor:
        """The experts' MLP on ``rows`` -> ``[R, H]`` (rows past the last offset undefined)."""
        raise NotImplementedError


@dataclass(frozen=True)
class DenseRoute(Route):
    """gate_up GEMM, SwiGLU (``swiglu``: its ``kernels=``), down GEMM."""

    swiglu: str = "auto"

    def gemm(self, x_RK: Tensor, w_LNK: Tensor, rows: ExpertRows, rows_R: Tensor | None) -> Tensor:
        """``x_RK`` (read through ``rows_R`` where given) times each expert's ``w_LNK[l]`` transposed."""
        raise NotImplementedError

    def run(self, weights: ExpertWeights, rows: ExpertRows) -> torch.Tensor:
        gate_up_R2I = self.gemm(rows.x_RH, weights.gate_up_proj, rows, rows.rows_R)
        act_RI = swiglu(gate_up_R2I, rows.offsets_L, kernels=self.swiglu)
        return self.gemm(act_RI, weights.down_proj, rows, None)


@dataclass(frozen=True)
class Gemv(DenseRoute):
    def requires(self, c: Conditions) -> str | None:
        return _needs_triton(c)

    def gemm(self, x_RK: Tensor, w_LNK: Tensor, rows: ExpertRows, rows_R: Tensor | None) -> Tensor:
        return gemv.grouped_gemv(x_RK, w_LNK, rows.offsets_L)


@dataclass(frozen=True)
class Tiled(DenseRoute):
    def requires(self, c: Conditions) -> str | None:
        return _needs_triton(c)

    def gemm(self, x_RK: Tensor, w_LNK: Tensor, rows: ExpertRows, rows_R: Tensor | None) -> Tensor:
        # The tiles for the rows to expect (padding excluded), not for every row handed over.
        config = tiled_gemm.dense_config(rows.rows_per_expert, x_RK.element_size())
        return tiled_gemm.grouped_gemm(x_RK, w_LNK, rows.offsets_L, rows_R=rows_R, config=config)


@dataclass(frozen=True)
class GroupedMM(DenseRoute):
    def requires(self, c: Conditions) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return "needs torch._grouped_mm (a newer torch)"
        if c.device_type == "cuda":
            if c.dtype != torch.bfloat16 or c.capability is None or c.capability < (9, 0):
                return f"runs on CUDA for bf16 on sm90 or newer, got {c.dtype} on sm{c.sm}"
            return None
        return None if c.device_type == "cpu" else f"runs on CUDA and CPU tensors, got {c.device_type}"

    def gemm(self, x_RK: Tensor, w_LNK: Tensor, rows: ExpertRows, rows_R: Tensor | None) -> Tensor:
        return torch._grouped_mm(x_RK, w_LNK.transpose(-2, -1), offs=rows.offsets_L)


@dataclass(frozen=True)
class ExpertLoop(DenseRoute):
    def requires(self, c: Conditions) -> str | None:
        return _host_counts(c)

    def gemm(self, x_RK: Tensor, w_LNK: Tensor, rows: ExpertRows, rows_R: Tensor | None) -> Tensor:
        out_RN = x_RK.new_empty(x_RK.shape[0], w_LNK.shape[1])
        start = 0
        for expert, end in enumerate(rows.offsets_L.tolist()):
            if end > start:
                out_RN[start:end] = F.linear(x_RK[start:end], w_LNK[expert])
            start = end
        return out_RN


@dataclass(frozen=True)
class QuantizedRoute(Route):
    """Quantise the rows (unless they came in e4m3), gate_up GEMM, SwiGLU and its quantisation in one
    launch, down GEMM: ``quant.kernels`` around the route's ``gemm``. ``k_major``: the quantisers
    write the scales K-major (the sm90 kernel loads them so)."""

    fp8: bool = True
    reads_index: bool = True
    k_major: bool = False

    def requires(self, c: Conditions) -> str | None:
        if c.device_type == "cuda" and c.capability is not None and c.capability < (8, 9):
            return f"needs FP8 tensor cores (sm89 or newer), got sm{c.sm}; use expert_dtype=None"
        return _needs_triton(c)

    def gemm(self, q: Quantized, w: Quantized, out_dtype: torch.dtype, rows: ExpertRows) -> Tensor:
        """e4m3 rows ``q`` (``[R, K]`` and their scales ``[R, K/128]``) grouped by expert times each
        expert's block-scaled e4m3 weight ``w`` (``[L, N, K]``, ``[L, N/128, K/128]``) transposed ->
        ``[R, N]`` in ``out_dtype``."""
        raise NotImplementedError

    def run(self, weights: ExpertWeights, rows: ExpertRows) -> torch.Tensor:
        q_RH, scales_RQ = rows.x_RH, rows.scales_RQ
        if scales_RQ is None:  # through the index where there is one: the gather fused into the quantisation
            q_RH, scales_RQ = quant_kernels.quantize_rows(rows.x_RH, rows.offsets_L, rows.rows_R, k_major=self.k_major)
        gate_up = (weights.gate_up_proj, weights.gate_up_proj_scale_inv)
        gate_up_R2I = self.gemm((q_RH, scales_RQ), gate_up, weights.dtype, rows)
        act_RI = quant_kernels.silu_mul_quantize(gate_up_R2I, rows.offsets_L, k_major=self.k_major)
        return self.gemm(act_RI, (weights.down_proj, weights.down_proj_scale_inv), weights.dtype, rows)


@dataclass(frozen=True)
class FP8Triton(QuantizedRoute):
    def gemm(self, q: Quantized, w: Quantized, out_dtype: torch.dtype, rows: ExpertRows) -> Tensor:
        return fp8_gemm.grouped_gemm(*q, *w, rows.offsets_L, out_dtype, rows_per_expert=rows.rows_per_expert)


@dataclass(frozen=True)
class FP8SM90(FP8Triton):
    k_major: bool = True

    def requires(self, c: Conditions) -> str | None:
        if not (c.gluon and c.device_type == "cuda" and c.capability == (9, 0)):
            return f"needs Triton's Gluon and an sm90 GPU, got {c.device_type} (sm{c.sm}, Gluon {c.gluon})"
        return None

    def gemm(self, q: Quantized, w: Quantized, out_dtype: torch.dtype, rows: ExpertRows) -> Tensor:
        if not fp8_gemm_sm90.supported(q[0], w[0]):  # operands a descriptor cannot address
            return super().gemm(q, w, out_dtype, rows)
        config = fp8_gemm_sm90.config_for(rows.rows_per_expert)
        return fp8_gemm_sm90.grouped_gemm(*q, *w, rows.offsets_L, out_dtype, config)


@dataclass(frozen=True)
class ScaledMM(QuantizedRoute):
    def requires(self, c: Conditions) -> str | None:
        if c.device_type != "cuda" or c.capability != (9, 0) or not hasattr(torch, "_scaled_mm"):
            return f"needs an sm90 CUDA device (cuBLAS's block-wise FP8), got {c.device_type} (sm{c.sm})"
        return _host_counts(c) or super().requires(c)

    def gemm(self, q: Quantized, w: Quantized, out_dtype: torch.dtype, rows: ExpertRows) -> Tensor:
        return grouped_scaled_mm(*q, *w, rows.counts_L.tolist(), out_dtype)


@dataclass(frozen=True)
class FP8Torch(Route):
    fp8: bool = True

    def requires(self, c: Conditions) -> str | None:
        return _host_counts(c)

    def run(self, weights: ExpertWeights, rows: ExpertRows) -> torch.Tensor:
        offsets_L = rows.offsets_L
        q_RH, scales_RQ = quantize_fp8(rows.x_RH) if rows.scales_RQ is None else (rows.x_RH, rows.scales_RQ)
        gate_up_R2I = grouped_linear_fp8(
            q_RH, scales_RQ, weights.gate_up_proj, weights.gate_up_proj_scale_inv, offsets_L, weights.dtype
        )
        gate_RI, up_RI = gate_up_R2I.float().chunk(2, dim=-1)
        q_RI, act_scales_RQ = quantize_fp8(F.silu(gate_RI) * up_RI)
        return grouped_linear_fp8(
            q_RI, act_scales_RQ, weights.down_proj, weights.down_proj_scale_inv, offsets_L, weights.dtype
        )


GEMV = Gemv("gemv", swiglu="triton")
TILED = Tiled("tiled", reads_index=True, swiglu="triton")
GROUPED_MM = GroupedMM("grouped_mm")
EXPERT_LOOP = ExpertLoop("expert_loop")
FP8_TRITON = FP8Triton("fp8_triton")
FP8_SM90 = FP8SM90("fp8_sm90")
SCALED_MM = ScaledMM("scaled_mm")
FP8_TORCH = FP8Torch("fp8_torch")
ROUTES = {
    route.name: route for route in (GEMV, TILED, GROUPED_MM, EXPERT_LOOP, FP8_TRITON, FP8_SM90, SCALED_MM, FP8_TORCH)
}

"""Routed experts as one grouped GEMM over expert-sorted rows.

Legend: see ``moe_sbo/__init__.py``.

The hard part is the grouped GEMM: ``torch._grouped_mm`` takes cumulative row offsets on the device
(so no host sync) but only runs for some dtype/device pairs (bf16 on sm90+ CUDA, and the CPU build
since torch 2.9). Elsewhere a per-expert loop over host-side row counts computes the same thing.
On CUDA, dense experts with up to 512 rows per expert run Triton kernels instead, which read only
the weights of experts with rows (``gemv.py`` at decode sizes, ``tiled_gemm.py``
above: ``RoutedExperts.dense_path``). FP8 experts (DeepSeek's block-scaled e4m3 weights) run
``fp8_gemm.py``'s grouped GEMM instead.
Weights use the Hugging Face layout: ``gate_up_proj [L, 2I, H]`` (gate rows first), ``down_proj [L, H, I]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from ..profiling import annotate
from ..quant.fp8 import FP8_BLOCK, FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8, quantize_fp8_blocks, sizes_off_blocks
from ..streams import compute_capability
from .fp8_torch import grouped_linear_fp8, grouped_scaled_mm, scaled_mm_blockwise_supported
from .swiglu import swiglu

if TYPE_CHECKING:
    from ..dispatch.records import DispatchOutput

try:
    from ..quant import kernels as quant_kernels
    from . import fp8_gemm, fp8_gemm_sm90, gemv, tiled_gemm
except ImportError:  # no Triton: FP8 experts run the torch path on CPU, and refuse CUDA
    fp8_gemm = None  # type: ignore[assignment]
    fp8_gemm_sm90 = None  # type: ignore[assignment]
    quant_kernels = None  # type: ignore[assignment]
    gemv = None  # type: ignore[assignment]
    tiled_gemm = None  # type: ignore[assignment]

FP8_KERNELS = ("auto", "triton", "scaled_mm", "torch")
# Dense experts: "gemv" and "tiled" force one Triton kernel, "triton" takes the Triton kernel for the rows.
DENSE_KERNELS = ("auto", "triton", "gemv", "tiled", "torch")
# From here (rows per expert, on average) "auto" runs cuBLAS's block-wise FP8 GEMMs eagerly, one per
# expert, where the warp-specialised sm90 kernel (``fp8_gemm_sm90``) does not run: measured on H200 at
# DeepSeek-V3 dims, from 2048 rows they compute at 800-1040 TFLOP/s against the Triton kernel's
# ~710-790, while with fewer rows the calls' host cost (16 calls: ~0.4 ms) is not hidden. The sm90
# kernel's MLP, replayed, was as fast as cuBLAS's eager one at 8 experts x 4096 rows and 5-9 % faster
# at 8-32 experts x 2048 (docs/BENCHMARKS.md), so where it runs "auto" keeps it eagerly too.
SCALED_MM_MIN_ROWS_PER_EXPERT = 2048
# Dense experts on CUDA under "auto", by the real rows to expect per expert (``low_latency`` hands the
# experts P x C x K rows, C x K of them real on average: ``DispatchOutput.expected_rows``): up to
# GEMV_MAX_ROWS_PER_EXPERT ``gemv``' GEMV, up to TILED_MAX_ROWS_PER_EXPERT ``tiled_gemm``' tiled GEMM,
# above ``torch._grouped_mm``; rows read through an index (``low_latency``'s ``index_rows``) take the
# tiled GEMM at any size above the GEMV's, since ``torch._grouped_mm`` would need them copied first.
# The thresholds come from ``moe-sbo bench dense-experts`` on H200 (docs/BENCHMARKS.md, "Dense routed
# experts").
GEMV_MAX_ROWS_PER_EXPERT = 8
TILED_MAX_ROWS_PER_EXPERT = 512


def kernel_by_rows(rows_per_expert: float, indexed: bool = False) -> str:
    """The dense experts' GEMMs ``kernels="auto"`` picks on CUDA for bf16 on sm90+ by rows per expert
    (``RoutedExperts.dense_path``'s names): ``"gemv"``, ``"tiled"`` or ``"grouped_mm"``; ``indexed``:
    for rows read through an index, the tiled GEMM above the GEMV's rows."""
    if rows_per_expert <= GEMV_MAX_ROWS_PER_EXPERT:
        return "gemv"
    return "tiled" if indexed or rows_per_expert <= TILED_MAX_ROWS_PER_EXPERT else "grouped_mm"


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for tensors like ``x`` on this build and device."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and compute_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def grouped_linear(
    x_RH: torch.Tensor, w_LOH: torch.Tensor, offsets_L: torch.Tensor, use_grouped_mm: bool
) -> torch.Tensor:
    """Rows ``x_RH`` sorted by expert times each expert's ``w_LOH[l]`` transposed -> ``[R, O]``.

    ``offsets_L`` is the int32 cumulative row count (end offset of each expert's rows).
    """
    if use_grouped_mm:
        return torch._grouped_mm(x_RH, w_LOH.transpose(-2, -1), offs=offsets_L)
    # Fallback: one GEMM per expert; needs the counts on the host.
    ends = offsets_L.tolist()
    out_RO = x_RH.new_empty(x_RH.shape[0], w_LOH.shape[1])
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            out_RO[start:end] = F.linear(x_RH[start:end], w_LOH[expert])
        start = end
    return out_RO


class RoutedExperts(nn.Module):
    """The ``L`` routed experts this rank owns: SwiGLU MLPs applied to expert-grouped rows.

    ``fp8``: weights stored as e4m3 with one float32 scale per 128x128 block (``gate_up_proj_scale_inv``
    [L, 2I/128, H/128], ``down_proj_scale_inv`` [L, H/128, I/128]; DeepSeek-V3's format), activations
    quantised per token in 128-value groups, block-scaled GEMMs (H and I must be multiples of 128).
    ``dtype`` is then the activation dtype of the input and output. ``kernels``: for FP8 (see
    ``fp8_path``) ``"auto"`` on CUDA runs ``fp8_gemm.py``'s grouped GEMM (on sm90 at prefill sizes its
    warp-specialised kernel, ``fp8_gemm_sm90.py``), or at prefill sizes outside graph capture where
    that kernel does not run cuBLAS's (``"scaled_mm"``), and ``fp8_torch.grouped_linear_fp8`` off CUDA;
    for dense weights (see ``dense_path``) ``"auto"`` runs ``gemv.py`` on CUDA at decode sizes,
    ``tiled_gemm.py`` at mid sizes and ``torch._grouped_mm`` at prefill sizes, with SwiGLU between
    them as one Triton launch on CUDA (``swiglu.py``). ``"triton"`` forces the Triton kernels (on CPU
    under ``TRITON_INTERPRET=1``), ``"torch"`` the torch path (torch's SwiGLU too).
    """

    gate_up_proj: nn.Parameter  # [L, 2I, H]
    down_proj: nn.Parameter  # [L, H, I]
    gate_up_proj_scale_inv: nn.Parameter  # [L, 2I/128, H/128], FP8 only
    down_proj_scale_inv: nn.Parameter  # [L, H/128, I/128], FP8 only

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fp8: bool = False,
    ):
        super().__init__()
        self.num_local_experts, self.dtype, self.fp8 = num_local_experts, dtype, bool(fp8)
        shapes = {"gate_up_proj": (2 * intermediate_size, hidden_size), "down_proj": (hidden_size, intermediate_size)}
        if self.fp8:
            bad = sizes_off_blocks(hidden_size, intermediate_size)
            if bad:
                raise ValueError(
                    f"FP8 experts need sizes that are multiples of {FP8_BLOCK} (one scale per {FP8_BLOCK}x{FP8_BLOCK} "
                    f"block), got {bad}; use expert_dtype=None (the layer dtype) for this model"
                )
        weight_dtype = FP8_DTYPE if self.fp8 else dtype
        for name, (out, inp) in shapes.items():
            weight = torch.empty(num_local_experts, out, inp, dtype=weight_dtype, device=device)
            self.register_parameter(name, nn.Parameter(weight, requires_grad=not self.fp8))
            if self.fp8:
                scale = torch.empty(num_local_experts, out // FP8_BLOCK, inp // FP8_BLOCK, device=device)
                self.register_parameter(name + "_scale_inv", nn.Parameter(scale, requires_grad=False))
        self.use_grouped_mm: bool | None = None  # None: decide from the input; False forces the loop
        self.kernels = "auto"

    def forward(
        self,
        x_RH: torch.Tensor,
        num_rows_per_expert_L: torch.Tensor,
        scales_RQ: torch.Tensor | None = None,
        expected_rows: int | None = None,
        rows_R: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expert outputs ``[R, H]`` for ``x_RH`` whose rows are grouped by local expert.

        ``num_rows_per_expert_L`` (int, any device) counts each local expert's rows, in order.
        ``scales_RQ``: given when ``x_RH`` arrives already quantised (e4m3 rows and their float32
        scales per 128 values, from fp8 dispatch); FP8 experts only. ``expected_rows``: the real rows
        to expect where padding follows them (``DispatchOutput.expected_rows``); the kernels are
        chosen by it (``dense_path``; FP8 experts' GEMMs and tiles too), the counts stay on the
        device. ``rows_R`` (int [R],
        ``DispatchOutput.expert_rows_R``): the input rows are ``x_RH[rows_R]`` (``x_RH`` is then
        [X, H], rows contiguous along H); the tiled GEMM and FP8 experts' quantisation read them
        through it, the other kernels gather them first.
        """
        with annotate("routed_experts"):
            offsets_L = num_rows_per_expert_L.to(device=x_RH.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            num_rows = x_RH.shape[0] if rows_R is None else rows_R.shape[0]
            if self.fp8:
                rows_per_expert = self._rows_per_expert(num_rows, expected_rows)
                return self._forward_fp8(x_RH, scales_RQ, offsets_L, num_rows_per_expert_L, rows_R, rows_per_expert)
            if scales_RQ is not None:
                raise ValueError("scales_RQ is for FP8 experts; these hold dense weights: pass dequantised rows")
            path = self.dense_path(x_RH, expected_rows, num_rows, indexed=rows_R is not None)
            if rows_R is not None and path != "tiled":  # only the tiled GEMM reads through an index
                x_RH, rows_R = x_RH.index_select(0, rows_R), None
            # SwiGLU between the GEMMs: one Triton launch where the GEMMs are Triton's and on CUDA
            # (``swiglu``), torch's two off CUDA and under kernels="torch".
            if path == "gemv":
                gate_up_R2I = gemv.grouped_gemv(x_RH, self.gate_up_proj, offsets_L)
                return gemv.grouped_gemv(swiglu(gate_up_R2I, offsets_L, kernel=True), self.down_proj, offsets_L)
            if path == "tiled":
                # The tiles for the rows to expect (padding excluded), not for every row handed over.
                tiles = tiled_gemm.dense_config(self._rows_per_expert(num_rows, expected_rows), x_RH.element_size())
                gemm = functools.partial(tiled_gemm.grouped_gemm, config=tiles)
                gate_up_R2I = gemm(x_RH, self.gate_up_proj, offsets_L, rows_R=rows_R)
                return gemm(swiglu(gate_up_R2I, offsets_L, kernel=True), self.down_proj, offsets_L)
            use_grouped_mm = self.use_grouped_mm
            if use_grouped_mm is None:
                use_grouped_mm = grouped_mm_supported(x_RH)
            gate_up_R2I = grouped_linear(x_RH, self.gate_up_proj, offsets_L, use_grouped_mm)
            act_RI = swiglu(gate_up_R2I, offsets_L, kernel=False if self.kernels == "torch" else None)
            return grouped_linear(act_RI, self.down_proj, offsets_L, use_grouped_mm)

    def forward_dispatched(self, recv: DispatchOutput) -> torch.Tensor:
        """``forward`` on what a dispatch delivered: its rows (read through its index when it has one,
        ``expert_rows_R``), counts, scales and the real rows to expect -> ``[R, H]`` in expert order,
        what ``combine`` takes."""
        return self(
            recv.expert_x_RH,
            recv.num_rows_per_expert_L,
            recv.expert_scales_RQ,
            recv.expected_rows,
            recv.expert_rows_R,
        )

    def dispatched_path(self, recv: DispatchOutput) -> str:
        """``dense_path`` for what a dispatch delivered, as ``forward_dispatched`` runs it: the rows
        handed over are its index's when it has one (``expert_rows_R``), read through it."""
        rows_R = recv.expert_rows_R
        num_rows = None if rows_R is None else rows_R.shape[0]
        return self.dense_path(recv.expert_x_RH, recv.expected_rows, num_rows, indexed=rows_R is not None)

    def _rows_per_expert(self, num_rows: int, expected_rows: int | None) -> float:
        """Rows per local expert to expect: ``expected_rows`` where given (never more than the
        ``num_rows`` handed over), else all of them."""
        rows = num_rows if expected_rows is None else min(expected_rows, num_rows)
        return rows / self.num_local_experts

    def dense_path(
        self,
        x_RH: torch.Tensor,
        expected_rows: int | None = None,
        num_rows: int | None = None,
        indexed: bool = False,
    ) -> str:
        """Which GEMMs dense (not FP8) experts run for the rows ``x_RH``: ``"gemv"``
        (``gemv``), ``"tiled"`` (``tiled_gemm``) or ``"grouped_mm"``
        (``torch._grouped_mm``, or a per-expert loop where it does not run). The rule counts
        ``expected_rows`` where given (padding follows the real rows), else every row handed over
        (``num_rows``, default ``x_RH``'s: rows read through an index may number otherwise);
        ``indexed``: the rows are to be read through an index (``forward``'s ``rows_R``).

        ``kernels="auto"`` on CUDA: ``"gemv"`` up to ``GEMV_MAX_ROWS_PER_EXPERT`` rows per expert,
        ``"tiled"`` up to ``TILED_MAX_ROWS_PER_EXPERT`` (``indexed``: at any size) for bf16 on sm90+
        (where its tiles were measured; elsewhere ``"grouped_mm"``), ``"grouped_mm"`` above; off CUDA
        ``"grouped_mm"``.
        ``"triton"``: the first two by the same rule, ``"tiled"`` above. ``"gemv"`` and ``"tiled"`` force
        that kernel; the Triton kernels need CUDA, or ``TRITON_INTERPRET=1`` on CPU."""
        if self.kernels not in DENSE_KERNELS:
            raise ValueError(f"kernels must be one of {DENSE_KERNELS} for dense experts, got {self.kernels!r}")
        if self.kernels == "torch" or (gemv is None and self.kernels == "auto"):
            return "grouped_mm"
        if gemv is None:
            raise RuntimeError(f"kernels={self.kernels!r} needs Triton (pip install triton); use 'auto' or 'torch'")
        rows_per_expert = self._rows_per_expert(x_RH.shape[0] if num_rows is None else num_rows, expected_rows)
        if self.kernels == "auto":
            if x_RH.device.type != "cuda":
                return "grouped_mm"
            path = kernel_by_rows(rows_per_expert, indexed)
            # The tiled GEMM's tiles were measured for bf16 on sm90+ (elsewhere they may not fit).
            return "grouped_mm" if path == "tiled" and not grouped_mm_supported(x_RH) else path
        if x_RH.device.type != "cuda" and not env.triton_interpreting():
            raise RuntimeError(
                f"kernels={self.kernels!r} needs CUDA tensors, or TRITON_INTERPRET=1 with triton installed"
            )
        if self.kernels == "triton":
            return "gemv" if rows_per_expert <= GEMV_MAX_ROWS_PER_EXPERT else "tiled"
        return self.kernels

    def _forward_fp8(
        self,
        x_RH: torch.Tensor,
        scales_RQ: torch.Tensor | None,
        offsets_L: torch.Tensor,
        num_rows_per_expert_L: torch.Tensor,
        rows_R: torch.Tensor | None,
        rows_per_expert: float,
    ) -> torch.Tensor:
        # Kernels and tiles for the rows to expect (padding excluded), as the dense experts choose.
        path = self.fp8_path(x_RH.device, round(rows_per_expert * self.num_local_experts))
        if rows_R is not None and (path == "torch" or scales_RQ is not None):
            # Rows already quantised, or the torch path: gather them (and their scales) first.
            x_RH = x_RH.index_select(0, rows_R)
            scales_RQ = None if scales_RQ is None else scales_RQ.index_select(0, rows_R)
            rows_R = None
        if path == "torch":
            q_RH, scales_RQ = quantize_fp8(x_RH) if scales_RQ is None else (x_RH, scales_RQ)
            gate_up_R2I = grouped_linear_fp8(
                q_RH, scales_RQ, self.gate_up_proj, self.gate_up_proj_scale_inv, offsets_L, self.dtype
            )
            gate_RI, up_RI = gate_up_R2I.float().chunk(2, dim=-1)
            q_RI, act_scales_RQ = quantize_fp8(F.silu(gate_RI) * up_RI)
            return grouped_linear_fp8(
                q_RI, act_scales_RQ, self.down_proj, self.down_proj_scale_inv, offsets_L, self.dtype
            )
        assert fp8_gemm is not None and quant_kernels is not None
        gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
        if path == "scaled_mm":
            counts = num_rows_per_expert_L.tolist()  # the one host read of this path

            def gemm(q, s, w, ws):
                return grouped_scaled_mm(q, s, w, ws, counts, self.dtype)
        else:

            def gemm(q, s, w, ws):
                return fp8_gemm.grouped_gemm(q, s, w, ws, offsets_L, self.dtype, rows_per_expert=rows_per_expert)

        # Scales K-major where the sm90 kernel runs (it loads them so); through the index where there is
        # one: the gather fused into the quantisation.
        k_major = path == "triton" and fp8_gemm.k_major_scales_wanted(x_RH.device, rows_per_expert)
        if scales_RQ is None:
            q_RH, scales_RQ = quant_kernels.quantize_rows(x_RH, offsets_L, rows_R, k_major=k_major)
        else:
            q_RH = x_RH
        gate_up_R2I = gemm(q_RH, scales_RQ, self.gate_up_proj, self.gate_up_proj_scale_inv)
        q_RI, act_scales_RQ = quant_kernels.silu_mul_quantize(gate_up_R2I, offsets_L, k_major=k_major)
        return gemm(q_RI, act_scales_RQ, self.down_proj, self.down_proj_scale_inv)

    def fp8_path(self, device: torch.device, num_rows: int) -> str:
        """Which FP8 GEMMs a forward of ``num_rows`` rows (the real ones to expect, where padding
        follows them) on ``device`` runs: ``"triton"``
        (``fp8_gemm``: device counts, no host sync, CUDA-graph capturable), ``"scaled_mm"`` (cuBLAS
        per expert, sm90; reads the counts on the host; chosen by ``"auto"`` when not capturing a
        graph, the rows per expert reach ``SCALED_MM_MIN_ROWS_PER_EXPERT`` and ``fp8_gemm_sm90``'s
        kernel does not run on the device) or ``"torch"``."""
        if self.kernels not in FP8_KERNELS:
            raise ValueError(f"kernels must be one of {FP8_KERNELS}, got {self.kernels!r}")
        if self.kernels == "torch":
            return "torch"
        if device.type != "cuda":
            if self.kernels == "scaled_mm":
                raise RuntimeError("kernels='scaled_mm' needs an sm90 CUDA device; use 'auto' or 'torch' on CPU")
            if self.kernels == "triton":
                if fp8_gemm is None or not env.triton_interpreting():
                    raise RuntimeError(
                        "kernels='triton' needs CUDA tensors, or TRITON_INTERPRET=1 (Triton's CPU interpreter) "
                        "with triton installed"
                    )
                return "triton"
            return "torch"
        if fp8_gemm is None:
            raise RuntimeError("FP8 experts on CUDA need Triton; pip install triton")
        major, minor = compute_capability(device)
        if (major, minor) < (8, 9):
            raise RuntimeError(
                f"FP8 experts need FP8 tensor cores (sm89 or newer), got sm{major}{minor}; use expert_dtype=None"
            )
        blockwise = scaled_mm_blockwise_supported(device)
        if self.kernels == "scaled_mm":
            if not blockwise:
                raise RuntimeError("kernels='scaled_mm' needs cuBLAS's block-wise FP8 (sm90); use 'auto' or 'triton'")
            return "scaled_mm"
        large = num_rows >= SCALED_MM_MIN_ROWS_PER_EXPERT * self.num_local_experts
        eager = not torch.cuda.is_current_stream_capturing()
        if self.kernels == "auto" and blockwise and large and eager and not fp8_gemm_sm90.device_supported(device):
            return "scaled_mm"
        return "triton"

    @torch.no_grad()
    def set_expert(
        self,
        local: int,
        gate_up_2IH: torch.Tensor,
        down_HI: torch.Tensor,
        gate_up_scale_inv: torch.Tensor | None = None,
        down_scale_inv: torch.Tensor | None = None,
    ) -> None:
        """Expert ``local``'s weights, dense or e4m3 with block scales (``*_scale_inv`` given),
        converted to this module's format: quantised into FP8 blocks, or dequantised, as needed."""
        for name, weight, scale_inv in (
            ("gate_up_proj", gate_up_2IH, gate_up_scale_inv),
            ("down_proj", down_HI, down_scale_inv),
        ):
            if self.fp8:
                if scale_inv is None:
                    weight, scale_inv = quantize_fp8_blocks(weight)
                getattr(self, name + "_scale_inv")[local].copy_(scale_inv)
            elif scale_inv is not None:
                weight = dequantize_fp8_blocks(weight, scale_inv)
            getattr(self, name)[local].copy_(weight)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with one row per local expert ([L, ...]): the weights, and the FP8 block scales."""
        names = ("gate_up_proj", "down_proj") + (("gate_up_proj_scale_inv", "down_proj_scale_inv") if self.fp8 else ())
        return [getattr(self, name).data for name in names]

    def dense_expert(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``local``'s (gate_up [2I, H], down [H, I]) weights, dequantised to float32 when FP8."""
        if not self.fp8:
            return self.gate_up_proj[local], self.down_proj[local]
        return (
            dequantize_fp8_blocks(self.gate_up_proj[local], self.gate_up_proj_scale_inv[local]),
            dequantize_fp8_blocks(self.down_proj[local], self.down_proj_scale_inv[local]),
        )

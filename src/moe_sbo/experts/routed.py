"""Routed experts as one grouped GEMM over expert-sorted rows: the weights, and a forward that asks
``select.choose`` for its route (``routes.py``) and runs it.

Legend: see ``moe_sbo/__init__.py``.

The hard part is the grouped GEMM: the rows per expert are known only on the device, and each way of
running it (a Triton GEMV at decode sizes, tiled Triton GEMMs, ``torch._grouped_mm``, a per-expert
loop, and the FP8 kernels: Triton, sm90 Gluon, cuBLAS per expert, a torch reference) runs on some
devices, dtypes, sizes and graph captures only. ``routes.py`` holds one object per way, saying what it
supports; ``select.py`` holds the rule table and caches its answer per (device, dtype, rows bucket,
capture), so the forward does not branch over the routes.
Weights use the Hugging Face layout: ``gate_up_proj [L, 2I, H]`` (gate rows first), ``down_proj [L, H, I]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..profiling import annotate
from ..quant.fp8 import FP8_BLOCK, FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks, sizes_off_blocks
from .conditions import Conditions
from .routes import ExpertRows, Route
from .select import choose

if TYPE_CHECKING:
    from ..dispatch.records import DispatchOutput


class RoutedExperts(nn.Module):
    """The ``L`` routed experts this rank owns: SwiGLU MLPs applied to expert-grouped rows.

    ``fp8``: weights stored as e4m3 with one float32 scale per 128x128 block (``gate_up_proj_scale_inv``
    [L, 2I/128, H/128], ``down_proj_scale_inv`` [L, H/128, I/128]; DeepSeek-V3's format), activations
    quantised per token in 128-value groups, block-scaled GEMMs (H and I must be multiples of 128).
    ``dtype`` is then the activation dtype of the input and output. ``kernels``
    (``kernel_choice``'s vocabulary, plus ``routes.py``'s route names, settable at any time):
    ``"auto"`` (default) runs the route ``select.py``'s rule table picks by device, dtype and rows per
    expert; ``"triton"`` the Triton routes (on CPU under ``TRITON_INTERPRET=1``), ``"torch"`` the
    torch routes (torch's SwiGLU too); a route's name (``"gemv"``, ``"tiled"``, ``"grouped_mm"``,
    ``"expert_loop"``, ``"fp8_triton"``, ``"fp8_sm90"``, ``"scaled_mm"``, ``"fp8_torch"``) forces it.
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
        to expect where padding follows them (``DispatchOutput.expected_rows``); the route and its
        tiles are chosen by it (``route``), the counts stay on the device. ``rows_R`` (int [R],
        ``DispatchOutput.expert_rows_R``): the input rows are ``x_RH[rows_R]`` (``x_RH`` is then
        [X, H], rows contiguous along H); a route that ``reads_index`` reads them through it (FP8
        routes only while they quantise the rows themselves), the others take them gathered.
        """
        with annotate("routed_experts"):
            if scales_RQ is not None and not self.fp8:
                raise ValueError("scales_RQ is for FP8 experts; these hold dense weights: pass dequantised rows")
            num_rows = x_RH.shape[0] if rows_R is None else rows_R.shape[0]
            rows_per_expert = self._rows_per_expert(num_rows, expected_rows)
            route = self._choose(x_RH, rows_per_expert, indexed=rows_R is not None)
            if rows_R is not None and not (route.reads_index and scales_RQ is None):
                x_RH = x_RH.index_select(0, rows_R)
                scales_RQ = None if scales_RQ is None else scales_RQ.index_select(0, rows_R)
                rows_R = None
            offsets_L = num_rows_per_expert_L.to(device=x_RH.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            rows = ExpertRows(x_RH, offsets_L, num_rows_per_expert_L, rows_per_expert, scales_RQ, rows_R)
            return route.run(self, rows)

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

    def route(
        self, x_RH: torch.Tensor, expected_rows: int | None = None, num_rows: int | None = None, indexed: bool = False
    ) -> Route:
        """The route a forward on rows like ``x_RH`` runs (``select.choose``), by the rows per expert
        to expect: ``expected_rows`` where given (padding follows the real rows), else every row handed
        over (``num_rows``, default ``x_RH``'s: rows read through an index may number otherwise);
        ``indexed``: the rows are read through an index (``forward``'s ``rows_R``)."""
        num_rows = x_RH.shape[0] if num_rows is None else num_rows
        return self._choose(x_RH, self._rows_per_expert(num_rows, expected_rows), indexed)

    def dispatched_route(self, recv: DispatchOutput) -> Route:
        """``route`` for what a dispatch delivered, as ``forward_dispatched`` runs it: the rows handed
        over are its index's when it has one (``expert_rows_R``), read through it."""
        rows_R = recv.expert_rows_R
        num_rows = None if rows_R is None else rows_R.shape[0]
        return self.route(recv.expert_x_RH, recv.expected_rows, num_rows, indexed=rows_R is not None)

    def _choose(self, x_RH: torch.Tensor, rows_per_expert: float, indexed: bool) -> Route:
        return choose(Conditions.of(x_RH, self.fp8, rows_per_expert, indexed), self.kernels)

    def _rows_per_expert(self, num_rows: int, expected_rows: int | None) -> float:
        """Rows per local expert to expect: ``expected_rows`` where given (never more than the
        ``num_rows`` handed over), else all of them."""
        rows = num_rows if expected_rows is None else min(expected_rows, num_rows)
        return rows / self.num_local_experts

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

"""Routed experts as one grouped GEMM over expert-sorted rows, and the shared experts' dense MLP.

Legend: see ``moe_sbo/__init__.py``.

The hard part is the grouped GEMM: ``torch._grouped_mm`` takes cumulative row offsets on the device
(so no host sync) but only runs for some dtype/device pairs (bf16 on sm90+ CUDA, and the CPU build
since torch 2.9). Elsewhere a per-expert loop over host-side row counts computes the same thing.
Weights use the Hugging Face layout: ``gate_up_proj [L, 2I, H]`` (gate rows first), ``down_proj [L, H, I]``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .profiling import annotate


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for tensors like ``x`` on this build and device."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and _capability(x.device) >= (9, 0)
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
    """The ``L`` routed experts this rank owns: SwiGLU MLPs applied to expert-grouped rows."""

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_local_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
        )
        self.use_grouped_mm: bool | None = None  # None: decide from the input; False forces the loop

    def forward(self, x_RH: torch.Tensor, num_rows_per_expert_L: torch.Tensor) -> torch.Tensor:
        """Expert outputs ``[R, H]`` for ``x_RH`` whose rows are grouped by local expert.

        ``num_rows_per_expert_L`` (int, any device) counts each local expert's rows, in order.
        """
        with annotate("routed_experts"):
            offsets_L = num_rows_per_expert_L.to(device=x_RH.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            use_grouped_mm = self.use_grouped_mm
            if use_grouped_mm is None:
                use_grouped_mm = grouped_mm_supported(x_RH)
            gate_up_R2I = grouped_linear(x_RH, self.gate_up_proj, offsets_L, use_grouped_mm)
            gate_RI, up_RI = gate_up_R2I.chunk(2, dim=-1)
            return grouped_linear(F.silu(gate_RI) * up_RI, self.down_proj, offsets_L, use_grouped_mm)


class SharedExperts(nn.Module):
    """The shared experts, fused into one dense SwiGLU MLP of width J (``I * num_shared_experts``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        # gate and up in one weight so the first projection is a single GEMM.
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size, dtype=dtype, device=device))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``: ``down(up_and_activate(x))``."""
        return self.down(self.up_and_activate(x_TH))

    # The two halves are separate so an overlap strategy can run them in different transfer windows.
    def up_and_activate(self, x_TH: torch.Tensor) -> torch.Tensor:
        """First half: ``silu(x gate^T) * (x up^T)`` -> ``[T, J]``."""
        with annotate("shared_experts"):
            gate_TJ, up_TJ = F.linear(x_TH, self.gate_up_proj).chunk(2, dim=-1)
            return F.silu(gate_TJ) * up_TJ

    def down(self, h_TJ: torch.Tensor) -> torch.Tensor:
        """Second half: ``h down^T`` -> ``[T, H]``."""
        with annotate("shared_experts"):
            return F.linear(h_TJ, self.down_proj)

"""The shared experts: one dense SwiGLU MLP every token passes through, in two halves so that an
overlap strategy can run them in different transfer windows.

Legend: see ``moe_sbo/__init__.py``; J is the shared experts' fused width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..profiling import annotate
from .swiglu import swiglu


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
            return swiglu(F.linear(x_TH, self.gate_up_proj))

    def down(self, h_TJ: torch.Tensor) -> torch.Tensor:
        """Second half: ``h down^T`` -> ``[T, H]``."""
        with annotate("shared_experts"):
            return F.linear(h_TJ, self.down_proj)

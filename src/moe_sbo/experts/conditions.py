"""What the routed experts' route choice depends on (``Conditions``) and the thresholds of rows per
expert that the rule table (``select.py``) reads (``Rows``). The routes (``routes.py``) say what they
support in these terms, and the selector picks among them: both import this module, neither the other's
internals. The hard part is cost: ``Conditions`` is built on every forward and is the selector's cache
key, so the rows enter only as the thresholds they pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernel_choice import HAS_TRITON, interpreting
from ..streams import compute_capability

if HAS_TRITON:
    from . import fp8_gemm_sm90

HAS_GLUON = HAS_TRITON and fp8_gemm_sm90.gluon is not None  # the sm90 kernel's language imports

GEMV_MAX_ROWS_PER_EXPERT = 8
TILED_MAX_ROWS_PER_EXPERT = 512
SM90_MIN_ROWS_PER_EXPERT = 256  # above: fp8_sm90 eagerly (where fp8_gemm's LARGE_CONFIG begins)
SM90_CAPTURED_MIN_ROWS_PER_EXPERT = 128
SCALED_MM_MIN_ROWS_PER_EXPERT = 2048


class Rows(NamedTuple):
    """The thresholds of rows per expert that the rule table reads, and which of them r passes (a
    tuple: built on every forward, so cheap to make and to hash)."""

    gemv: bool  # r <= GEMV_MAX_ROWS_PER_EXPERT
    tiled: bool  # r <= TILED_MAX_ROWS_PER_EXPERT
    sm90: bool  # r > SM90_MIN_ROWS_PER_EXPERT
    sm90_captured: bool  # r >= SM90_CAPTURED_MIN_ROWS_PER_EXPERT
    scaled_mm: bool  # r >= SCALED_MM_MIN_ROWS_PER_EXPERT

    @classmethod
    def of(cls, rows_per_expert: float) -> Rows:
        r = rows_per_expert
        return cls(
            r <= GEMV_MAX_ROWS_PER_EXPERT,
            r <= TILED_MAX_ROWS_PER_EXPERT,
            r > SM90_MIN_ROWS_PER_EXPERT,
            r >= SM90_CAPTURED_MIN_ROWS_PER_EXPERT,
            r >= SCALED_MM_MIN_ROWS_PER_EXPERT,
        )


class Conditions(NamedTuple):
    """What the choice depends on (a tuple, as ``Rows``): the rows' ``device_type`` and CUDA
    ``capability`` (None off CUDA), their ``dtype``, whether the weights are ``fp8``, the ``rows`` per
    expert to expect (as the thresholds they pass), whether a CUDA graph is being captured
    (``capture``), whether the rows are read through an index (``indexed``), and this process's
    ``triton`` (imports), ``interpreting`` (``TRITON_INTERPRET=1``; read off CUDA only) and ``gluon``
    (the sm90 kernel's language imports)."""

    device_type: str
    capability: tuple[int, int] | None
    dtype: torch.dtype
    fp8: bool
    rows: Rows
    capture: bool = False
    indexed: bool = False
    triton: bool = HAS_TRITON
    interpreting: bool = False
    gluon: bool = HAS_GLUON

    @property
    def sm(self) -> str:
        """The capability as ``sm`` digits (``"90"``), ``"-"`` off CUDA."""
        return "-" if self.capability is None else f"{self.capability[0]}{self.capability[1]}"

    @classmethod
    def of(cls, x_RH: torch.Tensor, fp8: bool, rows_per_expert: float, indexed: bool = False) -> Conditions:
        """The conditions of a forward on rows like ``x_RH``."""
        device = x_RH.device
        device_type = device.type
        cuda = device_type == "cuda"
        return cls(
            device_type,
            compute_capability(device) if cuda else None,
            x_RH.dtype,
            fp8,
            Rows.of(rows_per_expert),
            cuda and torch.cuda.is_current_stream_capturing(),
            indexed,
            HAS_TRITON,
            not cuda and interpreting(),  # it matters off CUDA only
            HAS_GLUON,
        )

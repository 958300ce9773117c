"""The experts of an MoE layer: routed experts (``routed``: one grouped GEMM over expert-sorted rows, by
``gemv``, ``tiled_gemm`` or ``torch._grouped_mm`` for bf16 weights and ``fp8_gemm``/``fp8_torch`` for
block-scaled FP8 ones) and the shared experts (``shared``)."""

from .routed import RoutedExperts
from .shared import SharedExperts

__all__ = ["RoutedExperts", "SharedExperts"]

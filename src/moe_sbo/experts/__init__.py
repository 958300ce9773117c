"""The experts of an MoE layer: routed experts (``routed``: the weights and the forward; ``routes``: one
object per way of running their grouped GEMMs, ``gemv``, ``tiled_gemm`` or ``torch._grouped_mm`` for
bf16 weights and ``fp8_gemm``/``fp8_gemm_sm90``/``fp8_torch`` for block-scaled FP8 ones, over the tile
schedule of ``tiles``; ``select``: the rule table that picks one) and the shared experts (``shared``)."""

from .routed import RoutedExperts
from .shared import SharedExperts

__all__ = ["RoutedExperts", "SharedExperts"]

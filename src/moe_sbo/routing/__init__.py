"""The router: gate logits -> top-k expert ids and weights (``router``), in torch or as one Triton
kernel (``kernel``)."""

from .router import Router, TopkOutput

__all__ = ["Router", "TopkOutput"]

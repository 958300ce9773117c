"""Communication/computation overlap strategies: single-batch overlap (``sbo``)."""

from .sbo import (
    FIXED_MODES,
    OVERLAP_MODES,
    AutoOverlap,
    FixedOverlap,
    Overlap,
    SharedOutput,
    choices_from_rows,
    make_overlap,
)

__all__ = [
    "FIXED_MODES",
    "OVERLAP_MODES",
    "AutoOverlap",
    "FixedOverlap",
    "Overlap",
    "SharedOutput",
    "choices_from_rows",
    "make_overlap",
]

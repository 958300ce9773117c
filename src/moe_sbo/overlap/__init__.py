"""Communication/computation overlap: single-batch overlap (``sbo``: where the shared experts run
relative to the transfers), two-batch overlap (``tbo``: two micro-batches interleaved, ``tbo_auto``
choosing it per batch size), the stage runner they share (``stages``) and what every ``auto`` choice
shares (``auto``). The package exports the SBO names; the others are imported from their modules."""

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

"""moe-sbo: expert-parallel DeepSeek-style MoE layers with communication/computation overlap.

The shape legend, one for the whole package: a tensor that crosses a function boundary carries its
shape as a suffix of single uppercase letters (``x_TH`` is [T, H]); digits are literal sizes
(``gate_up_proj_E2IH`` is [E, 2 * I, H]). A module may add letters in its own docstring, never give
one of these another meaning.

====  =========================================================================================
T     tokens on this rank
H     hidden size
I     routed-expert intermediate size
J     shared-experts intermediate size (I times the number of shared experts)
E     routed experts (global)
L     routed experts local to this rank
G     expert groups (the router's group limit)
K     top-k: experts chosen per token
P     ranks in the expert-parallel group
M     token rows that reached this rank (one per token and destination rank)
R     expert rows: (row, local expert) pairs this rank's experts compute, grouped by expert
C     capacity: most tokens per rank of a fixed-capacity dispatcher (``max_tokens_per_rank``)
S     slots of a fixed-capacity buffer: P * C
B     bytes of one packed dispatch row
Q     fp8 scale groups in a row (H / 128)
V     values in one fp8 scale group (128)
N     attention query heads
A     attention key/value heads (GQA)
D     attention head dimension
F     rotary frequencies (D / 2)
Z     KV-cache sequence slots
W     KV-cache capacity in tokens per sequence
O     output features of a weight
U     input features of a weight
X     rows of any count (a function's own input)
Y     any other count a function defines locally (say what in its docstring)
====  =========================================================================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import PRESETS, MoEConfig, get_preset
    from .eplb.runtime import EPLBOptions
    from .layer import MoELayer
    from .weights import MoEWeights

__all__ = ["PRESETS", "EPLBOptions", "MoEConfig", "MoELayer", "MoEWeights", "get_preset"]
__version__ = "0.1.0"
# Imported on first use, not with the package: ``moe-sbo`` must be able to catch a Ctrl-C that
# arrives while torch is still being imported (the command line imports torch inside ``main``).
_EXPORTS = {
    "PRESETS": "config",
    "MoEConfig": "config",
    "get_preset": "config",
    "MoELayer": "layer",
    "EPLBOptions": "eplb.runtime",
    "MoEWeights": "weights",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

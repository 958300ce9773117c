"""``low_latency``: DeepEP low-latency style dispatch, fixed-capacity and free of host reads, so a whole
MoE forward can be captured in a CUDA graph. ``dispatcher.py`` runs the phases through the execution
path it chooses once per shape (``paths.py``, ``fused.py``); its docstring maps the other files.

The hard part is choosing among the execution paths the options multiply into (torch or fused Triton
kernels, one or two passes, NCCL or symmetric memory, direct launches or replayed index graphs) while
every path puts the same bytes on the wire and the same layout in front of the experts.
"""

from .dispatcher import LowLatencyDispatcher, LowLatencyHandle, mask_padding_tokens
from .options import LowLatencyOptions
from .wire import RowFormat

__all__ = ["LowLatencyDispatcher", "LowLatencyHandle", "LowLatencyOptions", "RowFormat", "mask_padding_tokens"]

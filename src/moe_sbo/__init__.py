"""moe-sbo: expert-parallel DeepSeek-style MoE layers with communication/computation overlap."""

from .config import PRESETS, MoEConfig, get_preset
from .layer import MoELayer
from .weights import MoEWeights

__all__ = ["PRESETS", "MoEConfig", "MoELayer", "MoEWeights", "get_preset"]
__version__ = "0.1.0"

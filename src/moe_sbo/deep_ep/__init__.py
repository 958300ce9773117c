"""``moe_sbo.deep_ep``: DeepEP 1.x's public Python API over moe-sbo's dispatchers. Code written for
``deep_ep`` runs by changing one import::

    import moe_sbo.deep_ep as deep_ep      # was: import deep_ep

``Buffer`` (``buffer.py``), ``Config`` (``config.py``), ``EventOverlap`` (``events.py``) and
``topk_idx_t``, DeepEP's top-k id dtype. This package is an adapter at the edge: it uses the core's
public contract (``moe_sbo.dispatch``, ``moe_sbo.hooks``, ``moe_sbo.streams``) and nothing in the core
imports it. docs/DEEP_EP.md maps every method and says what differs and why.
"""

import torch

from .buffer import Buffer
from .config import Config
from .events import EventOverlap

topk_idx_t = torch.int64  # DeepEP's ``deep_ep.topk_idx_t``

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

"""``MoeSboTboDispatcher``: what ``create_moe_dispatcher`` returns for moe-sbo's dispatcher, SGLang's
``MaybeTboDeepEPDispatcher`` holding ``MoeSboDispatcher``s (two when two-batch overlap is on, one per
micro-batch, as SGLang's holds two DeepEP dispatchers).

SGLang's DeepSeek model checks ``isinstance(dispatcher, MaybeTboDeepEPDispatcher)`` before it hands
its shared experts to ``register_deepep_dispatch_hook``, so this is that class. The hard part is the
registries: the base class's ``register_pre/post_*_hook`` replace its ``dispatch``/``combine`` on the
instance (and so miss the ``dispatch_a``/``dispatch_b`` halves two-batch overlap calls); here each
registration goes to every inner dispatcher, which fires it at moe-sbo's events on every path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang.srt.batch_overlap.two_batch_overlap import MaybeTboDeepEPDispatcher
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher
from sglang.srt.layers.moe.utils import is_tbo_enabled

from moe_sbo.hooks import HookHandle

from .dispatcher import MoeSboDispatcher


@dataclass
class Handles:
    """One registration on every inner dispatcher; ``remove()`` detaches all (safe while hooks run)."""

    handles: list[HookHandle]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class MoeSboTboDispatcher(MaybeTboDeepEPDispatcher):
    """``MaybeTboDeepEPDispatcher`` over ``MoeSboDispatcher``; ``kwargs`` as ``MoeSboDispatcher``'s."""

    def __init__(self, **kwargs: Any):
        BaseDispatcher.__init__(self)  # not the base's __init__: it would build SGLang's DeepEP dispatchers
        self._inners = [MoeSboDispatcher(**kwargs) for _ in range(2 if is_tbo_enabled() else 1)]

    @property
    def inners(self) -> list[MoeSboDispatcher]:
        return self._inners

    def _register(self, name: str, hook: Callable) -> Handles:
        return Handles([getattr(inner, name)(hook) for inner in self._inners])

    def register_pre_dispatch_hook(self, hook: Callable) -> Handles:
        return self._register("register_pre_dispatch_hook", hook)

    def register_post_dispatch_hook(self, hook: Callable) -> Handles:
        return self._register("register_post_dispatch_hook", hook)

    def register_pre_combine_hook(self, hook: Callable) -> Handles:
        return self._register("register_pre_combine_hook", hook)

    def register_post_combine_hook(self, hook: Callable) -> Handles:
        return self._register("register_post_combine_hook", hook)

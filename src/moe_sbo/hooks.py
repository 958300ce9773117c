"""Hook registry: code attached to the six moments of a dispatch/combine without touching either.

Events, in the order one forward fires them::

    pre_dispatch -> dispatch_in_flight -> post_dispatch -> pre_combine -> combine_in_flight -> post_combine

A hook is ``fn(dispatcher, payload) -> replacement | None``. Hooks of one event run in registration
order and each sees the previous one's replacement. The ``*_in_flight`` events have nothing to
replace (the transfer is already on the wire): a hook there must return ``None``.

The hard part is mutation while hooks run, which SGLang's registry gets wrong (it iterates the
live ``OrderedDict``). Here ``run`` iterates a snapshot and skips entries removed meanwhile, so any
hook may remove itself or any other at any time; a hook added while its event runs first fires at
the next run. ``HookScope`` ties hooks to one forward: everything it registered is removed when the
``with`` block exits, normally or by an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HOOK_EVENTS: tuple[str, ...] = (
    "pre_dispatch",
    "dispatch_in_flight",
    "post_dispatch",
    "pre_combine",
    "combine_in_flight",
    "post_combine",
)
IN_FLIGHT_EVENTS = frozenset({"dispatch_in_flight", "combine_in_flight"})

HookFn = Callable[[Any, Any], Any]


@dataclass(eq=False)
class HookHandle:
    """Returned by ``register``; ``remove()`` detaches the hook (idempotent, safe while hooks run)."""

    event: str
    fn: HookFn
    once: bool
    _registry: HookRegistry = field(repr=False)
    active: bool = True

    def remove(self) -> None:
        if self.active:
            self.active = False
            self._registry._detach(self)


class HookRegistry:
    """The hooks of one dispatcher, per event."""

    def __init__(self) -> None:
        self._hooks: dict[str, list[HookHandle]] = {event: [] for event in HOOK_EVENTS}

    def register(self, event: str, fn: HookFn, *, once: bool = False) -> HookHandle:
        """Attach ``fn`` to ``event``; ``once=True`` removes it just before its first call."""
        if event not in self._hooks:
            raise ValueError(f"event must be one of {HOOK_EVENTS}, got {event!r}")
        if not callable(fn):
            raise TypeError(f"hook must be callable as fn(dispatcher, payload), got {type(fn).__name__}")
        handle = HookHandle(event=event, fn=fn, once=once, _registry=self)
        # A new list rather than append: a run in progress keeps iterating its own snapshot.
        self._hooks[event] = [*self._hooks[event], handle]
        return handle

    def _detach(self, handle: HookHandle) -> None:
        self._hooks[handle.event] = [h for h in self._hooks[handle.event] if h is not handle]

    def run(self, event: str, dispatcher: Any, payload: Any) -> Any:
        """Call the hooks of ``event`` in order; return the payload after any replacements."""
        for handle in self._hooks[event]:  # the list object is never mutated: a snapshot
            if not handle.active:
                continue  # removed by an earlier hook of this run
            if handle.once:
                handle.remove()  # before the call, so it is gone even if the hook raises
            replacement = handle.fn(dispatcher, payload)
            if replacement is not None:
                if event in IN_FLIGHT_EVENTS:
                    raise TypeError(
                        f"a {event} hook must return None (the transfer is already in flight), got "
                        f"{type(replacement).__name__} from {getattr(handle.fn, '__qualname__', handle.fn)}; "
                        "replace values at pre_/post_ events instead"
                    )
                payload = replacement
        return payload

    def count(self, event: str | None = None) -> int:
        """Registered hooks of ``event`` (all events when ``None``)."""
        events = HOOK_EVENTS if event is None else (event,)
        return sum(len(self._hooks[e]) for e in events)

    def scope(self) -> HookScope:
        """A ``with`` block whose registrations are all removed when it exits, on every path."""
        return HookScope(self)


class HookScope:
    """Registers on a registry and remembers what it registered, to remove it all on exit."""

    def __init__(self, registry: HookRegistry) -> None:
        self.registry = registry
        self._handles: list[HookHandle] = []

    def register(self, event: str, fn: HookFn, *, once: bool = False) -> HookHandle:
        handle = self.registry.register(event, fn, once=once)
        self._handles.append(handle)
        return handle

    def remove_all(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> HookScope:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove_all()

"""The SGLang plugin's switches: the environment variables it reads, all of them here.

``MOE_SBO_SGLANG``: ``1`` switches the plugin on; unset, empty or ``0`` leaves SGLang untouched (the
entry point then registers nothing). ``MOE_SBO_SGLANG_DISPATCHER``: ``deep_ep`` (default), SGLang's own
``DeepEPDispatcher`` on ``moe_sbo.deep_ep.Buffer``; or ``moe_sbo``, moe-sbo's dispatcher class
(``dispatcher.py``), whose DeepEP formats come from the same buffer and whose hooks fire at moe-sbo's
six events. ``MOE_SBO_SGLANG_OVERLAP``: with ``moe_sbo``, where the shared experts run (moe-sbo's SBO
modes ``none``, ``dispatch``, ``combine``, ``combine_sm``); unset, SGLang places them itself.

The hard part is that every rank must read the same values: set them in the environment of the
``python -m sglang.launch_server`` command, which every scheduler process inherits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DISPATCHERS: tuple[str, ...] = ("deep_ep", "moe_sbo")
# moe-sbo's fixed SBO modes that can place SGLang's shared-expert work: ``split`` needs the shared
# experts as two projections, and SGLang's model hands them over as one call.
OVERLAP_MODES: tuple[str, ...] = ("none", "dispatch", "combine", "combine_sm")


@dataclass(frozen=True)
class Settings:
    """``enabled``: the plugin is on; ``dispatcher``: one of ``DISPATCHERS``; ``overlap``: one of
    ``OVERLAP_MODES`` or None (SGLang's own placement of the shared experts)."""

    enabled: bool = False
    dispatcher: str = "deep_ep"
    overlap: str | None = None

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"MOE_SBO_SGLANG_DISPATCHER must be one of {DISPATCHERS}, got {self.dispatcher!r}; "
                "unset it for deep_ep (SGLang's DeepEP dispatcher on moe-sbo's Buffer)"
            )
        if self.overlap is not None and self.overlap not in OVERLAP_MODES:
            hint = " (split needs the shared experts' two projections apart)" if self.overlap == "split" else ""
            raise ValueError(f"MOE_SBO_SGLANG_OVERLAP must be one of {OVERLAP_MODES}, got {self.overlap!r}{hint}")
        if self.overlap is not None and self.dispatcher != "moe_sbo":
            raise ValueError(
                f"MOE_SBO_SGLANG_OVERLAP={self.overlap} needs MOE_SBO_SGLANG_DISPATCHER=moe_sbo (SGLang's own "
                "DeepEP dispatcher places the shared experts by SGLang's rules); set it, or unset the overlap"
            )


def from_environ(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``environ`` (default: this process's environment) gives."""
    environ = os.environ if environ is None else environ
    switch = environ.get("MOE_SBO_SGLANG", "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"MOE_SBO_SGLANG must be 1 (on) or 0 / unset (off), got {switch!r}")
    return Settings(
        enabled=switch == "1",
        dispatcher=environ.get("MOE_SBO_SGLANG_DISPATCHER", "").strip() or "deep_ep",
        overlap=environ.get("MOE_SBO_SGLANG_OVERLAP", "").strip() or None,
    )

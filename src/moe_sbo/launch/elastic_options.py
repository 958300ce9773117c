"""What elastic expert parallelism is told and what it tells: the policy (``ElasticOptions``), the
errors a loss can end in (``RankFenced``, ``ExpertsLost``) and the record of one recovery
(``Recovery``). The group (``elastic.py``) and the layers (``elastic_layer.py``) both use them;
``elastic.py`` re-exports them.

The hard part is the timing knobs: a rank whose heartbeat stays unchanged for ``dead_after_s`` is
declared dead, so that bound must exceed two heartbeats or a live rank would be; ``ElasticOptions``
checks the knobs when it is made, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..eplb.runtime import EPLBOptions


@dataclass(frozen=True)
class ElasticOptions:
    """How a group and its layers survive the loss of a rank.

    ``spare_slots_per_rank``: expert slots per rank beyond E / P, the layer's EPLB redundant slots
    (``eplb()`` builds its options): replicas while all ranks live, the room the experts of a lost
    rank are restored into. After the loss of one of P ranks the survivors hold every expert again
    when ``(P - 1) * (E / P + spare) >= E``. ``degraded``: serve with the experts that have no live
    replica masked until they are restored (False: restore before the in-flight forward is re-run,
    or raise ``ExpertsLost``). ``restore``: restore right after the re-run (False: the caller calls
    ``ElasticMoE.restore`` on every rank, between forwards).

    ``heartbeat_s``: how often each rank bumps its heartbeat; ``dead_after_s``: a heartbeat unchanged
    this long marks a rank dead (a launcher that sees the process end says so at once);
    ``agree_s``: how long survivors wait for a member that is alive to check in before they declare it
    lost (a stalled rank; a rank that wakes up later is fenced off).
    """

    spare_slots_per_rank: int = 1
    degraded: bool = True
    restore: bool = True
    heartbeat_s: float = 0.1
    dead_after_s: float = 3.0
    agree_s: float = 5.0

    def __post_init__(self) -> None:
        if self.spare_slots_per_rank < 0:
            raise ValueError(f"spare_slots_per_rank must be >= 0, got {self.spare_slots_per_rank}")
        for name in ("heartbeat_s", "dead_after_s", "agree_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.dead_after_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"dead_after_s must exceed two heartbeats ({2 * self.heartbeat_s:g} s), got {self.dead_after_s}; "
                "a live rank would be declared dead"
            )

    def eplb(self, **options: Any) -> EPLBOptions:
        """The EPLB options of a layer under this policy: ``spare_slots_per_rank`` redundant slots."""
        return EPLBOptions(redundant_per_rank=self.spare_slots_per_rank, **options)


class RankFenced(RuntimeError):
    """This rank was declared lost (dead or stalled past the bound) and the others went on without
    it: it must not touch the group again. Its process should exit; a fresh process can join."""


class ExpertsLost(RuntimeError):
    """Experts have no live replica and cannot be restored (no spare slot or no source), and the
    policy does not allow serving degraded (``ElasticOptions.degraded``)."""


@dataclass(frozen=True)
class Recovery:
    """One loss, as this rank lived it.

    ``lost``: the member ids the survivors agreed on; ``epoch``: the new group's; ``members``: its
    members in rank order. ``t_detect_ms``: from this rank's failed collective to the decision;
    ``t_reform_ms``: joining the new group and rebuilding the layers; ``t_rerun_ms``: the forward in
    flight, re-run degraded; ``t_restore_ms``: restoring (0 when nothing was restored). ``reran``:
    this rank's forward was re-run (False: it had finished it and took part with no tokens).
    ``degraded_tokens``: this rank's tokens of the re-run that lost an expert (masked).
    ``missing_experts``: experts that had no live replica after the loss; ``restored_from``:
    ``replica`` (none was missing), ``checkpoint`` (read from the source) or ``none`` (still degraded).
    The lost members' own tokens were never here: their callers must re-submit them.
    """

    lost: tuple[int, ...]
    epoch: int
    members: tuple[int, ...]
    t_detect_ms: float
    t_reform_ms: float
    t_rerun_ms: float
    t_restore_ms: float
    reran: bool
    degraded_tokens: int
    missing_experts: tuple[int, ...]
    restored_from: str

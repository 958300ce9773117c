"""How a call on the local ranks failed: each rank's failure (``RankFailure``), the error the launcher
raises (``RankError``) and its message.

The hard part is naming the culprit. A rank that raises or dies makes its peers fail too, on a closed
connection or an expired wait, so the message puts a dead rank first, then ranks that raised, by time;
and when every failure is an expired wait, the ranks still running are the stalled ones.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed a call: ``kind`` is ``raised`` (``cause`` is the exception's type and
    message, ``details`` its traceback) or ``died`` (the process ended: ``cause`` gives its exit code or signal).
    ``failed_at``: wall-clock time the rank raised, or the launcher saw it dead. ``phase``: the
    dispatcher phase it was in (``profiling.describe_phase``: ``in dispatch_wait``, ``after
    combine_wait``; empty outside any)."""

    rank: int
    kind: str
    cause: str
    details: str
    failed_at: float
    phase: str = ""

    @property
    def gave_up_waiting(self) -> bool:
        """Whether this looks like a bounded wait on a peer that ran out (the peer is at fault): a
        timeout (gloo, NCCL), a symmetric-memory barrier's trap, or a death by SIGABRT (how NCCL's
        watchdog ends a process whose collective outlived the bound)."""
        if self.kind == "died":
            return "SIGABRT" in self.cause
        return bool(WAIT_EXPIRED.search(self.cause))


# What a rank's error says when its bounded wait for a peer ran out: gloo's and NCCL's timeouts; a
# symmetric-memory barrier's trap (its own line, or the CUDA error the next synchronising call raises).
WAIT_EXPIRED = re.compile(
    r"timed out|timeout|failed to (send|receive) signal|unspecified launch failure|illegal instruction",
    re.IGNORECASE,
)


class RankError(RuntimeError):
    """One or more ranks failed a call; the message names the first and holds each one's traceback.

    ``failures``: first failure first (a dead rank before ranks that raised: a peer's death makes the
    others fail on a closed connection, not the other way round; then by when each rank raised).
    ``stopped_ranks``: ranks the launcher stopped because they were still running after the grace
    period (or the call's deadline), most likely waiting in a collective. ``stalled_ranks``: of
    those, the ones the others gave up waiting for (every failure was an expired wait: the ranks
    still running are the cause). ``phases``: each rank's dispatcher phase when the call ended
    (``profiling.describe_phase``; empty when unknown).
    """

    def __init__(
        self,
        message: str,
        failures: tuple[RankFailure, ...] = (),
        stopped_ranks: tuple[int, ...] = (),
        *,
        stalled_ranks: tuple[int, ...] = (),
        phases: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.failures = failures
        self.stopped_ranks = stopped_ranks
        self.stalled_ranks = stalled_ranks
        self.phases = phases

    @property
    def first(self) -> RankFailure | None:
        """The failure that most likely caused the others (``None`` when ranks only timed out)."""
        return self.failures[0] if self.failures else None


def exit_cause(exitcode: int | None) -> str:
    if exitcode is None:
        return "process ended (exit code unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"process killed by signal {-exitcode} ({name})"
    return f"process exited with code {exitcode} without answering"


def error_message(
    what: str,
    failures: tuple[RankFailure, ...],
    stopped: tuple[int, ...],
    stalled: tuple[int, ...],
    phases: tuple[str, ...],
    elapsed_s: float,
    grace_s: float,
    bound_s: float,
) -> str:
    first = failures[0]
    verb = "died" if first.kind == "died" else "raised"
    failed = sorted(f.rank for f in failures)
    if stalled:
        lines = [
            f"{what}: ranks {list(stalled)} stalled: ranks {failed} gave up waiting for them (wait bound "
            f"{bound_s:g} s, MOE_SBO_TIMEOUT_S); first rank {first.rank} {verb}: {first.cause}",
            f"ranks {list(stalled)} were still running {grace_s:g} s later and were stopped; the call ended "
            f"{elapsed_s:.1f} s after it began, and the ranks start again at the next call",
        ]
    else:
        lines = [f"{what} failed on ranks {failed}: first rank {first.rank} {verb}: {first.cause}"]
        if stopped:
            lines.append(
                f"ranks {list(stopped)} were still running {grace_s:g} s after that failure (most likely "
                f"waiting in a collective for rank {first.rank}) and were stopped; the call ended "
                f"{elapsed_s:.1f} s after it began, and the ranks start again at the next call"
            )
    where = [f"rank {rank} {phase}" for rank, phase in enumerate(phases) if phase]
    if where:
        lines.append("dispatcher phases when the call ended: " + ", ".join(where))
    for failure in failures:
        lines.append(f"--- rank {failure.rank} ({failure.kind}) ---\n{failure.details or failure.cause}")
    return "\n".join(lines)

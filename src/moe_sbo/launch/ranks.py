"""Ranks and devices: start N local ranks (gloo on CPU, NCCL on GPUs; more ranks than GPUs share them
round-robin in a gloo group, ``group.py``), or join a torchrun job.

The hard part is failure. A rank that raises leaves the others blocked in a collective until the
collective timeout; a rank whose process dies leaves them blocked, or failing on a closed socket.
``LocalRanks.run`` therefore watches the answers *and* the processes. At the first failed answer or
dead process it gives the other ranks a short grace period (``failure_grace_s``) to answer, since
ranks that all reject the same bad input answer at once, then stops those still running: they are
waiting for the failed rank and could only time out. ``RankError`` names the first failing rank and
its cause. A failed call may leave half a collective behind in the group, so the next ``run`` starts
the ranks again (a fresh group on a fresh port). CPU ranks are forked from a server process that
imported torch once (``workers.py``: the rank processes), so a restart costs a fraction of a second,
not a torch import per rank.

``LocalRanks`` keeps its worker processes (and their process group) alive between calls: tests and
the demo pay the start-up (forming the group) once, not per check.

A rank that is alive but stuck (a stalled peer) is ended by the wait bound instead: every wait on a
peer is bounded by ``MOE_SBO_TIMEOUT_S`` (default 25 s; ``env.py``): the process group's timeout, the
symmetric-memory barriers (``dispatch/low_latency/transport.py``), and on GPUs NCCL's watchdog, set to abort
the communicator and end the process when a collective outlives the bound. The ranks that gave up
waiting fail; the launcher then names the ranks still running as stalled. Each rank writes the
dispatcher phase it is in into memory the launcher shares (``profiling.record_phases_into``), so the
report says where every rank was, even one that is blocked or dead.

Environment variables are read in ``env.py``: ``MOE_SBO_TIMEOUT_S`` and torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` (``MASTER_ADDR``, ``MASTER_PORT``: by torch.distributed).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.queues import Queue
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist

from .. import env, profiling
from .elastic import PREFIX as ELASTIC_PREFIX
from .elastic import DecisionWatch, ElasticJoin, ElasticOptions
from .failures import RankError, RankFailure, error_message, exit_cause
from .group import free_port, ranks_per_gpu, resolve_device
from .signals import signals_deferred
from .workers import drain, dumps, worker, worker_context

POLL_S = 0.05  # how often the launcher looks at the processes while it waits for answers
MAX_ADDED_RANKS = 64  # elastic: processes one LocalRanks may add (each has its phase slot)
# Elastic: how long a process the survivors declared lost may go without answering before the launcher
# kills it. A stalled rank that wakes answers at once (``RankFenced``); one frozen for good would hold
# the call until its bound, and the bound stops every rank.
FENCE_GRACE_S = 10.0


class LocalRanks:
    """``world_size`` local processes in one process group, running functions on request.

    ``run(fn, *args)`` calls ``fn(device, *args)`` on every rank (``fn`` must be importable by
    name: a module-level function) and returns the results in rank order, or raises ``RankError``.

    ``timeout_s``: the most one call may take before every rank is stopped (default: twice the
    collective timeout plus a minute). ``collective_timeout_s``: each rank's wait bound (default
    ``MOE_SBO_TIMEOUT_S``), set in each rank's environment so its collectives, symmetric-memory
    barriers and NCCL watchdog all use it; with fail-fast it only matters for a rank that is alive but
    never arrives (stalled), or where the launcher cannot see a death (torchrun).
    ``failure_grace_s``: how long the other ranks may still answer after the first failure before they
    are stopped. ``environ``: variables set in every rank's environment (not the launcher's) before
    the ranks join, e.g. ``{"NCCL_P2P_DISABLE": "1"}``.

    ``elastic``: the ranks form an elastic group (``launch/elastic.py``) on a store this launcher
    hosts, so that no rank's death takes it down. A rank that dies or fails no longer ends the call:
    ``run`` collects the answers of the ranks still alive, gives a ``RankFailure`` in the place of
    each rank that died or raised (a dead rank is told to the others through the store at once, and
    gets no more calls), and ``add_rank`` starts a replacement that joins the group.
    """

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        timeout_s: float | None = None,
        *,
        collective_timeout_s: float | None = None,
        failure_grace_s: float = 1.0,
        environ: dict[str, str] | None = None,
        elastic: ElasticOptions | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        env.check(world_size, {**os.environ, **(environ or {})})  # here, not as a failure in every rank
        self.device = resolve_device(device)
        self.world_size = world_size
        # Ranks go round-robin over the visible GPUs; more ranks than GPUs share them (gloo group).
        self.ranks_per_gpu = ranks_per_gpu(world_size, torch.cuda.device_count()) if self.device == "cuda" else 1
        self.collective_timeout_s = (
            collective_timeout_s if collective_timeout_s is not None else env.collective_timeout_s()
        )
        self.timeout_s = timeout_s if timeout_s is not None else 2 * self.collective_timeout_s + 60
        if failure_grace_s < 0:
            raise ValueError(f"failure_grace_s must be >= 0, got {failure_grace_s}")
        self.failure_grace_s = failure_grace_s
        self.environ = dict(environ or {})
        self.starts = 0  # how many times the ranks were started (1 + restarts after failed calls)
        self._ctx = worker_context(self.device)
        self._procs: list = []
        self._tasks: list = []
        self._results: Queue[Any] | None = None
        self._answer_queues: list[Queue[Any]] = []
        self._phase_slots: Any = None  # two shared bytes per rank: its dispatcher phase (profiling)
        self._call = 0
        self._closed = False
        self.elastic = elastic
        self._store: Any = None  # elastic: the store this launcher hosts
        self._watch = DecisionWatch(set())  # elastic: the group's decisions, as the launcher reads them
        self._members: list[int] = []  # elastic: each process's member id
        self._alive: set[int] = set()  # elastic: processes (by index) still running
        try:
            self._start()
        except BaseException:  # an interrupt during start-up too: no rank outlives a failed constructor
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids (empty while stopped after a failed call)."""
        return [proc.pid for proc in self._procs]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(device, *args, **kwargs)`` on every rank; the results in rank order.

        Sync: the host blocks until every rank answered, or until the first failure plus
        ``failure_grace_s`` (then ``RankError``), or ``timeout_s``.
        """
        if self._closed:
            raise RuntimeError("this LocalRanks was closed; make a new one")
        self._call += 1
        try:
            # Pickled here, once per rank (a tensor argument shares its memory with one reader only),
            # so an unpicklable fn or argument is refused before any rank starts working.
            payloads = [dumps((fn, args, kwargs)) for _ in range(self.world_size)]
        except Exception as err:
            raise TypeError(
                f"fn and its arguments must be picklable (a module-level function, plain values and tensors), "
                f"got {getattr(fn, '__qualname__', fn)!r}: {err}"
            ) from err
        if not self._procs:
            self._start()
        if self.elastic is not None:
            return self._run_elastic(payloads[0], getattr(fn, "__name__", str(fn)))
        for tasks, payload in zip(self._tasks, payloads):
            tasks.put((self._call, payload))
        return self._collect(self._call, getattr(fn, "__name__", str(fn)))

    def _start(self) -> None:
        """Start the ranks and wait for all to join the group; once more if the port was taken meanwhile."""
        for attempt in range(2):
            try:
                self._start_once()
                return
            except RankError as err:
                # free_port releases the port before rank 0 binds it again: another process may win.
                if attempt or "address already in use" not in str(err).lower():
                    raise

    def _start_once(self) -> None:
        self.starts += 1
        self._results = self._ctx.Queue()  # fresh queues: a stopped rank may have left one half-written
        # Elastic: a queue per rank. A rank killed while its queue's feeder holds the shared write lock
        # would keep it forever, and every other rank's answers would wait behind it.
        self._answer_queues = [self._ctx.Queue() for _ in range(self.world_size)] if self.elastic else []
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._phase_slots = self._ctx.RawArray("B", 2 * (self.world_size + MAX_ADDED_RANKS))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        joins: list[ElasticJoin | None] = [None] * self.world_size
        if self.elastic is not None:
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            members = tuple(range(self.world_size))
            joins = [ElasticJoin("127.0.0.1", self._store.port, self.elastic, r, members) for r in members]
            self._members, self._alive = list(members), set(members)
            self._watch = DecisionWatch(set(members))
        self._procs = [
            self._ctx.Process(
                target=worker,
                args=(
                    r,
                    self.world_size,
                    init_method,
                    self.device,
                    self.collective_timeout_s,
                    self._tasks[r],
                    self._answer_queues[r] if self.elastic else self._results,
                    self._phase_slots,
                    self.environ,
                    joins[r],
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        with signals_deferred():  # an interrupt here would leave a rank forked but unknown to us
            for proc in self._procs:
                proc.start()
        self._collect(0, "start-up")

    def _collect(self, call: int, what: str) -> list[Any]:
        started = time.monotonic()
        started_wall = time.time()  # failures carry wall-clock times (a rank's clock is the host's)
        deadline = started + self.timeout_s
        values: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        first_failure_at: float | None = None
        while len(values) + len(failures) < self.world_size:
            now = time.monotonic()
            if now >= deadline or (first_failure_at is not None and now >= first_failure_at + self.failure_grace_s):
                break
            for answer in self._answers():
                self._book(call, answer, values, failures)
            for rank, proc in enumerate(self._procs):
                if rank not in values and rank not in failures and not proc.is_alive():
                    failures[rank] = RankFailure(rank, "died", exit_cause(proc.exitcode), "", time.time())
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
        if not failures and len(values) == self.world_size:
            return [values[r] for r in range(self.world_size)]

        pending = tuple(r for r in range(self.world_size) if r not in values and r not in failures)
        phases = self._phases()  # before the stop: where each rank is while it still waits
        self._stop()  # a failed call may leave half a collective in the group: start afresh next time
        elapsed_s = time.monotonic() - started
        if not failures:
            raise RankError(
                f"{what}: ranks {list(pending)} did not answer within {self.timeout_s:.0f} s and no rank "
                f"failed (a rank is stuck outside any collective, or the work outlasts timeout_s); "
                f"every rank was stopped",
                (),
                pending,
                phases=phases,
            )
        for rank, failure in failures.items():  # a dead rank could not say where it was; its slot can
            if failure.kind == "died" and not failure.phase:
                failures[rank] = replace(failure, phase=phases[rank])
        ordered = tuple(sorted(failures.values(), key=lambda f: (f.kind != "died", f.failed_at)))
        # A wait cannot run out before the bound has passed since the call began: an earlier "timeout"
        # or SIGABRT is this rank's own failure, and the ranks still running are waiting for it.
        expired = [
            f.gave_up_waiting and f.failed_at - started_wall >= 0.99 * self.collective_timeout_s for f in ordered
        ]
        stalled = pending if all(expired) else ()
        message = error_message(
            what, ordered, pending, stalled, phases, elapsed_s, self.failure_grace_s, self.collective_timeout_s
        )
        raise RankError(message, ordered, pending, stalled_ranks=stalled, phases=phases)

    # ---- elastic ------------------------------------------------------------------------------------

    def _run_elastic(self, payload: bytes, what: str) -> list[Any]:
        """One call on every live process; a ``RankFailure`` in the place of each that died or raised
        (and of each that had died before)."""
        expected = sorted(self._alive)
        for index in expected:
            self._tasks[index].put((self._call, payload))
        deadline = time.monotonic() + self.timeout_s
        values: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        while len(values) + len(failures) < len(expected):
            if time.monotonic() >= deadline:
                pending = [i for i in expected if i not in values and i not in failures]
                self._stop()
                raise RankError(
                    f"{what}: ranks {pending} did not answer within {self.timeout_s:.0f} s (elastic); every rank "
                    "was stopped",
                    tuple(failures.values()),
                    tuple(pending),
                )
            for answer in self._answers():
                self._book(self._call, answer, values, failures)
            self._fence_declared_lost(values, failures)
            self._notice_deaths(values, failures)
        return [
            values[i] if i in values else failures.get(i) or RankFailure(i, "died", "lost before this call", "", 0.0)
            for i in range(len(self._procs))
        ]

    def _fence_declared_lost(self, values: dict[int, Any], failures: dict[int, RankFailure]) -> None:
        """Kill a process the survivors declared lost that has not answered ``FENCE_GRACE_S`` after
        (``_notice_deaths`` then books it as died)."""
        now = time.monotonic()
        for member, since in self._watch.lost(self._store, now).items():
            index = self._members.index(member)
            silent = index in self._alive and index not in values and index not in failures
            if silent and now - since > FENCE_GRACE_S and self._procs[index].is_alive():
                self._procs[index].kill()

    def _notice_deaths(self, values: dict[int, Any], failures: dict[int, RankFailure]) -> None:
        """Processes that ended: marked dead in the store (the survivors need not wait for a heartbeat)."""
        for index in sorted(self._alive):
            proc = self._procs[index]
            if not proc.is_alive():
                for answer in drain(self._answer_queues[index]):  # its last answer, if it gave one
                    self._book(self._call, answer, values, failures)
                self._alive.discard(index)
                for q in (self._tasks[index], self._answer_queues[index]):
                    q.cancel_join_thread()
                    q.close()
                self._store.set(f"{ELASTIC_PREFIX}/dead/{self._members[index]}", "1")
                if index not in failures and index not in values:
                    failures[index] = RankFailure(index, "died", exit_cause(proc.exitcode), "", time.time())

    def add_rank(self) -> int:
        """Elastic: start one more process, outside the group until the members admit it (its function
        calls ``ElasticGroup.join``, theirs ``ElasticGroup.admit``). Returns its index in ``run``'s list."""
        if self.elastic is None or self._results is None:
            raise ValueError("add_rank needs running ranks started with LocalRanks(..., elastic=ElasticOptions())")
        index = len(self._procs)
        if index >= self.world_size + MAX_ADDED_RANKS:
            raise ValueError(f"at most {MAX_ADDED_RANKS} ranks can be added to one LocalRanks; make a new one")
        member = max(self._members) + 1
        how = ElasticJoin("127.0.0.1", self._store.port, self.elastic, member, ())
        tasks, answers = self._ctx.Queue(), self._ctx.Queue()
        proc = self._ctx.Process(
            target=worker,
            args=(index, self.world_size, "", self.device, self.collective_timeout_s, tasks, answers),
            kwargs={"phase_slots": self._phase_slots, "environ": self.environ, "elastic": how},
            daemon=True,
        )
        with signals_deferred():
            proc.start()
        self._procs.append(proc)
        self._tasks.append(tasks)
        self._answer_queues.append(answers)
        self._members.append(member)
        self._alive.add(index)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for answer in self._answers():
                call, rank, ok, payload, _ = answer
                if call == 0 and rank == index:
                    if not ok:
                        raise RankError(f"the added rank failed to start: {payload[0]}", ())
                    return index
            if not proc.is_alive():
                raise RankError(f"the added rank died at start: {exit_cause(proc.exitcode)}", ())
        raise RankError(f"the added rank did not start within {self.timeout_s:.0f} s", ())

    def _phases(self) -> tuple[str, ...]:
        """Each rank's dispatcher phase, read from the memory it shares with the launcher."""
        if self._phase_slots is None:
            return ("",) * self.world_size
        slots = bytes(self._phase_slots)
        return tuple(profiling.describe_phase(slots[2 * r : 2 * r + 2]) for r in range(self.world_size))

    def _answers(self) -> list[tuple]:
        """Answers that arrive within ``POLL_S``, and every one queued behind them."""
        if self._results is None:
            raise RuntimeError("the ranks are stopped, so there are no answers to read; start them first")
        answers: list[tuple] = []
        if self.elastic is not None:
            for index in sorted(self._alive):
                answers += drain(self._answer_queues[index])
            if not answers:
                time.sleep(POLL_S)
            return answers
        try:
            answers.append(self._results.get(timeout=POLL_S))
            while True:  # drain, so that a rank's answer is booked before its process is seen dead
                answers.append(self._results.get_nowait())
        except queue.Empty:
            pass
        except (EOFError, OSError):  # the queue's pipe broke under a rank that died while writing
            pass
        return answers

    def _book(self, call: int, answer: tuple, values: dict, failures: dict) -> None:
        """File one answer of ``call`` (answers of an earlier, abandoned call are dropped)."""
        answer_call, rank, ok, payload, failed_at = answer
        if answer_call != call:
            return
        if not ok:
            cause, details, phase = payload
            failures[rank] = RankFailure(rank, "raised", cause, details, failed_at, phase)
            return
        try:
            values[rank] = ForkingPickler.loads(payload)
        except Exception as exc:  # noqa: BLE001 - e.g. a class the launcher cannot import
            failures[rank] = RankFailure(
                rank, "raised", f"its answer could not be unpickled: {exc!r}", traceback.format_exc(), time.time()
            )

    def _stop(self) -> None:
        """Stop every rank now (they may be blocked in a collective, so no polite shutdown)."""
        started = [proc for proc in self._procs if proc.pid is not None]  # interrupted start-ups leave some unstarted
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._close_queues()
        self._procs = []
        self._alive = set()
        self._store = None  # elastic: the store goes with the ranks

    def _close_queues(self) -> None:
        for q in (*self._tasks, *self._answer_queues, self._results):
            if q is not None:
                q.cancel_join_thread()  # never block on a pipe no one will read again
                q.close()
        self._tasks, self._answer_queues, self._results = [], [], None

    def close(self) -> None:
        """Ask every rank to leave the group and exit; stop those that do not within 10 s."""
        self._closed = True
        for tasks, proc in zip(self._tasks, self._procs):
            if proc.is_alive():
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
        self._stop()

    def stop(self) -> None:
        """Stop every rank now, busy or not, and close (on an interrupt: no polite shutdown to wait for)."""
        self._closed = True
        self._stop()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):  # KeyboardInterrupt, SystemExit
            self.stop()
        else:
            self.close()


class RankPool:
    """A ``LocalRanks`` started at the first call (sweeps make one per EP size and may never use it).

    After a failed call the ranks start again at the next one, as ``LocalRanks`` does.
    """

    def __init__(self, world_size: int, device: str, timeout_s: float = 900, environ: dict[str, str] | None = None):
        self.world_size, self.device, self.timeout_s, self.environ = world_size, device, timeout_s, environ
        self.ranks: LocalRanks | None = None

    def run(self, fn: Callable, *args) -> list:
        if self.ranks is None:
            self.ranks = LocalRanks(self.world_size, device=self.device, timeout_s=self.timeout_s, environ=self.environ)
        return self.ranks.run(fn, *args)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def stop(self) -> None:
        """Stop the ranks now (``LocalRanks.stop``)."""
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

"""The rank processes of ``LocalRanks`` (``ranks.py``): the loop each one runs (``worker``: join the
group, run pickled tasks, answer each), how they are started (``worker_context``), and reading the
answers a rank left behind (``drain``).

The hard part is that nothing a rank does may vanish. Tasks and answers are (un)pickled inside the
rank's ``try``, so a function it cannot import or a result that cannot be pickled comes back as its
failure, with the dispatcher phase it was in; a rank whose launcher died exits instead of waiting for
work; and a Ctrl-C belongs to the launcher, so the ranks and their fork server ignore it, and the
server is started with SIGINT blocked (``start_forkserver``) so that one landing then is not lost.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.queues import Queue
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist

from .. import profiling
from .elastic import ElasticJoin, RankFenced, join_elastic
from .elastic import session as elastic_session
from .group import join_group

# ---- the worker process --------------------------------------------------------------------------


def dumps(obj: Any) -> bytes:
    """Pickle as multiprocessing does (torch registers tensor sharing there), into plain bytes."""
    return bytes(ForkingPickler.dumps(obj))


def _failure(exc: BaseException) -> tuple[str, str, str]:
    """(cause: the exception's type and message, full traceback, dispatcher phase) of the exception
    being handled. The whole message: a CUDA error says what failed on its first line and advice on
    the next ones."""
    cause = "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__
    return cause[:500], traceback.format_exc(), profiling.current_phase()


def worker(
    rank: int,
    world_size: int,
    init_method: str,
    device: str,
    timeout_s: float,
    tasks: mp.Queue,
    results: mp.Queue,
    phase_slots: Any = None,
    environ: dict[str, str] | None = None,
    elastic: ElasticJoin | None = None,
) -> None:
    """One rank: join the group, then run pickled tasks until ``None`` or the launcher is gone.

    Tasks are ``(call, pickled (fn, args, kwargs))``; answers ``(call, rank, ok, payload, failed_at)``.
    Both are (un)pickled inside the ``try``, so a function this rank cannot import, or a value that
    cannot be pickled, is reported as this rank's failure instead of killing it or vanishing in the
    queue's feeder thread. ``phase_slots``: the launcher's shared bytes, two per rank, where this
    rank marks its dispatcher phase. ``environ``: set in this rank's environment before it joins
    (settings such as NCCL's, read when the communicator is made). ``elastic``: join through the
    launcher's store as a member of an elastic group (``elastic.join_elastic``); a rank that the
    others declared lost (``RankFenced``) answers, then exits.
    """
    # The launcher owns interruption: a Ctrl-C reaches every process of the terminal's group, and a
    # rank that raised KeyboardInterrupt mid-collective would only turn it into a rank failure; the
    # launcher stops the ranks itself (``LocalRanks.stop``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(environ or {})
    if phase_slots is not None:
        profiling.record_phases_into(memoryview(phase_slots).cast("B")[2 * rank : 2 * rank + 2])
    try:
        if device == "cpu":
            torch.set_num_threads(1)  # N ranks share the cores; more threads only contend
        if elastic is None:
            torch_device = join_group(
                device, rank, timeout_s, world_size, init_method=init_method, rank=rank, world_size=world_size
            )
        else:
            torch_device = join_elastic(device, rank, timeout_s, world_size, elastic)
    except BaseException as exc:  # noqa: BLE001 - report anything, the launcher decides
        results.put((0, rank, False, _failure(exc), time.time()))
        return
    results.put((0, rank, True, dumps("ready"), time.time()))
    parent = mp.parent_process()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                break  # the launcher died: nobody will send work or read answers, so do not linger
            continue
        if task is None:
            break
        call, payload = task
        profiling.clear_phase()
        # (call, rank, ok, payload, failed_at)
        answer: tuple[int, int, bool, bytes | tuple[str, str, str], float | None]
        try:
            fn, args, kwargs = ForkingPickler.loads(payload)  # here: a module this rank cannot import is its error
            answer = (call, rank, True, dumps(fn(torch_device, *args, **kwargs)), None)
        except BaseException as exc:  # noqa: BLE001 - includes SystemExit from fn, and pickling errors
            answer = (call, rank, False, _failure(exc), time.time())
            if isinstance(exc, RankFenced):
                results.put(answer)
                break
        results.put(answer)
    if dist.is_initialized():
        dist.destroy_process_group()
    if elastic is not None:
        elastic_session().close()


# ---- starting the processes, reading their answers -----------------------------------------------


def worker_context(device: str) -> mp.context.SpawnContext | mp.context.ForkServerContext:
    """CPU ranks are forked from a server that imported torch once; CUDA ranks are spawned.

    The server only imports: it never touches CUDA or threads, so forking from it is safe, and a CPU
    rank is ready in tens of milliseconds instead of the seconds a fresh ``import torch`` takes (which
    makes restarting after a failed call cheap). The server keeps the environment it started with;
    anything a rank needs is passed explicitly. CUDA ranks initialise CUDA themselves in a fresh
    process, as CUDA requires; there a restart costs seconds, and failures are rare.
    """
    if device == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # The preload list only counts before the server's first start (the first LocalRanks of a process).
    # forkserver_signals first: the server and its ranks ignore SIGINT (the launcher handles it).
    preload = [
        "moe_sbo.launch.forkserver_signals",
        "torch",
        "torch.distributed",
        "moe_sbo.launch.ranks",
        "moe_sbo.layer",
    ]
    ctx.set_forkserver_preload(preload)
    start_forkserver(ctx)
    return ctx


def start_forkserver(ctx: mp.context.ForkServerContext) -> None:
    """Start the fork server with SIGINT blocked for the instant of its fork and exec. The server
    inherits the mask, so a Ctrl-C reaching the group then waits in it until the preloaded
    ``forkserver_signals`` ignores SIGINT (which discards it) and unblocks it: no traceback from the
    server. The launcher keeps its own pending Ctrl-C and takes it when the mask is restored, so it is
    not lost (ignoring SIGINT for that instant lost it, and a command interrupted then ran on).

    multiprocessing's resource tracker is started first, outside the mask: ``forkserver.ensure_running``
    starts it when it is not running yet, and its start unblocks SIGINT and SIGTERM (``SIG_UNBLOCK``,
    not the mask it found), so inside the mask it would undo the block before the server is spawned."""
    from multiprocessing import forkserver, resource_tracker

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        forkserver.ensure_running()  # a thread's mask is its own; the main thread takes the signals
        return
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def drain(answers: Queue) -> list[tuple]:
    """Every answer waiting in ``answers`` now (none if its pipe broke under a rank that died writing)."""
    got: list[tuple] = []
    try:
        while True:
            got.append(answers.get_nowait())
    except (queue.Empty, EOFError, OSError, ValueError):
        pass
    return got

"""Ranks and devices: start N local ranks (gloo on CPU, NCCL on GPUs), or join a torchrun job.

The hard part is failure: a rank that raises leaves the others blocked in a collective. Every group
made here has a finite collective timeout, and ``LocalRanks.run`` waits for each rank's answer with
a deadline, so a failure ends the call with the failing rank's traceback instead of a hang.
``LocalRanks`` keeps its worker processes (and their process group) alive between calls: tests and
the demo pay the start-up (importing torch, forming the group) once, not per check.

Environment variables are read here and nowhere else: ``MOE_SBO_TIMEOUT_S`` (collective timeout,
default 60 s) and torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def collective_timeout_s() -> float:
    return float(os.environ.get("MOE_SBO_TIMEOUT_S", "60"))


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cpu``/``cuda`` checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but torch sees no GPU; use --device cpu")
    return device


def default_world_size(device: str) -> int:
    """Ranks the demo starts by default: every GPU, or 4 CPU ranks."""
    return torch.cuda.device_count() if device == "cuda" else 4


def _join_group(device: str, local_rank: int, **init_kwargs: Any) -> torch.device:
    """Pick this rank's device, then join the process group (NCCL on GPUs, gloo on CPU)."""
    if device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch_device = torch.device("cuda", torch.cuda.current_device())
        init_kwargs["device_id"] = torch_device  # binds the NCCL communicator to this GPU eagerly
    else:
        torch_device = torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=collective_timeout_s()), **init_kwargs)
    return torch_device


def _init_rank(rank: int, world_size: int, init_method: str, device: str) -> torch.device:
    if device == "cpu":
        torch.set_num_threads(1)  # N ranks share the cores; more threads only contend
    return _join_group(device, rank, init_method=init_method, rank=rank, world_size=world_size)


def init_from_torchrun(device: str = "auto") -> torch.device:
    """Join the job torchrun started (reads its environment); returns this rank's device."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("RANK/WORLD_SIZE are not set: start this under torchrun, or use LocalRanks")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return _join_group(resolve_device(device), int(os.environ.get("LOCAL_RANK", rank)),
                       rank=rank, world_size=world)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, init_method: str, device: str,
            tasks: mp.Queue, results: mp.Queue) -> None:
    try:
        torch_device = _init_rank(rank, world_size, init_method, device)
    except BaseException:  # noqa: BLE001 - report anything, the parent decides
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(torch_device, *args, **kwargs)))
        except BaseException:  # noqa: BLE001
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankError(RuntimeError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


class LocalRanks:
    """``world_size`` local processes in one process group, running functions on request.

    ``run(fn, *args)`` calls ``fn(device, *args)`` on every rank (``fn`` must be importable by
    name: a module-level function) and returns the results in rank order.
    """

    def __init__(self, world_size: int, device: str = "cpu", timeout_s: float | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.device = resolve_device(device)
        if self.device == "cuda" and world_size > torch.cuda.device_count():
            raise ValueError(
                f"world_size must be <= the {torch.cuda.device_count()} visible GPUs, got {world_size}; "
                "lower --ranks or use --device cpu"
            )
        self.world_size = world_size
        self.timeout_s = timeout_s if timeout_s is not None else 2 * collective_timeout_s() + 60
        ctx = mp.get_context("spawn")
        self._results: mp.Queue = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_method, self.device,
                                              self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        try:
            self._collect("start-up")
        except BaseException:
            self.close()
            raise

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", str(fn)))

    def _collect(self, what: str) -> list[Any]:
        answers: dict[int, tuple[bool, Any]] = {}
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close()
                raise RankError(
                    f"{what}: ranks {sorted(set(range(self.world_size)) - set(answers))} did not answer "
                    f"within {self.timeout_s:.0f} s (dead processes: {dead})"
                ) from None
            answers[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in answers.items() if not ok}
        if failed:
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise RankError(f"{what} failed on ranks {sorted(failed)}:\n{report}")
        return [answers[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for tasks, proc in zip(self._tasks, self._procs):
            if proc.is_alive():
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()

    def __enter__(self) -> "LocalRanks":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RankPool:
    """A ``LocalRanks`` pool that is started again after a failed call (its group may be broken)."""

    def __init__(self, world_size: int, device: str, timeout_s: float = 900):
        self.world_size, self.device, self.timeout_s = world_size, device, timeout_s
        self.ranks: LocalRanks | None = None

    def run(self, fn: Callable, *args) -> list:
        if self.ranks is None:
            self.ranks = LocalRanks(self.world_size, device=self.device, timeout_s=self.timeout_s)
        try:
            return self.ranks.run(fn, *args)
        except RankError:
            self.close()
            raise

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

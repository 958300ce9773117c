"""Every environment variable the library reads, in one place.

The hard part is that ranks must agree: a variable that changes a collective's shape or a
transport's choice has to read the same on every rank, so each reader here documents who sets it
(the user, torchrun, or Triton's test mode) and what it may change.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

# The wait bound's default: a dead or stalled peer is reported by every survivor within it plus the
# second or so that detecting and reporting takes (NCCL's watchdog polls, a trapped kernel surfaces at
# the next sync), so 25 s keeps the report under 30 s.
DEFAULT_TIMEOUT_S = 25.0


def collective_timeout_s() -> float:
    """``MOE_SBO_TIMEOUT_S`` (default 25): the wait bound, seconds a rank waits for its peers in one
    collective (the process group's timeout) or one symmetric-memory barrier before it fails."""
    return _timeout_s(os.environ)


def _timeout_s(environ: Mapping[str, str]) -> float:
    value = environ.get("MOE_SBO_TIMEOUT_S", f"{DEFAULT_TIMEOUT_S:g}")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(
            f"MOE_SBO_TIMEOUT_S must be a finite number of seconds > 0, got {value!r}; "
            f"set it to e.g. {DEFAULT_TIMEOUT_S:g}, or unset it for the default ({DEFAULT_TIMEOUT_S:g} s)"
        )
    return seconds


def set_collective_timeout_s(seconds: float) -> None:
    """Make ``seconds`` this process's wait bound: a launcher hands its ranks the bound it was given
    (``LocalRanks(collective_timeout_s=)``), and every reader in the rank then sees the same value."""
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"the wait bound must be a finite number of seconds > 0, got {seconds!r}")
    os.environ["MOE_SBO_TIMEOUT_S"] = repr(float(seconds))


def nccl_error_handling(timeout_s: float) -> dict[str, str]:
    """PyTorch's NCCL settings that turn a collective waiting past ``timeout_s`` into a bounded failure.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (tear down): the watchdog thread logs the timed-out collective,
    aborts the communicator, then ends the process (PyTorch's own default, 3, ends it without the
    abort; torchrun sets 1 too). ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: if the watchdog itself hangs (in
    the abort, say), its monitor ends the process after this long (PyTorch's default is 480 s).
    ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (the wait for the debug-info dump after a report, 15 s)
    is left to PyTorch: shortened to 2 s, NCCL's heartbeat monitor ended a *stalled* rank ~2 s after
    its peer's report, before the survivors' own errors, so the launcher could no longer name the
    stalled rank as the cause (measured on GPUs, docs/RELIABILITY.md §9).
    Blocking wait (``TORCH_NCCL_BLOCKING_WAIT``) stays off: it would make the host wait for every
    collective.
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(10, math.ceil(timeout_s))),
    }


def configure_nccl_error_handling(timeout_s: float) -> dict[str, str]:
    """Set ``nccl_error_handling(timeout_s)`` in this process's environment before its NCCL process group
    is made (PyTorch reads them then). A variable the user set keeps the user's value. Returns what is
    in force."""
    return {name: os.environ.setdefault(name, value) for name, value in nccl_error_handling(timeout_s).items()}


def triton_interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels in its CPU interpreter (the CPU tests use it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _whole_number(environ: Mapping[str, str], name: str, minimum: int, fix: str) -> int | None:
    """``name`` as a whole number >= ``minimum``, None when it is not set; else a ValueError that
    names it, its rule and ``fix``."""
    value = environ.get(name)
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}; {fix}")
    return int(value.strip())


_TORCHRUN_FIX = "torchrun sets it; outside torchrun, unset it"


def torchrun_rank() -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as torchrun sets them, or None outside torchrun."""
    return _torchrun_rank(os.environ)


def _torchrun_rank(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    rank = _whole_number(environ, "RANK", 0, _TORCHRUN_FIX)
    world = _whole_number(environ, "WORLD_SIZE", 1, _TORCHRUN_FIX)
    local_rank = _whole_number(environ, "LOCAL_RANK", 0, _TORCHRUN_FIX)
    if rank is None or world is None:
        return None
    if rank >= world:
        raise ValueError(f"RANK must be < WORLD_SIZE ({world}), got {rank}; {_TORCHRUN_FIX}")
    return rank, world, rank if local_rank is None else local_rank


def local_world_size(default: int) -> int:
    """``LOCAL_WORLD_SIZE`` (torchrun: ranks on this node), or ``default`` when it is not set."""
    local = _whole_number(os.environ, "LOCAL_WORLD_SIZE", 1, _TORCHRUN_FIX)
    return default if local is None else local


def ranks_per_node(world_size: int) -> int | None:
    """``MOE_SBO_RANKS_PER_NODE`` (set by the user, e.g. to let one host act as several nodes), else
    torchrun's ``LOCAL_WORLD_SIZE`` when it divides ``world_size`` into more than one node; None: one
    node holds every rank. Every rank must read the same value."""
    return _ranks_per_node(os.environ, world_size, divides=False)


def _ranks_per_node(environ: Mapping[str, str], world_size: int, *, divides: bool) -> int | None:
    """``ranks_per_node``; ``divides``: also refuse a ``MOE_SBO_RANKS_PER_NODE`` that does not divide
    ``world_size`` (``EPGroup`` refuses it for the group it is given)."""
    value = environ.get("MOE_SBO_RANKS_PER_NODE")
    if value is not None:
        fix = "set it to the ranks of one node, or unset it (one node holds every rank)"
        if not divides:
            return _whole_number(environ, "MOE_SBO_RANKS_PER_NODE", 1, fix)
        divisors = [str(d) for d in range(1, world_size + 1) if world_size % d == 0]
        allowed = ", ".join(divisors[:-1]) + " or " + divisors[-1] if len(divisors) > 1 else "".join(divisors)
        stripped = value.strip()
        if not re.fullmatch(r"[0-9]+", stripped) or int(stripped) < 1 or world_size % int(stripped):
            raise ValueError(
                f"MOE_SBO_RANKS_PER_NODE must be a whole number that divides the {world_size} ranks "
                f"({allowed}), got {value!r}; {fix}"
            )
        return int(stripped)
    local = _whole_number(environ, "LOCAL_WORLD_SIZE", 1, _TORCHRUN_FIX)
    local = world_size if local is None else local
    return local if 0 < local < world_size and world_size % local == 0 else None


def nccl_max_ctas() -> int | None:
    """``NCCL_MAX_CTAS`` (NCCL's cap on the CTAs one NCCL operation runs), None when unset or empty."""
    return _nccl_max_ctas(os.environ)


def _nccl_max_ctas(environ: Mapping[str, str]) -> int | None:
    if not environ.get("NCCL_MAX_CTAS", "").strip():
        return None
    return _whole_number(environ, "NCCL_MAX_CTAS", 1, "set it to the CTAs NCCL may use, or unset it")


def check(world_size: int | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Every variable here that has a rule, checked at once, before anything reads it inside a rank:
    a ``ValueError`` of one line naming each bad one, its rule and the fix.

    ``world_size``: the ranks of the job that reads them (``MOE_SBO_RANKS_PER_NODE`` must divide it);
    default torchrun's ``WORLD_SIZE`` when set, else that rule is skipped. ``environ``: the variables
    the ranks will see (default this process's). The command line calls it with its options;
    ``LocalRanks`` and ``init_from_torchrun`` before they start or join ranks.
    """
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    if world_size is None:
        try:
            world_size = _whole_number(environ, "WORLD_SIZE", 1, _TORCHRUN_FIX)
        except ValueError:
            pass  # reported below

    def ranks_per_node_rule(environ: Mapping[str, str]) -> object:
        return _ranks_per_node(environ, world_size or 1, divides=world_size is not None)

    def local_world_size_rule(environ: Mapping[str, str]) -> object:
        return _whole_number(environ, "LOCAL_WORLD_SIZE", 1, _TORCHRUN_FIX)

    for rule in (_timeout_s, ranks_per_node_rule, _torchrun_rank, local_world_size_rule, _nccl_max_ctas):
        try:
            rule(environ)
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("; and ".join(dict.fromkeys(problems)))


def allow_symm_mem_on_shared_gpus() -> None:
    """Let PyTorch's symmetric memory rendezvous accept peers on one device
    (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), for ranks that share a GPU; set before the
    first rendezvous. A value the user set is kept."""
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")


def symm_mem_on_shared_gpus() -> bool:
    """Whether symmetric memory accepts peers on one device in this process."""
    return os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1"


def mps_running() -> bool:
    """Whether a CUDA MPS control daemon serves this process: its pipe directory
    (``CUDA_MPS_PIPE_DIRECTORY``, by default ``/tmp/nvidia-mps``) holds the daemon's ``control`` pipe.
    Ranks that share a GPU without it time-slice their contexts."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def outside_mps() -> dict[str, str]:
    """Variables that keep a process started with them off any CUDA MPS daemon: a pipe directory that
    holds no daemon's pipe (CUDA then makes an ordinary context, time-sliced beside the MPS server's).
    For jobs that fault on purpose: under MPS, a client that dies or traps mid-kernel faults every
    client of the GPU until all of them exit."""
    return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(os.sep, "nonexistent", "moe-sbo-outside-mps")}

"""Every environment variable the library reads, in one place.

The hard part is that ranks must agree: a variable that changes a collective's shape or a
transport's choice has to read the same on every rank, so each reader here documents who sets it
(the user, torchrun, or Triton's test mode) and what it may change.
"""

from __future__ import annotations

import math
import os

# The wait bound's default: a dead or stalled peer is reported by every survivor within it plus the
# second or so that detecting and reporting takes (NCCL's watchdog polls, a trapped kernel surfaces at
# the next sync), so 25 s keeps the report under 30 s.
DEFAULT_TIMEOUT_S = 25.0


def collective_timeout_s() -> float:
    """``MOE_SBO_TIMEOUT_S`` (default 25): the wait bound, seconds a rank waits for its peers in one
    collective (the process group's timeout) or one symmetric-memory barrier before it fails."""
    value = os.environ.get("MOE_SBO_TIMEOUT_S", f"{DEFAULT_TIMEOUT_S:g}")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"MOE_SBO_TIMEOUT_S must be a finite number of seconds > 0, got {value!r}")
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


def torchrun_rank() -> tuple[int, int, int] | None:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as torchrun sets them, or None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def local_world_size(default: int) -> int:
    """``LOCAL_WORLD_SIZE`` (torchrun: ranks on this node), or ``default`` when it is not set."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def ranks_per_node(world_size: int) -> int | None:
    """``MOE_SBO_RANKS_PER_NODE`` (set by the user, e.g. to let one host act as several nodes), else
    torchrun's ``LOCAL_WORLD_SIZE`` when it divides ``world_size`` into more than one node; None: one
    node holds every rank. Every rank must read the same value."""
    value = os.environ.get("MOE_SBO_RANKS_PER_NODE")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"MOE_SBO_RANKS_PER_NODE must be a whole number >= 1, got {value!r}")
        return int(value)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return local if 0 < local < world_size and world_size % local == 0 else None


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

"""Joining a process group: this rank's device, the group (NCCL on GPUs, gloo on CPU) with every wait on
a peer bounded, and torchrun's environment.

The hard part is the bound: NCCL reads its error-handling variables when the group is made, so they are
set before it (``env.configure_nccl_error_handling``), and the same bound reaches the group's timeout
and the symmetric-memory barriers (``MOE_SBO_TIMEOUT_S``).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from .. import env


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cpu``/``cuda`` checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but torch sees no GPU; use --device cpu")
    return device


def join_group(device: str, local_rank: int, timeout_s: float, **init_kwargs: Any) -> torch.device:
    """Pick this rank's device, then join the process group (NCCL on GPUs, gloo on CPU) with every
    wait on a peer bounded by ``timeout_s``: the group's timeout; this process's ``MOE_SBO_TIMEOUT_S``,
    which the symmetric-memory barriers read; NCCL's error handling (``env.nccl_error_handling``)."""
    env.set_collective_timeout_s(timeout_s)
    if device == "cuda":
        env.configure_nccl_error_handling(timeout_s)  # before the group: PyTorch reads them when it is made
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch_device = torch.device("cuda", torch.cuda.current_device())
        init_kwargs["device_id"] = torch_device  # binds the NCCL communicator to this GPU eagerly
    else:
        torch_device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs
    )
    return torch_device


def init_from_torchrun(device: str = "auto") -> torch.device:
    """Join the job torchrun started (reads its environment); returns this rank's device.

    A rank that raises exits non-zero and torchrun stops the others. A rank that is alive but never
    reaches a collective, or whose process died, makes the others fail after ``MOE_SBO_TIMEOUT_S``: on
    GPUs NCCL's watchdog logs the collective that timed out, aborts the communicator and ends the
    process; a symmetric-memory barrier traps, and the next synchronising call raises; on CPU gloo
    raises. Each then exits non-zero, and torchrun stops the rest.
    """
    ranks = env.torchrun_rank()
    if ranks is None:
        raise RuntimeError("RANK/WORLD_SIZE are not set: start this under torchrun, or use LocalRanks")
    rank, world, local_rank = ranks
    return join_group(resolve_device(device), local_rank, env.collective_timeout_s(), rank=rank, world_size=world)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

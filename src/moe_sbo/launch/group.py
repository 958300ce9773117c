"""Joining a process group: this rank's device, the group (NCCL on GPUs, gloo on CPU) with every wait on
a peer bounded, and torchrun's environment.

Ranks are placed round-robin over the visible GPUs (local rank r on GPU r % G), so a node may run more
ranks than it has GPUs: expert parallelism on one GPU, for developing and testing every multi-rank GPU
path on a workstation or a one-GPU CI runner. Ranks that share a GPU cannot use NCCL (before 2.30 it
refuses two ranks on one device), so their group is gloo, which moves CUDA tensors too, and symmetric
memory is told that peers may share a device (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES``). Such runs
prove correctness, hangs and host cost, never wire speed: results label them ``wire: "shared-gpu"``.

The hard part is the bound: NCCL reads its error-handling variables when the group is made, so they are
set before it (``env.configure_nccl_error_handling``), and the same bound reaches the group's timeout
and the symmetric-memory barriers (``MOE_SBO_TIMEOUT_S``).
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from .. import env

log = logging.getLogger("moe_sbo.launch")


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cpu``/``cuda`` checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but torch sees no GPU; use --device cpu")
    return device


def ranks_per_gpu(local_world_size: int, num_gpus: int) -> int:
    """The most ranks any GPU of a node holds when ``local_world_size`` ranks are placed round-robin
    over ``num_gpus`` GPUs (1: every rank has a GPU of its own)."""
    if local_world_size < 1 or num_gpus < 1:
        raise ValueError(f"need >= 1 rank and >= 1 GPU, got {local_world_size} ranks on {num_gpus} GPUs")
    return -(-local_world_size // num_gpus)


def group_backend(device: str, local_world_size: int, num_gpus: int) -> str:
    """The process group's backend: NCCL on GPUs of their own, gloo on CPU and where ranks share a GPU
    (NCCL refuses two ranks on one device)."""
    if device != "cuda":
        return "gloo"
    return "nccl" if ranks_per_gpu(local_world_size, num_gpus) == 1 else "gloo"


def join_group(
    device: str, local_rank: int, timeout_s: float, local_world_size: int = 1, **init_kwargs: Any
) -> torch.device:
    """Pick this rank's device (round-robin: local rank r on GPU r % G), then join the process group
    (``group_backend``: NCCL on GPUs of their own, gloo on CPU or on shared GPUs) with every wait on a
    peer bounded by ``timeout_s``: the group's timeout; this process's ``MOE_SBO_TIMEOUT_S``, which the
    symmetric-memory barriers read; NCCL's error handling (``env.nccl_error_handling``).
    ``local_world_size``: the ranks on this node, which decides whether GPUs are shared."""
    torch_device, backend = pick_device(device, local_rank, timeout_s, local_world_size)
    if backend == "nccl":
        init_kwargs["device_id"] = torch_device  # binds the NCCL communicator to this GPU eagerly
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs)
    return torch_device


def pick_device(device: str, local_rank: int, timeout_s: float, local_world_size: int = 1) -> tuple[torch.device, str]:
    """This rank's device and its group's backend (``join_group``'s first half: the wait bound set,
    the GPU chosen, NCCL's error handling or shared-GPU symmetric memory configured)."""
    env.set_collective_timeout_s(timeout_s)
    backend = "gloo"
    if device == "cuda":
        num_gpus = torch.cuda.device_count()
        backend = group_backend(device, local_world_size, num_gpus)
        torch.cuda.set_device(local_rank % num_gpus)
        torch_device = torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl":
            env.configure_nccl_error_handling(timeout_s)  # before the group: PyTorch reads them when it is made
        else:  # ranks share a GPU: symmetric memory must accept peers on the same device
            env.allow_symm_mem_on_shared_gpus()
            if local_rank == 0 and not env.mps_running():
                log.warning(
                    "%d ranks share %d GPU(s) without CUDA MPS: their contexts time-slice, so device-side "
                    "waits take milliseconds instead of microseconds; start it with "
                    "`nvidia-cuda-mps-control -d` (docs/ONE_GPU.md)",
                    local_world_size,
                    num_gpus,
                )
    else:
        torch_device = torch.device("cpu")
    return torch_device, backend


def init_from_torchrun(device: str = "auto") -> torch.device:
    """Join the job torchrun started (reads its environment); returns this rank's device.

    A rank that raises exits non-zero and torchrun stops the others. A rank that is alive but never
    reaches a collective, or whose process died, makes the others fail after ``MOE_SBO_TIMEOUT_S``: on
    GPUs NCCL's watchdog logs the collective that timed out, aborts the communicator and ends the
    process; a symmetric-memory barrier traps, and the next synchronising call raises; on CPU gloo
    raises. Each then exits non-zero, and torchrun stops the rest.
    """
    env.check()  # every variable, before this rank joins (torchrun's WORLD_SIZE sizes the job)
    ranks = env.torchrun_rank()
    if ranks is None:
        raise RuntimeError("RANK/WORLD_SIZE are not set: start this under torchrun, or use LocalRanks")
    rank, world, local_rank = ranks
    return join_group(
        resolve_device(device),
        local_rank,
        env.collective_timeout_s(),
        env.local_world_size(world),
        rank=rank,
        world_size=world,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

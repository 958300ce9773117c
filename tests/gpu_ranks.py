"""How many ranks the GPU tests start: one per visible GPU and at least ``at_least``. Where there are
fewer GPUs the ranks share them round-robin (``moe_sbo.launch.group``: a gloo group, symmetric memory
on shared devices), so every multi-rank GPU path runs on a machine with one GPU, and on a machine with
enough GPUs the same tests use separate ones."""

from __future__ import annotations

import torch


def gpu_world(at_least: int = 2) -> int:
    return max(at_least, torch.cuda.device_count())


def shares_gpus(world: int) -> bool:
    """Whether ``world`` ranks share GPUs here (their group is gloo, not NCCL)."""
    return world > torch.cuda.device_count()

"""A stand-in for ``LocalRanks``/``RankPool`` that runs a command's rank function in this process, on
one rank: a command's own checks and printing under test without seconds of rank start-up."""

from __future__ import annotations

import torch
import torch.distributed as dist


class InProcess:
    """``LocalRanks``/``RankPool`` on one rank, run in this process: the command's own code, no start-up."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, fn, *args, **kwargs):
        """``fn`` on rank 0 of a one-rank gloo group (made for the call when there is none)."""
        if dist.is_initialized():
            return [fn(torch.device("cpu"), *args, **kwargs)]
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            return [fn(torch.device("cpu"), *args, **kwargs)]
        finally:
            dist.destroy_process_group()

    def stop(self):
        pass

    def close(self):
        pass

"""Started by torchrun in tests/launch/test_ranks.py: each rank joins the job and checks one EP forward."""

import sys

import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.launch.group import init_from_torchrun
from moe_sbo.layer import MoELayer

if __name__ == "__main__":
    device = init_from_torchrun("cpu")
    cfg = get_preset("tiny")
    x = torch.randn(5 + dist.get_rank(), cfg.hidden_size, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        err = (
            (
                MoELayer(cfg, dispatcher=sys.argv[1], dtype=torch.float32)(x)
                - MoELayer(cfg, dispatcher="local", dtype=torch.float32)(x)
            )
            .abs()
            .max()
            .item()
        )
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} err {err:.2e}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if err < 1e-5 else 1)

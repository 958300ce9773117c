"""``node_aware`` on GPU ranks (sharing one GPU where there are fewer GPUs than ranks) acting as nodes:
equal to the single-rank reference under every SBO mode, with and without chunks, the same bits run to
run, and one crossing per (token, destination node)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import FIXED_MODES, get_preset
from moe_sbo.layer import MoELayer

pytestmark = pytest.mark.gpu
BF16_REL_TOL = 2e-2  # bf16 on both legs and in the GEMMs, two partial sums rounded to bf16


def _rank(device, ranks_per_node, chunks):
    cfg, rank = get_preset("deepseek-v2-lite"), dist.get_rank()
    x = torch.randn(40 + 7 * rank, cfg.hidden_size, generator=torch.Generator(device).manual_seed(rank), device=device)
    x = x.bfloat16()
    options = {"ranks_per_node": ranks_per_node, "chunks": chunks}
    errors, repeatable = {}, True
    with torch.inference_mode():
        reference = MoELayer(cfg, dispatcher="local", device=device, seed=6)(x).float()
        for overlap in FIXED_MODES:
            layer = MoELayer(
                cfg, dispatcher="node_aware", device=device, seed=6, overlap=overlap, dispatcher_options=options
            )
            y = layer(x)
            repeatable &= torch.equal(layer(x), y)
            errors[overlap] = ((y.float() - reference).norm() / reference.norm()).item()
        ids = layer.router(x).topk_ids_TK // (cfg.num_experts // dist.get_world_size() * ranks_per_node)
        crossings = sum(len(set(row) - {rank // ranks_per_node}) for row in ids.tolist())
        row_bytes = cfg.hidden_size * 2 + 2 * cfg.num_experts_per_tok * 4
        crossed_right = layer.last_traffic.dispatch_inter_node_sent == crossings * row_bytes
    return errors, repeatable, crossed_right


@pytest.mark.parametrize("world, ranks_per_node, chunks", [(4, 2, 1), (4, 2, 3), (8, 2, 1), (8, 4, 2)])
def test_node_aware_matches_the_reference_on_gpu_ranks(gpu_pools, world, ranks_per_node, chunks):
    for errors, repeatable, crossed_right in gpu_pools(world).run(_rank, ranks_per_node, chunks):
        assert all(e <= BF16_REL_TOL for e in errors.values()) and repeatable and crossed_right, errors

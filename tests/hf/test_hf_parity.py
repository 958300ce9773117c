"""Our layer against ``transformers``' own MoE blocks on the same weights, float32, rel err <= 1e-5."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_blocks import FAMILIES, make_hf_block
from moe_sbo.hf.config import config_from_hf
from moe_sbo.hf.reference import weights_from_hf_moe
from moe_sbo.layer import MoELayer
from moe_sbo.routing.router import Router

REL_TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_router_picks_the_same_experts_and_weights(family):
    block, hf_config = make_hf_block(family, seed=1)
    cfg = config_from_hf(hf_config)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(block.gate.weight)
        if hasattr(block.gate, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
    x = torch.randn(257, cfg.hidden_size)
    _, hf_weights, hf_ids = block.gate(x)
    ours = router(x)
    # Same set of experts per token (order inside top-k is not part of the contract).
    hf_sorted, hf_order = hf_ids.sort(dim=-1)
    our_sorted, our_order = ours.topk_ids_TK.sort(dim=-1)
    assert torch.equal(hf_sorted, our_sorted)
    torch.testing.assert_close(ours.topk_weights_TK.gather(1, our_order), hf_weights.gather(1, hf_order))


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_matches_transformers_block(family):
    block, hf_config = make_hf_block(family, seed=2)
    cfg = config_from_hf(hf_config)
    layer = MoELayer(cfg, dispatcher="local", dtype=torch.float32)
    layer.load_weights(weights_from_hf_moe(block))
    x = torch.randn(3, 41, cfg.hidden_size)  # odd sizes, fresh inputs
    with torch.no_grad():
        expected = block(x).reshape(-1, cfg.hidden_size)
        got = layer(x.reshape(-1, cfg.hidden_size))
    assert rel_err(got, expected) <= REL_TOL


def test_noaux_bias_changes_selection_not_weights():
    """The correction bias must steer which experts win, yet the weights stay unbiased scores."""
    block, hf_config = make_hf_block("deepseek_v3", seed=3)
    cfg = config_from_hf(hf_config)
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
        block.gate.e_score_correction_bias[5] = 10.0  # expert 5 always selected
    layer = MoELayer(cfg, dispatcher="local", dtype=torch.float32)
    layer.load_weights(weights_from_hf_moe(block))
    x = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        topk = layer.router(x)
    assert bool((topk.topk_ids_TK == 5).any(dim=1).all())
    assert float(topk.topk_weights_TK.max()) < cfg.routed_scaling_factor  # no bias of 10 leaked in
    with torch.no_grad():
        assert rel_err(layer(x), block(x[None])[0]) <= REL_TOL


def _ep_parity_rank(device, family, dispatcher):
    block, hf_config = make_hf_block(family, seed=4)  # same seed: same block on every rank
    cfg = config_from_hf(hf_config)
    layer = MoELayer(cfg, dispatcher=dispatcher, dtype=torch.float32)
    layer.load_weights(weights_from_hf_moe(block))
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(11 + 6 * dist.get_rank(), cfg.hidden_size, generator=generator)
    with torch.no_grad():
        return rel_err(layer(x), block(x[None])[0])


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_layer_matches_transformers(ranks2, family, dispatcher):
    for err in ranks2.run(_ep_parity_rank, family, dispatcher):
        assert err <= REL_TOL

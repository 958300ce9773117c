"""Elastic EP restores a lost rank's experts from a Hugging Face checkpoint: the survivors that take
them over read only those experts (``LayerLoader.expert_source``), and the restored layer equals the
checkpoint's layer on one rank."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from hf_blocks import make_hf_model
from moe_sbo.hf.checkpoint import Checkpoint, LayerLoader
from moe_sbo.launch import elastic
from moe_sbo.launch.elastic import ElasticMoE, ElasticOptions
from moe_sbo.launch.failures import RankFailure
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer

WORLD, VICTIM = 4, 2


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_hf_model("deepseek_v3", seed=5).save_pretrained(path)
    return str(path)


def _restore_from_checkpoint(device, path):
    checkpoint = Checkpoint(path)
    index = checkpoint.validate_layer(None)
    cfg = checkpoint.moe_config
    group = elastic.session()
    layer = MoELayer(cfg, dispatcher="alltoall", seed=None, eplb=group.options.eplb())
    weights, _ = checkpoint.read_moe_weights(index, dtype=torch.float32)  # every expert: the slots pick theirs
    layer.load_weights(weights)
    loader = LayerLoader(checkpoint, index)
    el = ElasticMoE(layer, group, loader.expert_source(layer))
    reference = MoELayer(cfg, dispatcher="local", seed=None)
    reference.load_weights(weights)
    errors = []
    with torch.inference_mode():
        for forward in range(3):
            if forward == 1 and group.member == VICTIM:
                os.kill(os.getpid(), signal.SIGKILL)
            generator = torch.Generator().manual_seed(forward * 10 + dist.get_rank())
            x = torch.randn(10, cfg.hidden_size, generator=generator)
            y = el(x)
            if forward == 2:  # restored: the full layer
                expected = reference(x)
                errors.append(float((y - expected).abs().max() / expected.abs().max()))
    return {
        "errors": errors,
        "recovery": group.recoveries[0],
        "read": [list(r.expert_ids) for r in loader.expert_reports],
        "slots": el.layer.local_expert_ids,
    }


def test_lost_experts_are_read_from_the_checkpoint_by_the_survivors_taking_them(checkpoint_dir):
    options = ElasticOptions(spare_slots_per_rank=2, dead_after_s=2.0)
    with LocalRanks(WORLD, elastic=options, collective_timeout_s=20) as ranks:
        answers = ranks.run(_restore_from_checkpoint, checkpoint_dir)
    assert isinstance(answers[VICTIM], RankFailure)
    survivors = [a for i, a in enumerate(answers) if i != VICTIM]
    missing = survivors[0]["recovery"].missing_experts
    assert missing and survivors[0]["recovery"].restored_from == "checkpoint"
    read = sorted(e for a in survivors for ids in a["read"] for e in ids)
    assert read == sorted(missing)  # each lost expert read once, by one survivor, and nothing else
    for answer in survivors:
        assert max(answer["errors"]) <= 1e-5, answer["errors"]
        assert all(len(ids) == 1 and ids[0] in answer["slots"] for ids in answer["read"])  # only its own

"""Elastic EP on GPUs: four ranks (sharing the GPUs there are, in a gloo group; NCCL with one GPU each),
one SIGKILLed with its dispatch or combine in flight; the survivors re-form, re-run the forward degraded
and restore, equal to the single-rank layer on the GPU. The ranks run outside any CUDA MPS daemon
(``env.outside_mps``): under MPS a client killed mid-kernel faults every client of the GPU."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from moe_sbo import env
from moe_sbo.config import get_preset
from moe_sbo.eplb.runtime import EPLBOptions
from moe_sbo.launch import elastic
from moe_sbo.launch.elastic import ElasticMoE, ElasticOptions
from moe_sbo.launch.failures import RankFailure
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer
from moe_sbo.weights import seeded_expert

pytestmark = pytest.mark.gpu
WORLD, VICTIM, SEED, TOKENS = 4, 2, 3, 16


def _killed_on_gpu(device, dispatcher, at):
    cfg = get_preset("tiny")
    group = elastic.session()
    # low_latency over the group's collective: a symmetric-memory barrier would trap on the lost peer
    # (elastic_layer.check_transport refuses it).
    options = {"max_tokens_per_rank": TOKENS, "transport": "nccl"} if dispatcher == "low_latency" else None
    layer = MoELayer(
        cfg,
        dispatcher=dispatcher,
        seed=SEED,
        device=device,
        dtype=torch.float32,
        eplb=group.options.eplb(),
        dispatcher_options=options,
    )
    el = ElasticMoE(layer, group, lambda expert: seeded_expert(cfg, SEED, expert, device))
    calls = {"n": 0}
    if group.member == VICTIM:

        def die(dispatcher, payload):
            if calls["n"] == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the kernels queued so far run before the process dies
                os.kill(os.getpid(), signal.SIGKILL)

        layer.dispatcher.hooks.register(at, die)
    errors = []
    with torch.inference_mode():
        for forward in range(3):
            calls["n"] = forward
            generator = torch.Generator(device=device).manual_seed(forward * 10 + dist.get_rank())
            x = torch.randn(TOKENS, cfg.hidden_size, generator=generator, device=device)
            before = len(group.recoveries)
            y = el(x)
            recovered = group.recoveries[-1] if len(group.recoveries) > before else None
            reference = MoELayer(
                cfg, dispatcher="local", seed=SEED, device=device, dtype=torch.float32, eplb=EPLBOptions()
            )
            reference.replicas.mask(recovered.missing_experts if recovered is not None and recovered.reran else ())
            expected = reference(x)
            errors.append(float((y - expected).abs().max() / expected.abs().max()))
    return {"errors": errors, "recoveries": group.recoveries}


@pytest.mark.parametrize(
    ("dispatcher", "at"), [("alltoall", "dispatch_in_flight"), ("low_latency", "combine_in_flight")]
)
def test_a_rank_killed_on_the_gpu_the_survivors_recover(dispatcher, at):
    options = ElasticOptions(spare_slots_per_rank=2, dead_after_s=2.0)
    with LocalRanks(WORLD, device="cuda", elastic=options, collective_timeout_s=20, environ=env.outside_mps()) as ranks:
        answers = ranks.run(_killed_on_gpu, dispatcher, at)
    assert isinstance(answers[VICTIM], RankFailure) and answers[VICTIM].kind == "died"
    for rank, answer in enumerate(answers):
        if rank == VICTIM:
            continue
        assert not isinstance(answer, RankFailure), answer.details or answer.cause
        (recovery,) = answer["recoveries"]
        assert recovery.lost == (VICTIM,) and max(answer["errors"]) <= 1e-5, answer
        assert max(recovery.t_detect_ms, recovery.t_reform_ms, recovery.t_restore_ms) < 10_000, recovery

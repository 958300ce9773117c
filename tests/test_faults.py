"""Faults injected into one rank of an MoE forward end the whole group fast, with that rank's error.

One rank raises (a hook, or a module hook inside the routed experts), calls ``os._exit`` or is
killed by SIGKILL at each phase of the forward: before dispatch, while the dispatch is in flight,
during expert compute, while the combine is in flight; or it alone gets bad input (wrong dtype, more
tokens than ``low_latency``'s capacity). Every other rank is then blocked in a collective, or fails on
its dead peer's socket. The launcher must end the call within a bound far below the collective
timeout (30 s here), name the faulty rank and its cause, and the next call must work: a forward
that matches the single-rank reference.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.layer import MoELayer
from moe_sbo.model.tbo import dispatcher_for
from moe_sbo.runtime import LocalRanks, RankError
from moe_sbo.stages import run_interleaved

COLLECTIVE_TIMEOUT_S = 30
FAIL_FAST_BOUND_S = 6.0  # grace 0.5 s + stopping the ranks; without fail-fast: >= 30 s
PHASES = ("pre_dispatch", "dispatch_in_flight", "expert_compute", "combine_in_flight")
FAULTS = {"raise": "planted fault", "exit": "exited with code 17", "sigkill": "signal 9 (SIGKILL)"}
EP_DISPATCHERS = ("allgather", "alltoall", "low_latency")
CAPACITY = 16  # low_latency's max_tokens_per_rank in these tests


@pytest.fixture(scope="module")
def ranks2():
    with LocalRanks(2, collective_timeout_s=COLLECTIVE_TIMEOUT_S, failure_grace_s=0.5) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def ranks4():
    with LocalRanks(4, collective_timeout_s=COLLECTIVE_TIMEOUT_S, failure_grace_s=0.5) as ranks:
        yield ranks


def _layer(dispatcher: str, overlap: str = "none") -> MoELayer:
    options = {"max_tokens_per_rank": CAPACITY} if dispatcher == "low_latency" else None
    return MoELayer(
        get_preset("tiny"),
        dispatcher=dispatcher,
        overlap=overlap,
        dtype=torch.float32,
        seed=7,
        dispatcher_options=options,
    )


def _inject(fault: str, phase: str) -> None:
    if fault == "raise":
        raise RuntimeError(f"planted fault at {phase} on rank {dist.get_rank()}")
    if fault == "exit":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGKILL)


def _faulty_forward_rank(device, dispatcher, overlap, phase, fault, victim, tbo=False):
    """One forward on every rank; the victim rank meets ``fault`` at ``phase``."""
    layer = _layer(dispatcher, overlap)
    rank = dist.get_rank()
    x = torch.randn(CAPACITY - rank, 64, generator=torch.Generator().manual_seed(rank))
    if rank == victim:
        if phase == "expert_compute":
            layer.experts.register_forward_pre_hook(lambda module, args: _inject(fault, phase))
        elif phase == "bad_dtype":
            x = x.double()
        elif phase == "over_capacity":
            x = torch.randn(CAPACITY + 1, 64)
        else:
            # On micro-batch 1's dispatcher in the two-batch case: the fault hits B while A is in flight.
            dispatcher_for(layer, 1 if tbo else 0).hooks.register(phase, lambda d, payload: _inject(fault, phase))
    with torch.inference_mode():
        if tbo:
            half = x.shape[0] // 2
            run_interleaved(
                layer.stages(x[:half], dispatcher=dispatcher_for(layer, 0)),
                layer.stages(x[half:], dispatcher=dispatcher_for(layer, 1)),
                delay=0,
            )
        else:
            layer(x)
    return "finished"


def _healthy_rank(device, dispatcher):
    """After a failed call: a fresh group in which the dispatcher still equals the local reference."""
    x = torch.randn(5 + dist.get_rank(), 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.inference_mode():
        y = _layer(dispatcher)(x)
        reference = _layer("local")(x)
    return (y - reference).abs().max().item()


def _expect_named_failure(ranks, victim, cause, *args, tbo=False):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(_faulty_forward_rank, *args, victim, tbo)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < FAIL_FAST_BOUND_S, f"the group took {elapsed:.1f} s to end"
    assert err.first.rank == victim and cause in err.first.cause, str(err)[:2000]
    if args[2] in ("pre_dispatch", "bad_dtype", "over_capacity") and args[3] == "raise":
        # The victim raised before its first collective, so every other rank was blocked in it.
        assert [f.rank for f in err.failures] == [victim]
        assert sorted(err.stopped_ranks) == sorted(set(range(ranks.world_size)) - {victim})
    assert all(e < 1e-5 for e in ranks.run(_healthy_rank, args[0])), "the group did not recover"


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("phase", PHASES)
def test_fault_at_each_phase_on_2_ranks(ranks2, phase, fault):
    # The dispatcher and overlap mode rotate through the cases, so each meets every phase.
    index = PHASES.index(phase) + len(PHASES) * sorted(FAULTS).index(fault)
    dispatcher = EP_DISPATCHERS[index % len(EP_DISPATCHERS)]
    overlap = ("none", "dispatch", "split", "combine_sm")[index % 4]
    _expect_named_failure(ranks2, 1, FAULTS[fault], dispatcher, overlap, phase, fault)


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@pytest.mark.parametrize("phase", ["pre_dispatch", "combine_in_flight"])
def test_a_raising_rank_among_4_is_named_and_the_others_stopped(ranks4, dispatcher, phase):
    _expect_named_failure(ranks4, 2, "planted fault at", dispatcher, "split", phase, "raise")


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
def test_bad_input_on_one_rank_only_is_named(ranks2, dispatcher):
    _expect_named_failure(
        ranks2,
        0,
        "x must have the layer's dtype torch.float32, got torch.float64",
        dispatcher,
        "none",
        "bad_dtype",
        "raise",
    )


def test_over_capacity_on_one_rank_only_is_named(ranks4):
    # low_latency refuses T > capacity before its collective; only this rank can see it (no host read of
    # other ranks' counts), so the others wait in the all-to-all until the launcher stops them.
    _expect_named_failure(
        ranks4,
        3,
        "tokens per rank must be <= max_tokens_per_rank = 16",
        "low_latency",
        "none",
        "over_capacity",
        "raise",
    )


@pytest.mark.parametrize("fault", ["raise", "exit"])
def test_fault_in_micro_batch_b_of_two_batch_overlap(ranks2, fault):
    _expect_named_failure(ranks2, 1, FAULTS[fault], "alltoall", "dispatch", "dispatch_in_flight", fault, tbo=True)

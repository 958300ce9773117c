"""Faults injected into one rank of an MoE forward end the whole group fast, with that rank's error.

One rank raises (a hook, or a module hook inside the routed experts), calls ``os._exit`` or is
killed by SIGKILL at each phase of the forward: before dispatch, while the dispatch is in flight,
during expert compute, while the combine is in flight; or it alone gets bad input (wrong dtype, more
tokens than ``low_latency``'s capacity). Every other rank is then blocked in a collective, or fails on
its dead peer's socket. The launcher must end the call within a bound far below the collective
timeout (30 s here), name the faulty rank and its cause and the phase it was in, and the next call
must work: a forward that matches the single-rank reference.

A stalled rank (alive, never arriving) is different: nothing fails until the wait bound runs out.
Then the ranks waiting for it fail, and the launcher must name the stalled rank, not them, with each
rank's dispatcher phase. The bounded waits themselves: the phase marks, and the symmetric-memory
barrier's bound and channel (a stand-in handle: CPU has no symmetric memory; ``tests/test_gpu_faults.py``
runs the real one).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from moe_sbo import profiling
from moe_sbo.config import get_preset
from moe_sbo.dispatch.local import LocalDispatcher
from moe_sbo.dispatch.low_latency.transport import (
    COMBINE_CHANNEL,
    DISPATCH_CHANNEL,
    Exchange,
    SymmBarrier,
    barrier_timeout_ms,
)
from moe_sbo.launch.failures import RankError
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer
from moe_sbo.overlap.stages import run_interleaved
from moe_sbo.overlap.tbo import dispatcher_for

COLLECTIVE_TIMEOUT_S = 30
# Fail-fast ends a call in the 0.5 s grace plus the time to stop the ranks (1-2 s idle, over 6 s on a
# loaded 2-core machine running the suite in parallel); without it the call lasts the 30 s collective
# timeout. The bound sits between the two with room for the load.
FAIL_FAST_BOUND_S = 15.0
PHASES = ("pre_dispatch", "dispatch_in_flight", "expert_compute", "combine_in_flight")
FAULTS = {"raise": "planted fault", "exit": "exited with code 17", "sigkill": "signal 9 (SIGKILL)"}
EP_DISPATCHERS = ("allgather", "alltoall", "low_latency")
CAPACITY = 16  # low_latency's max_tokens_per_rank in these tests
# The faulty rank's own phase mark when its fault hits (hooks run between the dispatcher's calls).
VICTIM_PHASE = {
    "pre_dispatch": "",
    "dispatch_in_flight": "after dispatch_launch",
    "expert_compute": "after dispatch_wait",
    "pre_combine": "after dispatch_wait",
    "combine_in_flight": "after combine_launch",
}
WAIT_BOUND_S = 1.5  # the stall tests' MOE_SBO_TIMEOUT_S: short, so a case costs ~2 s
# How long after the bound a stalled call may end: the 0.25 s grace and stopping the ranks (seconds on a
# loaded 2-core machine). Without the bound it would last its deadline, 63 s: the slack stays far below.
STOP_SLACK_S = 20.0
STALL_S = 120  # how long a stalled rank sleeps: far past the bound (the launcher stops it)


@pytest.fixture(scope="module")
def ranks2():
    with LocalRanks(2, collective_timeout_s=COLLECTIVE_TIMEOUT_S, failure_grace_s=0.5) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def ranks2_short_bound():
    # A short grace too: the rank that gave up is the only one that will answer.
    with LocalRanks(2, collective_timeout_s=WAIT_BOUND_S, failure_grace_s=0.25) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def ranks4():
    with LocalRanks(4, collective_timeout_s=COLLECTIVE_TIMEOUT_S, failure_grace_s=0.5) as ranks:
        yield ranks


def _layer(dispatcher: str, overlap: str = "none") -> MoELayer:
    options: dict | None = {"max_tokens_per_rank": CAPACITY} if dispatcher == "low_latency" else None
    if dispatcher == "node_aware":
        options = {"ranks_per_node": 2}  # on 4 ranks: two nodes, so both legs have groups of their own
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
    if fault == "stall":
        time.sleep(STALL_S)  # alive and silent: only the peers' wait bound ends this
        return
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
    if args[2] in VICTIM_PHASE:  # read from the rank's exception, or from its shared slot if it died
        assert err.first.phase == VICTIM_PHASE[args[2]], str(err)[:2000]
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


# ---- a stalled rank: the others give up at the wait bound, and the launcher names the stalled one --------

# Where the rank that waits is when it gives up (2 gloo ranks). A rank stalled before its dispatch
# leaves the other in dispatch_launch: allgather and alltoall block in their count exchange there, and
# low_latency in its first forward's one-off check that every rank built it alike. A rank stalled while
# its dispatch is in flight already posted that transfer (gloo moves it in the background), so the
# other gets through dispatch and waits in combine, as when the rank stalls before combine.
SURVIVOR_PHASE = {
    "pre_dispatch": "in dispatch_launch",
    "dispatch_in_flight": "in combine_wait",
    "pre_combine": "in combine_wait",
}


@pytest.mark.parametrize("phase", ["pre_dispatch", "dispatch_in_flight", "pre_combine"])
@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
def test_a_stalled_rank_is_named_with_every_ranks_phase(ranks2_short_bound, dispatcher, phase):
    ranks = ranks2_short_bound
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(_faulty_forward_rank, dispatcher, "none", phase, "stall", 1, False)
    elapsed = time.monotonic() - start
    err = info.value
    # Not before the bound (nothing failed until then), and soon after it: the bound, the 0.25 s grace,
    # stopping the ranks. Without the bound the call would last its deadline (2 x bound + 60 s).
    assert WAIT_BOUND_S <= elapsed < WAIT_BOUND_S + STOP_SLACK_S, f"{elapsed:.1f} s\n{str(err)[:2000]}"
    assert err.stalled_ranks == (1,) and [f.rank for f in err.failures] == [0], str(err)[:2000]
    assert err.first.gave_up_waiting and "timed out" in err.first.cause.lower()
    survivor_phase = SURVIVOR_PHASE[phase]
    assert err.first.phase == survivor_phase and err.phases == (survivor_phase, VICTIM_PHASE[phase])
    message = str(err)
    assert message.startswith(
        f"_faulty_forward_rank: ranks [1] stalled: ranks [0] gave up waiting for them (wait bound {WAIT_BOUND_S:g} s"
    ), message[:2000]
    where = f"rank 0 {survivor_phase}" + (f", rank 1 {VICTIM_PHASE[phase]}" if VICTIM_PHASE[phase] else "")
    assert f"dispatcher phases when the call ended: {where}" in message
    assert all(e < 1e-5 for e in ranks.run(_healthy_rank, dispatcher)), "the group did not recover"


@pytest.fixture(scope="module")
def ranks4_short_bound():
    with LocalRanks(4, collective_timeout_s=WAIT_BOUND_S, failure_grace_s=0.25) as ranks:
        yield ranks


@pytest.mark.parametrize("phase", ["pre_dispatch", "pre_combine"])
def test_node_aware_survivors_give_up_at_the_bound_in_either_leg(ranks4_short_bound, phase):
    """4 ranks as 2 nodes, rank 3 stalls: before its dispatch the others wait in the first count
    exchange (the whole group); before its combine rank 2 waits in its node's group and rank 1 in its
    rail's, groups made by node_aware, which carry the same bound."""
    ranks = ranks4_short_bound
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(_faulty_forward_rank, "node_aware", "none", phase, "stall", 3, False)
    elapsed = time.monotonic() - start
    err = info.value
    assert WAIT_BOUND_S <= elapsed < WAIT_BOUND_S + STOP_SLACK_S, f"{elapsed:.1f} s\n{str(err)[:2000]}"
    assert err.stalled_ranks == (3,) and err.first.gave_up_waiting, str(err)[:2000]
    assert all(e < 1e-5 for e in ranks.run(_healthy_rank, "node_aware")), "the group did not recover"


# ---- the bounded waits themselves -------------------------------------------------------------------------


class _RecordingHandle:
    """Stands in for a symmetric-memory handle: records each barrier call."""

    def __init__(self):
        self.calls = []

    def barrier(self, channel=0, timeout_ms=0):
        self.calls.append((channel, timeout_ms))


def test_the_symmetric_memory_barrier_is_bounded_by_the_wait_bound(monkeypatch):
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "7.5")
    assert barrier_timeout_ms() == 7500
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "0.0001")
    assert barrier_timeout_ms() == 1  # never 0, which PyTorch reads as "wait forever"
    handle = _RecordingHandle()
    dispatch, combine = SymmBarrier(handle, DISPATCH_CHANNEL, 7500), SymmBarrier(handle, COMBINE_CHANNEL, 7500)
    # symm_mem: the kernel already wrote the blocks; the work to wait on is the phase's own barrier.
    send, recv = torch.zeros(4, 8), torch.zeros(4, 8)
    works = Exchange(recv, send, fused=True, barrier=dispatch, collective=True, group=None).start()
    assert works == [dispatch] and works[0] is dispatch  # made with the buffers, not per forward
    # copy_engine: a copy per peer block, then the barrier.
    blocks = [torch.zeros(2, 8), torch.zeros(2, 8)]
    send = torch.arange(32.0).reshape(4, 8)
    assert Exchange(
        recv, send, fused=False, barrier=combine, collective=True, group=None, peer_blocks=blocks
    ).start() == [combine]
    assert torch.equal(torch.cat(blocks), send)
    for work in works + [combine]:
        work.wait()
    # Bounded (0 would wait forever), and the channel says which phase waited in PyTorch's message.
    assert handle.calls == [(DISPATCH_CHANNEL, 7500), (COMBINE_CHANNEL, 7500)] and DISPATCH_CHANNEL != COMBINE_CHANNEL


def test_the_dispatcher_marks_the_phase_it_is_in(monkeypatch):
    """Inside each of the four calls the mark says ``in <call>``; after it, ``after <call>``; a call
    that raises leaves ``in <call>`` (where the failure happened)."""
    seen = {}
    for name in ("_launch_dispatch", "_wait_dispatch", "_launch_combine", "_wait_combine"):
        original = getattr(LocalDispatcher, name)

        def spy(self, *args, _original=original, _name=name):
            seen[_name] = profiling.current_phase()
            return _original(self, *args)

        monkeypatch.setattr(LocalDispatcher, name, spy)
    profiling.record_phases_into(None)
    assert profiling.current_phase() == ""
    layer = _layer("local")
    with torch.inference_mode():
        layer(torch.randn(4, 64))
    assert seen == {
        "_launch_dispatch": "in dispatch_launch",
        "_wait_dispatch": "in dispatch_wait",
        "_launch_combine": "in combine_launch",
        "_wait_combine": "in combine_wait",
    }
    assert profiling.current_phase() == "after combine_wait"

    def fail(self, pending):
        raise RuntimeError("planted failure in the wait")

    monkeypatch.setattr(LocalDispatcher, "_wait_dispatch", fail)
    shared = bytearray(2)  # as a launcher's shared memory: the marks land there
    profiling.record_phases_into(shared)
    with pytest.raises(RuntimeError, match="planted failure"), torch.inference_mode():
        layer(torch.randn(4, 64))
    assert profiling.describe_phase(shared) == "in dispatch_wait" == profiling.current_phase()
    profiling.record_phases_into(None)
    assert profiling.current_phase() == "" and profiling.describe_phase(shared) == "in dispatch_wait"

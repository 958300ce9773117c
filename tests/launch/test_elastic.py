"""Elastic EP on gloo ranks: one rank is SIGKILLed at each of the six hook events, or between forwards,
under every dispatcher, at EP4 and EP8; the survivors agree on the loss, re-form, re-run the forward in
flight degraded (equal to the masked sum of a single-rank reference) and then restored (equal to the
full layer), each phase within 10 s. A stalled rank that wakes up after it was declared lost is fenced
off; a replacement rejoins (EP8 -> EP7 -> EP8) equal to the original layer, and repeated loss/rejoin
cycles grow neither memory, threads nor file descriptors.

Each (dispatcher, kill point) pair runs once, the EP size and the victim alternating between cases, so
every dispatcher meets every event without the product of all axes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.eplb.runtime import initial_placement
from moe_sbo.launch import elastic, elastic_layer
from moe_sbo.launch.elastic import ElasticMoE, ElasticOptions
from moe_sbo.launch.failures import RankFailure
from moe_sbo.launch.ranks import LocalRanks
from moe_sbo.layer import MoELayer
from moe_sbo.weights import seeded_expert

DISPATCHERS = ("allgather", "alltoall", "low_latency", "node_aware")
EVENTS = ("pre_dispatch", "dispatch_in_flight", "post_dispatch", "pre_combine", "combine_in_flight", "post_combine")
KILL_POINTS = (*EVENTS, "between_forwards")
OVERLAPS = ("none", "dispatch", "combine", "split", "combine_sm")
SEED = 3
TOKENS = 12  # per rank, per forward (low_latency's capacity)
KILL_FORWARD = 1  # the forward the victim dies in (forward 0 runs on the whole group)
BOUND_S = 10.0  # each of detect, re-form, restore must finish within this on CPU
# EP4 needs 2 spare slots per rank for the 16 experts to fit on 3 survivors; EP8 needs 1 on 7.
SPARE = {4: 2, 8: 1}
CASES = [(d, p, (4, 8)[(i + j) % 2]) for i, p in enumerate(KILL_POINTS) for j, d in enumerate(DISPATCHERS)]


def _options(world: int) -> ElasticOptions:
    return ElasticOptions(spare_slots_per_rank=SPARE[world], dead_after_s=2.0, agree_s=5.0)


def _layer(dispatcher: str, group: elastic.ElasticGroup, seed: int | None = SEED, overlap: str = "none") -> MoELayer:
    cfg = get_preset("tiny")
    options: dict | None = {"max_tokens_per_rank": TOKENS} if dispatcher == "low_latency" else None
    if dispatcher == "node_aware" and dist.get_world_size() % 2 == 0:
        options = {"ranks_per_node": 2}
    return MoELayer(
        cfg, dispatcher=dispatcher, seed=seed, eplb=group.options.eplb(), dispatcher_options=options, overlap=overlap
    )


def _reference(masked: tuple[int, ...] = ()) -> MoELayer:
    """All experts on one rank; ``masked`` experts dropped from each token's sum (their weights 0)."""
    cfg = get_preset("tiny")
    layer = MoELayer(cfg, dispatcher="local", seed=SEED, eplb=elastic.ElasticOptions(spare_slots_per_rank=0).eplb())
    layer.replicas.mask(masked)
    return layer


def _source(device: torch.device):
    cfg = get_preset("tiny")
    return lambda expert: seeded_expert(cfg, SEED, expert, device)


def _inputs(member: int, forward: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * forward + member)
    return torch.randn(TOKENS - member % 3, get_preset("tiny").hidden_size, generator=generator)


def _relative(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y - reference).abs().max() / reference.abs().max().clamp(min=1e-12))


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_at(device, dispatcher, point, victim, overlap="none", forwards=3):
    """Forwards 0 .. forwards-1 on every rank; ``victim`` dies at ``point`` of forward KILL_FORWARD.
    Survivors answer each forward's relative error against the reference it must equal."""
    group = elastic.session()
    el = ElasticMoE(_layer(dispatcher, group, overlap=overlap), group, _source(device))
    me = group.member
    if me == victim and point in EVENTS:
        calls = {"n": 0}

        def die(dispatcher, payload):
            if calls["n"] == KILL_FORWARD:
                _kill()

        def count(dispatcher, y):
            calls["n"] += 1

        el.layer.dispatcher.hooks.register(point, die)
        el.layer.dispatcher.hooks.register("post_combine", count)
    errors, degraded = [], []
    with torch.inference_mode():
        for forward in range(forwards):
            if me == victim and point == "between_forwards" and forward == KILL_FORWARD:
                _kill()
            x = _inputs(me, forward)
            before = len(group.recoveries)
            y = el(x)
            # A forward re-run after the loss is degraded: the experts left without a replica masked.
            # (A rank that had finished the forward in flight recovers in its next one, which runs
            # after the restore: the full layer.)
            recovered = group.recoveries[-1] if len(group.recoveries) > before else None
            masked = recovered.missing_experts if recovered is not None and recovered.reran else ()
            errors.append(_relative(y, _reference(masked)(x)))
            degraded.append(masked)
    return {"errors": errors, "degraded": degraded, "recoveries": group.recoveries, "members": group.members}


def _check_survivors(answers, victim, world):
    survivors = [a for i, a in enumerate(answers) if i != victim]
    assert isinstance(answers[victim], RankFailure) and answers[victim].kind == "died", answers[victim]
    for answer in survivors:
        assert not isinstance(answer, RankFailure), answer.details or answer.cause
        (recovery,) = answer["recoveries"]
        assert recovery.lost == (victim,), recovery
        assert answer["members"] == tuple(m for m in range(world) if m != victim)
        assert max(answer["errors"]) <= 1e-5, answer["errors"]
        for phase in ("t_detect_ms", "t_reform_ms", "t_rerun_ms", "t_restore_ms"):
            assert getattr(recovery, phase) < 1e3 * BOUND_S, recovery
        if recovery.missing_experts:  # restored from the source after the re-run
            assert recovery.restored_from == "checkpoint", recovery
    # No split brain: every survivor names the same lost set and the same new group.
    assert len({(a["recoveries"][0].lost, a["members"]) for a in survivors}) == 1
    return [a["recoveries"][0] for a in survivors]


TIMINGS: list[tuple[str, float, float, float]] = []


@pytest.mark.parametrize(("dispatcher", "point", "world"), CASES)
def test_a_rank_killed_at_each_point_the_survivors_recover(dispatcher, point, world):
    case = KILL_POINTS.index(point) + DISPATCHERS.index(dispatcher)
    victim, overlap = case % world, OVERLAPS[case % len(OVERLAPS)]  # the SBO modes rotate through the cases
    with LocalRanks(world, elastic=_options(world), collective_timeout_s=20) as ranks:
        answers = ranks.run(_killed_at, dispatcher, point, victim, overlap)
    recoveries = _check_survivors(answers, victim, world)
    # The forward in flight was re-run degraded by the ranks that had not finished it.
    assert any(r.reran for r in recoveries)


# ---- a stalled rank is declared lost, and fenced off when it wakes -----------------------------------

STALL_BOUND_S = 2.0  # the stall test's collective timeout: a short bound, so the case costs seconds
DECISION_KEY = f"{elastic.PREFIX}/e0/decision"  # written once the others agreed on the loss


def _wait_for(store, key: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stalled(device, dispatcher, victim, how):
    """The victim stalls in forward 1 (``sleep``: alive, its heartbeat going; ``stop``: frozen by
    SIGSTOP, woken by the launcher) until the others have agreed on its loss: it must raise ``RankFenced``."""
    group = elastic.session()
    el = ElasticMoE(_layer(dispatcher, group), group, _source(device))
    me = group.member
    calls = {"n": 0}
    if me == victim:

        def stall(dispatcher, payload):
            if calls["n"] == 1:
                if how == "sleep":
                    _wait_for(group.store, DECISION_KEY)
                else:
                    os.kill(os.getpid(), signal.SIGSTOP)

        el.layer.dispatcher.hooks.register("dispatch_in_flight", stall)
    errors = []
    with torch.inference_mode():
        for forward in range(3):
            x = _inputs(me, forward)
            before = len(group.recoveries)
            y = el(x)
            calls["n"] += 1
            recovered = group.recoveries[-1] if len(group.recoveries) > before else None
            masked = recovered.missing_experts if recovered is not None and recovered.reran else ()
            errors.append(_relative(y, _reference(masked)(x)))
    return {"errors": errors, "recoveries": group.recoveries, "members": group.members}


@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_stalled_rank_is_declared_lost_and_fenced_off_when_it_wakes(how):
    world, victim = 4, 2
    options = ElasticOptions(spare_slots_per_rank=SPARE[world], dead_after_s=1.0, agree_s=1.0)
    with LocalRanks(world, elastic=options, collective_timeout_s=STALL_BOUND_S) as ranks:
        waker = None
        if how == "stop":  # the launcher wakes the frozen rank once the others have gone on
            pid, store = ranks.pids[victim], ranks._store
            waker = threading.Thread(target=lambda: (_wait_for(store, DECISION_KEY), os.kill(pid, signal.SIGCONT)))
            waker.start()
        answers = ranks.run(_stalled, "alltoall", victim, how)
        if waker is not None:
            waker.join()
        fenced = answers[victim]
        assert isinstance(fenced, RankFailure) and "RankFenced" in fenced.cause, fenced
        survivors = [a for i, a in enumerate(answers) if i != victim]
        for answer in survivors:
            assert not isinstance(answer, RankFailure), answer.details or answer.cause
            (recovery,) = answer["recoveries"]
            assert recovery.lost == (victim,) and answer["members"] == (0, 1, 3), recovery
            assert max(answer["errors"]) <= 1e-5, answer["errors"]
            assert recovery.t_detect_ms < 1e3 * BOUND_S, recovery
        # The fenced process answered and exited; the survivors serve on without it.
        deadline = time.monotonic() + 10
        while ranks.pids and time.monotonic() < deadline and _alive(ranks.pids[victim]):
            time.sleep(0.05)
        assert not _alive(ranks.pids[victim])
        again = ranks.run(_serve_on, "alltoall")
        assert [a for i, a in enumerate(again) if i != victim] == [True] * (world - 1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _serve_on(device, dispatcher):
    """One more forward of the layer the previous call made (kept in this rank's group), checked."""
    group = elastic.session()
    (el,) = group.layers
    x = _inputs(group.member, 7)
    with torch.inference_mode():
        return _relative(el(x), _reference()(x)) <= 1e-5


# ---- a replacement rejoins; loss/rejoin cycles leak nothing -----------------------------------------


def _start_layer(device, dispatcher):
    """Make this rank's elastic layer (kept in its group for the calls that follow)."""
    group = elastic.session()
    ElasticMoE(_layer(dispatcher, group), group, _source(device))
    return group.member


def _forward_or_die(device, victim, forward):
    """One forward; ``victim`` dies before it. Answers the relative error to the reference it must
    equal (degraded if this forward was re-run after the loss, else the full layer)."""
    group = elastic.session()
    if group.member == victim:
        _kill()
    (el,) = group.layers
    x = _inputs(group.member, forward)
    before = len(group.recoveries)
    with torch.inference_mode():
        y = el(x)
    recovered = group.recoveries[-1] if len(group.recoveries) > before else None
    masked = recovered.missing_experts if recovered is not None and recovered.reran else ()
    with torch.inference_mode():
        return _relative(y, _reference(masked)(x))


def _admit_or_join(device, dispatcher):
    """Members admit the process that waits; the new process joins and makes its layer. Then one
    forward, compared with the full layer; and this rank's placement, size and resources."""
    group = elastic.session()
    if group.member in group.members:
        group.admit()
    else:
        group.join(lambda: [_layer(dispatcher, group, seed=None)], _source(device))
    (el,) = group.layers
    x = _inputs(group.member, 50)
    with torch.inference_mode():
        error = _relative(el(x), _reference()(x))
    return {
        "error": error,
        "size": group.size,
        "rows": el.layer.placement.rows(),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kb": int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024,
    }


def _values(answers):
    failed = [a for a in answers if isinstance(a, RankFailure) and a.cause != "lost before this call"]
    return failed, [a for a in answers if not isinstance(a, RankFailure)]


def test_rejoin_ep8_to_ep7_to_ep8_equals_the_original_layer():
    world = 8
    with LocalRanks(world, elastic=_options(world), collective_timeout_s=20) as ranks:
        ranks.run(_start_layer, "alltoall")
        answers = ranks.run(_forward_or_die, 5, 0)  # rank 5 dies; forward 0 re-run on 7 ranks
        failed, errors = _values(answers)
        assert [f.rank for f in failed] == [5] and len(errors) == 7 and max(errors) <= 1e-5, answers
        ranks.add_rank()
        answers = ranks.run(_admit_or_join, "alltoall")
        failed, values = _values(answers)
        assert not failed and len(values) == 8, failed
        original = initial_placement(get_preset("tiny").num_experts, world, _options(world).eplb()).rows()
        for value in values:
            assert value["size"] == 8 and value["error"] <= 1e-5, value
            assert value["rows"] == original  # back to the original placement, the joiner at rank 7


def test_twenty_loss_and_rejoin_cycles_grow_nothing():
    world, cycles = 4, 20
    with LocalRanks(world, elastic=_options(world), collective_timeout_s=20) as ranks:
        ranks.run(_start_layer, "alltoall")
        samples = []
        for cycle in range(cycles):
            members = [i for i in range(len(ranks.pids)) if i in ranks._alive]
            victim = members[1 + cycle % (world - 1)]  # never the first: it is the one measured
            answers = ranks.run(_forward_or_die, victim, cycle)
            failed, errors = _values(answers)
            assert [f.rank for f in failed] == [victim] and max(errors) <= 1e-5, (cycle, answers)
            ranks.add_rank()
            failed, values = _values(ranks.run(_admit_or_join, "alltoall"))
            assert not failed and all(v["error"] <= 1e-5 and v["size"] == world for v in values), (cycle, failed)
            samples.append(values[0])
    first, last = samples[1], samples[-1]  # after one cycle: lazily made things exist
    assert last["threads"] == first["threads"] and last["tasks"] <= first["tasks"], (first, last)
    assert last["fds"] <= first["fds"], (first, last)
    assert last["rss_kb"] - first["rss_kb"] < 20 * 1024, (first, last)


# ---- the policy: degraded serving allowed or not, restore now or later -------------------------------


def _policy(device, victim, with_source):
    """The victim dies before forward 1; forwards 1-2 are compared with the reference they must equal
    under the group's policy; with ``restore=False`` the caller restores before forward 3."""
    group = elastic.session()
    options = group.options
    el = ElasticMoE(_layer("alltoall", group), group, _source(device) if with_source else None)
    errors, missing = [], ()
    with torch.inference_mode():
        for forward in range(4):
            if forward == 1 and group.member == victim:
                _kill()
            if forward == 3 and not options.restore:
                report = el.restore()
                assert report.loaded_total == len(missing) and not report.still_missing, report
            x = _inputs(group.member, forward)
            y = el(x)
            if group.recoveries:
                missing = group.recoveries[0].missing_experts
            # Forward 1 is re-run degraded if allowed (else after the restore); forward 2 is degraded
            # until the caller restores (restore=False); forward 3 runs restored.
            masked = {1: missing if options.degraded else (), 2: () if options.restore else missing}.get(forward, ())
            errors.append(_relative(y, _reference(masked)(x)))
    return {"errors": errors, "recovery": group.recoveries[0], "masked_now": el.missing_experts}


@pytest.mark.parametrize(("degraded", "restore"), [(False, True), (True, False)])
def test_policy_degraded_or_not_restore_now_or_later(degraded, restore):
    world, victim = 4, 0
    options = ElasticOptions(spare_slots_per_rank=SPARE[world], degraded=degraded, restore=restore, dead_after_s=2.0)
    with LocalRanks(world, elastic=options, collective_timeout_s=20) as ranks:
        answers = ranks.run(_policy, victim, True)
    for answer in answers[1:]:
        assert not isinstance(answer, RankFailure), answer.details or answer.cause
        assert answer["recovery"].missing_experts and max(answer["errors"]) <= 1e-5, answer
        assert answer["masked_now"] == ()
        assert (answer["recovery"].degraded_tokens > 0) == degraded, answer["recovery"]


def test_no_degraded_serving_without_a_source_raises_experts_lost():
    world, victim = 4, 0
    options = ElasticOptions(spare_slots_per_rank=SPARE[world], degraded=False, dead_after_s=2.0)
    with LocalRanks(world, elastic=options, collective_timeout_s=20) as ranks:
        answers = ranks.run(_policy, victim, False)
    for answer in answers[1:]:
        assert isinstance(answer, RankFailure) and "ExpertsLost" in answer.cause, answer


def _raises_own_error(device, culprit):
    """Forward 1 raises a RuntimeError of its own on ``culprit`` (not a loss): every rank must raise at once,
    naming it, and forward 2 must run on the whole group."""
    group = elastic.session()
    el = ElasticMoE(_layer("alltoall", group), group, _source(device))
    calls = {"n": 0}
    if group.member == culprit:

        def fail(dispatcher, payload):
            if calls["n"] == 1:
                raise RuntimeError("planted bug")

        el.layer.dispatcher.hooks.register("post_dispatch", fail)
    outcome = []
    with torch.inference_mode():
        for forward in range(3):
            calls["n"] = forward
            x = _inputs(group.member, forward)
            started = time.monotonic()
            try:
                outcome.append(_relative(el(x), _reference()(x)))
            except RuntimeError as err:
                outcome.append((str(err), time.monotonic() - started))
    return {"outcome": outcome, "members": group.members, "epoch": group.epoch}


def test_a_rank_raising_its_own_error_is_no_loss_every_rank_raises_and_serves_on():
    world, culprit = 4, 1
    with LocalRanks(world, elastic=_options(world), collective_timeout_s=20) as ranks:
        answers = ranks.run(_raises_own_error, culprit)
    for member, answer in enumerate(answers):
        assert not isinstance(answer, RankFailure), answer.details or answer.cause
        before, (message, seconds), after = answer["outcome"]
        assert before <= 1e-5 and after <= 1e-5, answer
        assert ("planted bug" if member == culprit else "member(s) [1] raised in this forward") in message
        assert seconds < BOUND_S and answer["members"] == (0, 1, 2, 3) and answer["epoch"] == 1, answer


# ---- a second loss during the recovery ---------------------------------------------------------------


def _second_loss(device, first, second):
    """``first`` dies in forward 1; ``second`` dies when, after the agreement on that loss, it is about
    to join the new group: the others' join fails on it, during the recovery."""
    group = elastic.session()
    el = ElasticMoE(_layer("alltoall", group), group, _source(device))
    if group.member == second:
        group.join_group = lambda *args, **kwargs: _kill()  # type: ignore[method-assign]
    errors = []
    with torch.inference_mode():
        for forward in range(3):
            if forward == 1 and group.member == first:
                _kill()
            x = _inputs(group.member, forward)
            before = len(group.recoveries)
            y = el(x)
            recovered = group.recoveries[-1] if len(group.recoveries) > before else None
            masked = recovered.missing_experts if recovered is not None and recovered.reran else ()
            errors.append(_relative(y, _reference(masked)(x)))
    return {"errors": errors, "recoveries": group.recoveries, "members": group.members}


def test_a_second_loss_during_the_recovery_is_recovered_too():
    world, first, second = 8, 2, 5
    with LocalRanks(world, elastic=_options(world), collective_timeout_s=3) as ranks:
        answers = ranks.run(_second_loss, first, second)
    assert all(isinstance(answers[r], RankFailure) and answers[r].kind == "died" for r in (first, second))
    survivors = [a for i, a in enumerate(answers) if i not in (first, second)]
    for answer in survivors:
        assert not isinstance(answer, RankFailure), answer.details or answer.cause
        (recovery,) = answer["recoveries"]
        assert recovery.lost == (first, second) and answer["members"] == (0, 1, 3, 4, 6, 7), recovery
        assert max(answer["errors"]) <= 1e-5, answer["errors"]
        assert recovery.t_detect_ms < 1e3 * BOUND_S, recovery


# ---- the index logic, by hand --------------------------------------------------------------------------


def test_spare_slot_plan_puts_missing_experts_where_replicas_were():
    # EP4's initial placement of 16 experts with 1 spare slot, rank 0 lost: 4, 8, 12 have no replica.
    held = [[0, 2, 5, 9, 13], [1, 3, 6, 10, 14], [1, 3, 7, 11, 15]]
    wanted, unplaced = elastic_layer.spare_slot_plan(held, [4, 8, 12])
    # Only the two doubled experts (1, 3) free a slot: 4 and 8 take them, on the ranks that gave fewest.
    assert wanted == [[0, 2, 5, 9, 13], [4, 3, 6, 10, 14], [1, 8, 7, 11, 15]] and unplaced == [12]


def test_partial_placement_and_its_replica_table_mask_the_missing_experts():
    from moe_sbo.eplb.placement import Placement
    from moe_sbo.eplb.runtime import ReplicaTable

    with pytest.raises(ValueError, match="have no replica"):
        Placement(torch.tensor([0, 1, 1, 2]), 4, 2)
    placement = Placement(torch.tensor([0, 1, 1, 2]), 4, 2, partial=True)
    assert placement.missing_experts() == (3,) and placement.rows() == [[0, 1], [1, 2]]
    table = ReplicaTable(placement, rank=1, device=torch.device("cpu"))
    assert table.masked_E.tolist() == [False, False, False, True] and table.any_masked
    # Expert 3 goes to this rank's first slot (2), its weight zeroed by the layer; 1 stays on this rank.
    assert table.to_physical(torch.tensor([[3, 1, 0]])).tolist() == [[2, 2, 0]]


def test_fill_slots_copies_locally_and_names_what_no_rank_holds():
    from moe_sbo.eplb.transfer import fill_slots

    slots = torch.arange(3.0)[:, None].repeat(1, 2)  # slot s holds [s, s]
    report = fill_slots([slots], held=[[5, 6, -1]], wanted=[[6, 5, 7]], rank=0)
    assert slots.tolist() == [[1, 1], [0, 0], [2, 2]]  # 5 and 6 swapped in place; slot 2 untouched
    assert report.to_load == ((2, 7),) and report.moved_slots == 0 and report.local_copies == 2


def test_a_transport_that_traps_on_a_lost_peer_is_refused():
    """low_latency over symmetric memory waits for its peers in a device barrier, which traps when a
    peer is gone (the survivors' CUDA contexts end): an elastic layer refuses it before any collective."""
    from moe_sbo.config import get_preset
    from moe_sbo.launch.elastic_layer import check_transport

    cfg = get_preset("tiny")
    layer = MoELayer(cfg, dispatcher="low_latency", dispatcher_options={"transport": "symm_mem"}, dtype=torch.float32)
    with pytest.raises(ValueError, match="must not wait for its peers in a device barrier"):
        check_transport(layer)
    check_transport(MoELayer(cfg, dispatcher="low_latency", dispatcher_options={"transport": "nccl"}))


def _restore_fails_somewhere(device, victim, failing):
    """The victim dies before forward 1; the source raises on the ``failing`` members: no survivor may
    install the restored placement (the others would compute their slots' experts while those kept
    the old ones), so every survivor serves on degraded, equal to the masked reference."""
    group = elastic.session()
    source = _source(device)

    def flaky(expert):
        if group.member in failing:
            raise OSError(f"checkpoint shard of expert {expert} unreadable")
        return source(expert)

    el = ElasticMoE(_layer("alltoall", group), group, flaky)
    errors, missing = [], ()
    with torch.inference_mode():
        for forward in range(3):
            if forward == 1 and group.member == victim:
                _kill()
            x = _inputs(group.member, forward)
            y = el(x)
            if group.recoveries:
                missing = group.recoveries[0].missing_experts
            errors.append(_relative(y, _reference(missing if forward else ())(x)))
    return {"errors": errors, "missing": missing, "masked_now": el.missing_experts}


def test_a_restore_that_fails_on_one_rank_is_installed_on_none():
    world, victim = 4, 0
    options = ElasticOptions(spare_slots_per_rank=SPARE[world], degraded=True, dead_after_s=2.0)
    with LocalRanks(world, elastic=options, collective_timeout_s=20) as ranks:
        answers = ranks.run(_restore_fails_somewhere, victim, (2, 3))
    for answer in answers[1:]:
        assert not isinstance(answer, RankFailure), answer.details or answer.cause
        assert answer["missing"] and answer["masked_now"] == answer["missing"], answer
        assert max(answer["errors"]) <= 1e-5, answer["errors"]


def test_a_rank_frozen_for_good_is_killed_by_the_launcher_and_the_others_serve_on():
    """SIGSTOP with no one to wake it: the survivors declare it lost and go on; the launcher kills it
    once it has stayed silent past its grace after the decision, so the call returns the survivors'
    answers instead of running into the bound (which would stop every rank)."""
    world, victim = 4, 2
    options = ElasticOptions(spare_slots_per_rank=SPARE[world], dead_after_s=1.0, agree_s=1.0)
    with LocalRanks(world, elastic=options, collective_timeout_s=STALL_BOUND_S, timeout_s=90) as ranks:
        started = time.monotonic()
        answers = ranks.run(_stalled, "alltoall", victim, "stop")
        assert time.monotonic() - started < 60
        assert isinstance(answers[victim], RankFailure) and answers[victim].kind == "died", answers[victim]
        for answer in (a for i, a in enumerate(answers) if i != victim):
            assert not isinstance(answer, RankFailure), answer.details or answer.cause
            assert answer["members"] == (0, 1, 3) and max(answer["errors"]) <= 1e-5, answer

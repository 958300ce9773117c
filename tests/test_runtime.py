"""Launching ranks: failures end the whole call fast, naming the failing rank and its cause; the pool
starts again after a failed call; nothing outlives the launcher; torchrun jobs work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from moe_sbo.runtime import LocalRanks, RankError, resolve_device


def _fail_on_rank_1(device):
    if dist.get_rank() == 1:
        raise KeyError("planted failure")
    return dist.get_rank()


def _rank(device):
    return dist.get_rank()


def test_a_failing_rank_is_named_with_its_traceback(ranks2):
    with pytest.raises(RankError, match=r"failed on ranks \[1\](.|\n)*planted failure"):
        ranks2.run(_fail_on_rank_1)
    assert ranks2.run(_rank) == [0, 1]  # the pool survives a failed call


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        LocalRanks(0)
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        resolve_device("tpu")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_torchrun_job(dispatcher):
    worker = Path(__file__).with_name("torchrun_worker.py")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(worker),
            dispatcher,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0/2" in proc.stdout and "rank 1/2" in proc.stdout


# ---- fail fast: the whole call ends soon after the first failure, named, and the pool recovers -------

# Every call below would otherwise end only at the collective timeout (30 s here) or the call deadline.
FAIL_FAST_BOUND_S = 6.0


@pytest.fixture()
def fresh_ranks():
    """Own pools: these tests break their group on purpose (the session pools stay untouched)."""
    pools = []

    def make(world_size=2, **kwargs):
        kwargs.setdefault("collective_timeout_s", 30)
        kwargs.setdefault("failure_grace_s", 0.5)
        pools.append(LocalRanks(world_size, **kwargs))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def _raise_then_barrier(device, victim):
    if dist.get_rank() == victim:
        raise KeyError("planted failure")
    dist.barrier()  # the others wait here for a rank that will never come
    return "passed the barrier"


def _exit_then_barrier(device, victim, how):
    if dist.get_rank() == victim:
        if how == "exit":
            os._exit(17)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return "passed the barrier"


def _sleep_then_barrier(device, sleeper, seconds):
    if dist.get_rank() == sleeper:
        time.sleep(seconds)  # alive and silent: only the collective timeout can end the others' wait
    dist.barrier()


def _unpicklable_answer(device):
    return (n for n in range(3))  # a generator cannot be pickled


def _sleep(device, seconds):
    time.sleep(seconds)


def _timed(fn):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        fn()
    return info.value, time.monotonic() - start


@pytest.mark.parametrize("world_size, victim", [(2, 1), (4, 2)])
def test_a_raising_rank_ends_the_whole_call_fast_and_is_named(fresh_ranks, world_size, victim):
    ranks = fresh_ranks(world_size)
    err, elapsed = _timed(lambda: ranks.run(_raise_then_barrier, victim))
    assert elapsed < FAIL_FAST_BOUND_S
    assert err.first.rank == victim and err.first.kind == "raised" and "planted failure" in err.first.cause
    assert sorted(err.stopped_ranks) == sorted(set(range(world_size)) - {victim})
    assert f"failed on ranks [{victim}]: first rank {victim} raised: KeyError: 'planted failure'" in str(err)
    assert ranks.run(_rank) == list(range(world_size)) and ranks.starts == 2  # started afresh, and works


@pytest.mark.parametrize("how, cause", [("exit", "exited with code 17"), ("sigkill", "signal 9 (SIGKILL)")])
def test_a_killed_rank_is_detected_and_named(fresh_ranks, how, cause):
    ranks = fresh_ranks(2)
    err, elapsed = _timed(lambda: ranks.run(_exit_then_barrier, 0, how))
    assert elapsed < FAIL_FAST_BOUND_S
    # Rank 1 may also fail (its peer's socket closed) but the dead rank is named first.
    assert err.first.rank == 0 and err.first.kind == "died" and cause in err.first.cause
    assert str(err).startswith("_exit_then_barrier failed on ranks [0")
    assert ranks.run(_rank) == [0, 1]


def test_collective_timeout_reaches_the_ranks_from_the_environment(monkeypatch, fresh_ranks):
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "2")
    ranks = fresh_ranks(2, collective_timeout_s=None)
    assert ranks.collective_timeout_s == 2.0
    # Rank 1 is alive but late: rank 0's barrier gives up after 2 s, and rank 1 is then stopped.
    err, elapsed = _timed(lambda: ranks.run(_sleep_then_barrier, 1, 60))
    assert 2.0 <= elapsed < 2.0 + FAIL_FAST_BOUND_S
    assert err.first.rank == 0 and "timed out" in err.first.cause.lower() and err.stopped_ranks == (1,)
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MOE_SBO_TIMEOUT_S must be a number of seconds > 0, got 'soon'"):
        LocalRanks(2)


def test_call_deadline_stops_ranks_that_never_answer(fresh_ranks):
    ranks = fresh_ranks(2, timeout_s=1.0)
    err, elapsed = _timed(lambda: ranks.run(_sleep, 60))
    assert elapsed < FAIL_FAST_BOUND_S and err.first is None and err.stopped_ranks == (0, 1)
    assert "did not answer within 1 s and no rank failed" in str(err)
    assert ranks.run(_rank) == [0, 1]


def test_what_cannot_be_pickled_is_an_error_not_a_silent_hang(fresh_ranks):
    ranks = fresh_ranks(2)
    with pytest.raises(TypeError, match="fn and its arguments must be picklable"):
        ranks.run(lambda device: 0)  # refused before any rank sees it: the pool is untouched
    assert ranks.run(_rank) == [0, 1] and ranks.starts == 1
    err, elapsed = _timed(lambda: ranks.run(_unpicklable_answer))
    assert elapsed < FAIL_FAST_BOUND_S and "generator" in err.first.cause
    assert ranks.run(_rank) == [0, 1]


def test_a_function_the_ranks_cannot_import_is_their_named_error(fresh_ranks, tmp_path, monkeypatch):
    ranks = fresh_ranks(2)
    (tmp_path / "only_in_the_launcher.py").write_text("def answer(device):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # after the ranks started: they do not see this path
    from only_in_the_launcher import answer

    err, elapsed = _timed(lambda: ranks.run(answer))
    assert elapsed < FAIL_FAST_BOUND_S and sorted(f.rank for f in err.failures) == [0, 1]
    assert "No module named 'only_in_the_launcher'" in err.first.cause


def test_a_closed_pool_refuses_work():
    ranks = LocalRanks(1)
    pids = ranks.pids
    ranks.close()
    with pytest.raises(RuntimeError, match="was closed"):
        ranks.run(_rank)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


ORPHAN_SCRIPT = """
import os, signal, sys
from moe_sbo.runtime import LocalRanks
if __name__ == "__main__":
    ranks = LocalRanks(2)
    print(" ".join(map(str, ranks.pids)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the launcher dies without closing anything
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(ORPHAN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in proc.stdout.split()]
    assert proc.returncode == -signal.SIGKILL and len(pids) == 2, proc.stderr
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "rank processes outlived their launcher"

"""Launching ranks: failures end the whole call fast, naming the failing rank and its cause; the pool
starts again after a failed call; nothing outlives the launcher; torchrun jobs work; the wait bound
(``MOE_SBO_TIMEOUT_S``) is parsed, defaults sanely and reaches every rank's process group and, on
GPUs, NCCL's error handling."""

from __future__ import annotations

import datetime
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_sbo import env
from moe_sbo.launch import ranks as launch_ranks
from moe_sbo.launch import workers as launch_workers
from moe_sbo.launch.failures import RankError
from moe_sbo.launch.group import init_from_torchrun, resolve_device
from moe_sbo.launch.ranks import LocalRanks


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
FAIL_FAST_BOUND_S = 15.0  # well below the 30 s timeout, with room for a loaded 2-core machine


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
        if how == "sigabrt":
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
            os.kill(os.getpid(), signal.SIGABRT)
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


def _bound_seen_by_the_rank(device):
    return env.collective_timeout_s()


def _variable(device, name):
    return os.environ.get(name)


def test_environ_is_set_in_the_ranks_only(fresh_ranks):
    """What ``bench --wire`` relies on: NCCL settings reach the ranks before they join, not the launcher."""
    ranks = fresh_ranks(2, environ={"MOE_SBO_TEST_VARIABLE": "on"})
    assert ranks.run(_variable, "MOE_SBO_TEST_VARIABLE") == ["on", "on"]
    assert "MOE_SBO_TEST_VARIABLE" not in os.environ


def test_collective_timeout_reaches_the_ranks_from_the_environment(monkeypatch, fresh_ranks):
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "2")
    ranks = fresh_ranks(2, collective_timeout_s=None)
    assert ranks.collective_timeout_s == 2.0
    # Rank 1 is alive but late: rank 0's barrier gives up after 2 s, and rank 1 is then stopped and
    # named as the cause (the rank that timed out is only the first failure).
    err, elapsed = _timed(lambda: ranks.run(_sleep_then_barrier, 1, 60))
    assert 2.0 <= elapsed < 2.0 + FAIL_FAST_BOUND_S
    assert err.first.rank == 0 and "timed out" in err.first.cause.lower() and err.stopped_ranks == (1,)
    assert err.stalled_ranks == (1,) and str(err).startswith("_sleep_then_barrier: ranks [1] stalled: ranks [0] gave")
    assert err.phases == ("", "")  # no dispatcher phase in a bare barrier
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MOE_SBO_TIMEOUT_S must be a finite number of seconds > 0, got 'soon'"):
        LocalRanks(2)


def test_an_explicit_bound_is_what_the_ranks_read(fresh_ranks):
    """``collective_timeout_s=`` lands in each rank's ``MOE_SBO_TIMEOUT_S``: its symmetric-memory
    barriers read the bound there, and must agree with its process group's timeout."""
    ranks = fresh_ranks(2, collective_timeout_s=3.25)
    assert ranks.run(_bound_seen_by_the_rank) == [3.25, 3.25]


@pytest.mark.parametrize("how", ["sigkill", "sigabrt"])
def test_a_rank_that_dies_is_the_cause_not_the_ranks_waiting_for_it(fresh_ranks, how):
    """A death is never read as a stall of the others: not a SIGKILL, and not a SIGABRT before the
    bound could have run out (SIGABRT is also how NCCL's watchdog ends a rank whose wait expired)."""
    ranks = fresh_ranks(2)
    err, _ = _timed(lambda: ranks.run(_exit_then_barrier, 1, how))
    assert err.first.rank == 1 and err.first.kind == "died" and how.upper() in err.first.cause
    assert err.stalled_ranks == (), str(err)[:2000]
    # Rank 0 fails on the closed connection, or is stopped if it has not yet.
    assert re.match(r"_exit_then_barrier failed on ranks \[(0, )?1\]: first rank 1 died", str(err)), str(err)[:2000]


# ---- the wait bound: parsing, and where it goes ----------------------------------------------------------


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "nan", ""])
def test_the_wait_bound_refuses_what_is_not_a_positive_number_of_seconds(monkeypatch, value):
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"MOE_SBO_TIMEOUT_S must be a finite number of seconds > 0, got {value!r}"):
        env.collective_timeout_s()


def test_the_wait_bound_defaults_to_25_s_and_takes_fractions(monkeypatch):
    monkeypatch.delenv("MOE_SBO_TIMEOUT_S", raising=False)
    assert env.collective_timeout_s() == env.DEFAULT_TIMEOUT_S == 25.0
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "0.75")
    assert env.collective_timeout_s() == 0.75
    env.set_collective_timeout_s(1 / 3)  # exactly, not rounded for display
    assert env.collective_timeout_s() == 1 / 3
    with pytest.raises(ValueError, match="the wait bound must be a finite number of seconds > 0, got 0"):
        env.set_collective_timeout_s(0)


def test_nccl_error_handling_tears_down_within_the_bound_and_keeps_the_users_choice(monkeypatch):
    for name in NCCL_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    # 1: the watchdog aborts the communicator, then ends the process; the monitor's backstop follows
    # the bound (never under 10 s, so a busy driver is not taken for a hung watchdog); the wait for
    # the debug dump before the end is 2 s, not PyTorch's 15.
    assert env.nccl_error_handling(25) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "25",
    }
    assert env.nccl_error_handling(2.5)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "10"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the user's own choice stays
    assert env.configure_nccl_error_handling(30) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30",
    }
    assert os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "30"


NCCL_SETTINGS = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
)


@pytest.fixture()
def fake_group(monkeypatch):
    """``dist.init_process_group`` replaced: records its arguments and the environment at that moment."""
    calls = []

    def init_process_group(backend, **kwargs):
        names = ("MOE_SBO_TIMEOUT_S", *NCCL_SETTINGS)
        calls.append({"backend": backend, **kwargs, "env": {n: os.environ.get(n) for n in names}})

    monkeypatch.setattr(launch_ranks.dist, "init_process_group", init_process_group)
    for name in ("MOE_SBO_TIMEOUT_S", *NCCL_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    return calls


def test_torchrun_ranks_join_with_the_wait_bound(fake_group, monkeypatch):
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "12")
    assert init_from_torchrun("cpu") == torch.device("cpu")
    (call,) = fake_group
    assert call["backend"] == "gloo" and call["rank"] == 1 and call["world_size"] == 2
    assert call["timeout"] == datetime.timedelta(seconds=12)
    assert call["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] is None  # gloo: NCCL's settings untouched


# ---- the environment, checked before any rank starts or joins -------------------------------------


def test_local_ranks_refuse_a_bad_environment_before_starting_any_rank(monkeypatch):
    monkeypatch.setattr(launch_ranks, "worker_context", lambda device: pytest.fail("ranks were started"))
    with pytest.raises(ValueError, match=r"MOE_SBO_RANKS_PER_NODE must be a whole number that divides the 4 ranks "):
        LocalRanks(4, environ={"MOE_SBO_RANKS_PER_NODE": "3"})  # what the ranks would read
    monkeypatch.setenv("NCCL_MAX_CTAS", "many")
    with pytest.raises(ValueError, match=r"^NCCL_MAX_CTAS must be a whole number >= 1, got 'many'; "):
        LocalRanks(2)


def test_torchrun_ranks_refuse_a_bad_environment_before_joining(fake_group, monkeypatch):
    monkeypatch.setenv("MOE_SBO_RANKS_PER_NODE", "3")  # torchrun's WORLD_SIZE is 2
    with pytest.raises(ValueError, match=r"^MOE_SBO_RANKS_PER_NODE must be a whole number that divides the 2 ranks"):
        init_from_torchrun("cpu")
    monkeypatch.delenv("MOE_SBO_RANKS_PER_NODE")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"^RANK must be < WORLD_SIZE \(2\), got 2; torchrun sets it"):
        init_from_torchrun("cpu")
    assert not fake_group


def test_the_environment_check_passes_what_the_readers_accept(monkeypatch):
    for name in ("MOE_SBO_TIMEOUT_S", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NCCL_MAX_CTAS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOE_SBO_RANKS_PER_NODE", "2")
    monkeypatch.setenv("NCCL_MAX_CTAS", "")  # empty: unset, as NCCL reads it
    env.check(4)
    env.check()  # no job size known: only the whole-number rule
    assert env.ranks_per_node(4) == 2 and env.nccl_max_ctas() is None
    with pytest.raises(ValueError, match=r"^MOE_SBO_RANKS_PER_NODE must be a whole number that divides the 6 ranks"):
        env.check(6, {"MOE_SBO_RANKS_PER_NODE": "4"})


def test_nccl_ranks_join_with_the_wait_bound_and_teardown_on_timeout(fake_group, monkeypatch):
    # A GPU machine as far as the launcher can tell (the process group itself is the fake above).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "8")
    assert init_from_torchrun("cuda") == torch.device("cuda", 1)
    (call,) = fake_group
    assert call["backend"] == "nccl" and call["device_id"] == torch.device("cuda", 1)
    assert call["timeout"] == datetime.timedelta(seconds=8)
    # Set before the group is made, which is when PyTorch reads them.
    assert call["env"] == {
        "MOE_SBO_TIMEOUT_S": "8.0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "10",
    }


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
from moe_sbo.launch.ranks import LocalRanks
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


# ---- more ranks than GPUs: round-robin placement, a gloo group, symmetric memory told so ------------


def test_ranks_are_placed_round_robin_and_share_gpus_only_when_they_outnumber_them():
    from moe_sbo.launch.group import group_backend, ranks_per_gpu

    assert [ranks_per_gpu(n, 2) for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert ranks_per_gpu(8, 1) == 8 and ranks_per_gpu(8, 8) == 1
    assert group_backend("cuda", 8, 8) == "nccl"  # a GPU per rank
    assert group_backend("cuda", 2, 1) == "gloo" and group_backend("cuda", 3, 2) == "gloo"  # shared: no NCCL
    assert group_backend("cpu", 2, 0) == "gloo"
    with pytest.raises(ValueError, match="need >= 1 rank and >= 1 GPU, got 0 ranks on 1 GPUs"):
        ranks_per_gpu(0, 1)


@pytest.fixture()
def one_gpu(monkeypatch):
    """A machine with one GPU as far as the launcher can tell (the process group is ``fake_group``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # join_group sets this in the process: recorded first, so it is removed again after the test.
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "")
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES")


def test_ranks_sharing_a_gpu_join_a_gloo_group_with_symmetric_memory_allowed(fake_group, one_gpu, monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(env, "mps_running", lambda: False)
    assert init_from_torchrun("cuda") == torch.device("cuda", 0)
    (call,) = fake_group
    assert call["backend"] == "gloo" and "device_id" not in call  # NCCL would refuse two ranks on one GPU
    assert call["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] is None  # no NCCL communicator to configure
    assert os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "moe_sbo.launch"]
    assert "2 ranks share 1 GPU(s) without CUDA MPS" in warning and "nvidia-cuda-mps-control -d" in warning


def test_under_mps_ranks_sharing_a_gpu_join_without_a_warning(fake_group, one_gpu, monkeypatch, caplog, tmp_path):
    (tmp_path / "control").touch()  # the MPS control daemon's pipe
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert env.mps_running()
    init_from_torchrun("cuda")
    assert fake_group[0]["backend"] == "gloo"
    assert not [r for r in caplog.records if r.name == "moe_sbo.launch"]


def test_more_ranks_than_gpus_are_accepted(one_gpu):
    from moe_sbo.measure.options import resolve_ranks

    assert resolve_ranks(4, "cuda") == 4  # not refused: the ranks share the GPU


def test_shared_gpu_runs_are_labelled_and_auto_transport_resolves_to_symmetric_memory(one_gpu, monkeypatch):
    from moe_sbo.dispatch.low_latency.transport import peers_reachable
    from moe_sbo.measure.results import shared_gpu_note

    peers_reachable.cache_clear()
    try:
        assert not peers_reachable(2)  # symmetric memory not told that peers share the device
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")  # as launch sets it
        peers_reachable.cache_clear()
        assert peers_reachable(2) and peers_reachable(8)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        peers_reachable.cache_clear()
        assert not peers_reachable(8)  # 8 ranks over nodes of 4: not one node's GPUs
    finally:
        peers_reachable.cache_clear()
    assert shared_gpu_note("cuda", 1) is None and shared_gpu_note("cpu", 4) is None
    assert shared_gpu_note("cuda", 4).startswith("4 ranks share 1 GPU(s): a functional run")


def test_bench_refuses_the_emulated_wire_on_shared_gpus_and_labels_the_rest(one_gpu):
    import argparse

    from moe_sbo.bench.sweep import resolve_wire

    args = argparse.Namespace(wire="emulated-internode", transport="auto")
    with pytest.raises(ValueError, match="needs a GPU per rank .* got 2 ranks on 1 GPU"):
        resolve_wire(args, "cuda", 2)
    args = argparse.Namespace(wire="nvlink", transport="auto")
    assert resolve_wire(args, "cuda", 2).startswith("2 ranks share 1 GPU(s)") and args.wire == "shared-gpu"


def _capture_over_gloo(device):
    from moe_sbo.dispatch import EPGroup
    from moe_sbo.dispatch.low_latency import LowLatencyDispatcher

    dispatcher = LowLatencyDispatcher(8, EPGroup.from_torch(), max_tokens_per_rank=4, transport="nccl")
    try:
        dispatcher._check_capturable_transport(torch.device("cuda"))
    except ValueError as err:
        return str(err)
    return "no error"


def test_capturing_the_nccl_transport_over_a_gloo_group_is_refused(ranks2):
    for message in ranks2.run(_capture_over_gloo):
        assert "this group is gloo (ranks sharing a GPU), which a CUDA graph cannot capture" in message
        assert "use transport='symm_mem'" in message


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signal masks")
def test_a_ctrl_c_while_the_fork_server_starts_is_kept_for_the_launcher(monkeypatch):
    """A SIGINT landing while the fork server is forked and exec'd (here: sent from inside that call)
    reaches the launcher once the call returns, as a KeyboardInterrupt; ignored for that instant, it
    was lost and the interrupted command ran on. The server's own copy is held, not acted on."""
    import threading
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    seen_blocked = []

    def ensure_running():
        seen_blocked.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))
        os.kill(os.getpid(), signal.SIGINT)  # held while the server starts

    monkeypatch.setattr(forkserver, "ensure_running", ensure_running)
    with pytest.raises(KeyboardInterrupt):
        launch_workers.start_forkserver(None)
        time.sleep(1)  # a lost signal would leave the call to end normally here
    assert seen_blocked == [True]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the mask is restored

"""Ctrl-C and SIGTERM end every ``moe-sbo`` command within seconds: one line, exit status 130 / 143,
no traceback, and no process of ours left (ranks, fork server), whether the signal comes while
torch imports, while ranks start, or in the middle of a run; sent to the whole process group (a
terminal's Ctrl-C) or to the command alone (``timeout``, ``kill``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_blocks import make_hf_model

# A command ends within seconds of the signal (1-2 s idle, over 6 s on a loaded 2-core machine); one
# that missed it would run its 20,000 tokens or its sweep for minutes. The bound sits between.
EXIT_BOUND_S = 15.0


@pytest.fixture(scope="module", autouse=True)
def sigint_as_in_a_terminal():
    """The commands must get SIGINT's default disposition, as a terminal's foreground job does. A
    shell that starts pytest in the background (``pytest &`` without job control) makes it ignore
    SIGINT, and an ignored signal stays ignored across exec; a handled one is reset to the default."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_model")
    make_hf_model("qwen3_moe", seed=1).save_pretrained(path)
    return str(path)


def _live_in_group(pgid: int) -> list[str]:
    """Processes of process group ``pgid`` that have not exited (zombies, already ended, excluded)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            live.append(stat.parent.name)
    return live


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _interrupt(
    argv: list[str], delay_s: float | Callable[[], bool], signum: int, whole_group: bool
) -> tuple[int, str, float, list]:
    """Run ``moe-sbo argv``, send ``signum`` ``delay_s`` after it started (0: as soon as it maps
    libtorch, i.e. mid-import; a function: as soon as it returns True, polled), and return (exit
    status, stderr, seconds to exit, live leftovers)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_sbo", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
    )
    if callable(delay_s):
        deadline = time.monotonic() + 120
        while not delay_s() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    elif delay_s:
        time.sleep(delay_s)
    else:
        while not _importing_torch(proc.pid) and proc.poll() is None:
            time.sleep(0.01)
    assert proc.poll() is None, "the command ended before the signal; make it longer"
    sent = time.monotonic()
    (os.killpg if whole_group else os.kill)(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    took = time.monotonic() - sent
    deadline = time.monotonic() + 2
    while _live_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _live_in_group(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, took, left


CASES = [
    # (when, signal, to the whole group): while torch imports (0), while the ranks start, mid-generation
    (0, signal.SIGINT, True),
    (1.2, signal.SIGINT, True),
    (1.2, signal.SIGTERM, False),
    (6.0, signal.SIGINT, True),
    (6.0, signal.SIGINT, False),
    (6.0, signal.SIGTERM, False),
]


@pytest.mark.parametrize("delay_s, signum, whole_group", CASES)
def test_generate_ends_cleanly_on_a_signal(tiny_model, delay_s, signum, whole_group):
    argv = [
        "generate",
        "--checkpoint",
        tiny_model,
        "--ranks",
        "2",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "20000",
    ]
    code, err, took, left = _interrupt(argv, delay_s, signum, whole_group)
    assert code == 128 + signum, err
    assert err.strip() == f"moe-sbo generate: interrupted ({signal.Signals(signum).name})", err
    assert took <= EXIT_BOUND_S and not left, (took, left)


def test_demo_ends_cleanly_on_ctrl_c_while_its_ranks_start():
    code, err, took, left = _interrupt(["demo", "--overlap", "all"], 1.4, signal.SIGINT, True)
    assert code == 130 and "Traceback" not in err and err.strip().endswith("interrupted (SIGINT)"), err
    assert took <= EXIT_BOUND_S and not left, (took, left)


def test_bench_ends_cleanly_on_ctrl_c_mid_sweep():
    argv = ["bench", "--device", "cpu", "--iters", "2000"]  # long enough for the signal to land mid-sweep
    code, err, took, left = _interrupt(argv, 4.0, signal.SIGINT, True)
    assert code == 130 and err.strip().endswith("moe-sbo bench: interrupted (SIGINT)"), err
    assert "Traceback" not in err and took <= EXIT_BOUND_S and not left, (took, left)


@pytest.mark.parametrize("signum, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_bench_file_cut_short_says_it_is_partial(tmp_path, signum, whole_group):
    """A sweep's file is written after every step: until the sweep ends it says ``partial: true``
    (``running``), and cut short by a signal after the first step, ``interrupted``, its rows whole."""
    out = tmp_path / "sbo.json"
    argv = ["bench", "--device", "cpu", "--dispatcher", "alltoall", "--overlap", "none", "--iters", "150"]
    argv += ["--tokens", "4", "8", "16", "32", "64", "--out", str(out)]
    metas = []

    def first_step_written() -> bool:
        try:
            doc = json.loads(out.read_text())
        except (OSError, ValueError):
            return False
        metas.append(doc["meta"])
        return bool(doc["rows"])

    code, err, took, left = _interrupt(argv, first_step_written, signum, whole_group)
    assert code == 128 + signum and "Traceback" not in err and took <= EXIT_BOUND_S and not left, (err, left)
    assert metas[-1]["partial"] is True and metas[-1]["partial_reason"] == "running"
    doc = json.loads(out.read_text())
    assert doc["meta"]["partial"] is True and doc["meta"]["partial_reason"] == "interrupted"
    assert 1 <= len({row["tokens_per_rank"] for row in doc["rows"]}) < 5 and "wall_s" in doc["meta"]


@pytest.mark.gpu  # two ranks: on GPUs of their own, or sharing one
@pytest.mark.parametrize("delay_s, signum", [(3.0, signal.SIGINT), (12.0, signal.SIGINT), (12.0, signal.SIGTERM)])
def test_generate_on_gpu_ranks_ends_cleanly_on_a_signal(tiny_model, delay_s, signum):
    """On two GPU ranks: while CUDA and NCCL start (3 s), and mid-decode from CUDA graphs (12 s)."""
    argv = ["generate", "--checkpoint", tiny_model, "--device", "cuda", "--ranks", "2"]
    argv += ["--prompt-ids", "1,2,3", "--max-new-tokens", "200000"]
    code, err, took, left = _interrupt(argv, delay_s, signum, whole_group=True)
    assert code == 128 + signum, err
    assert err.strip() == f"moe-sbo generate: interrupted ({signal.Signals(signum).name})", err
    assert took <= EXIT_BOUND_S and not left, (took, left)

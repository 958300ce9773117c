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
    argv: list[str],
    delay_s: float | Callable[[], bool],
    signum: int,
    whole_group: bool,
    *,
    environ: dict[str, str] | None = None,
    sent: Callable[[], None] | None = None,
) -> tuple[int, str, float, list]:
    """Run ``moe-sbo argv`` (``environ`` added to its environment), send ``signum`` ``delay_s``
    after it started (0: as soon as it maps libtorch, i.e. mid-import; a function: as soon as it
    returns True, polled), call ``sent()`` right after the signal, and return (exit status, stderr,
    seconds to exit, live leftovers)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_sbo", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
        env={**os.environ, **(environ or {})},
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
    (os.killpg if whole_group else os.kill)(proc.pid, signum)
    if sent is not None:
        sent()
    signalled = time.monotonic()  # after sent(): a fork server held there is not the command's time
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    took = time.monotonic() - signalled
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


def _holds(pid: int, signum: int) -> bool:
    """Whether process ``pid`` is running with ``signum`` blocked and pending (held, not acted on)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    bit = 1 << (signum - 1)
    return fields["State"].split()[0] not in "ZX" and bool(int(fields["SigBlk"], 16) & pending & bit)


STALL_POINTS = [
    "multiprocessing.connection",  # the fork server's first imports, before any code of ours runs
    "moe_sbo.launch.forkserver_signals",  # the last import before it ignores SIGINT
]


@pytest.mark.parametrize("stall_at", STALL_POINTS)
@pytest.mark.parametrize("command", ["demo", "generate"])
def test_a_signal_while_the_fork_server_starts_gives_no_traceback(tiny_model, tmp_path, command, stall_at):
    """The fork server is held at a known point of its start-up (``forkserver_stall/sitecustomize.py``)
    while the whole group gets SIGINT, then let go: the signal waits in the server until it ignores
    SIGINT, and the command ends with its one line. Before, the server ran with SIGINT unblocked there
    and printed a KeyboardInterrupt traceback from ``multiprocessing/forkserver.py``."""
    stall = Path(__file__).parent / "forkserver_stall"
    environ = {
        "PYTHONPATH": os.pathsep.join([str(stall), os.environ.get("PYTHONPATH", "")]),
        "MOE_SBO_TEST_STALL_DIR": str(tmp_path),
        "MOE_SBO_TEST_STALL_AT": stall_at,
    }
    held = []

    def release() -> None:
        server = int((tmp_path / "stalled").read_text())
        deadline = time.monotonic() + 5
        while not _holds(server, signal.SIGINT) and time.monotonic() < deadline:
            time.sleep(0.01)
        held.append(_holds(server, signal.SIGINT))
        (tmp_path / "go").touch()

    argv = {
        "demo": ["demo", "--overlap", "all"],
        "generate": ["generate", "--checkpoint", tiny_model, "--ranks", "2", "--prompt-ids", "1,2,3"],
    }[command]
    stalled = (tmp_path / "stalled").exists
    code, err, took, left = _interrupt(argv, stalled, signal.SIGINT, True, environ=environ, sent=release)
    assert held == [True], "the fork server did not hold the signal at the point it was stalled"
    assert code == 130 and err.strip() == f"moe-sbo {command}: interrupted (SIGINT)", err
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

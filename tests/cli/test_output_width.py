"""What every subcommand prints fits a 100-column pane without rich folding a line: laid out for a
wider terminal, no line is longer than 100 (``plan``: at 100 columns, where its explanations wrap).
``plan`` ends with its verdict. The commands run in this
process on one rank (``InProcess``): their own printing, no start-up."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hf_blocks import make_hf_model, write_published_v3
from in_process import InProcess
from moe_sbo.cli.main import main
from moe_sbo.measure import progress, run

WIDTH = 100


@pytest.fixture
def narrow(monkeypatch):
    """A terminal wider than the output must be (rich folds nothing); the ranks in this process."""
    monkeypatch.setenv("COLUMNS", str(2 * WIDTH))
    monkeypatch.setattr(run, "LocalRanks", InProcess)
    monkeypatch.setattr(run, "RankPool", InProcess)


def _fits(text: str, path=None) -> list[str]:
    """``text``'s lines, each <= 100 columns but for one naming ``path`` (printed whole, never broken)."""
    lines = text.splitlines()
    measured = [line for line in lines if path is None or str(path) not in line]
    assert measured and max(len(line) for line in measured) <= WIDTH, max(measured, key=len)
    return lines


def test_demo_overlap_all_fits_100_columns(narrow, capsys):
    argv = ["demo", "--ranks", "1", "--dispatcher", "local", "--overlap", "all", "--tokens", "4", "--iters", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out)
    assert lines[-1].startswith("6/6 dispatcher x overlap runs match the single-rank reference")


def test_check_fits_100_columns(narrow, capsys, tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=False)
    assert main(["check", "--checkpoint", str(path), "--ranks", "1", "--tokens", "4", "--device", "cpu"]) == 0
    assert _fits(capsys.readouterr().out, path)[-1].startswith("1/1 dispatchers match transformers' module")


def test_bench_fits_100_columns(narrow, capsys):
    argv = ["bench", "--ranks", "1", "--dispatcher", "local", "--overlap", "none", "split", "--tokens", "4"]
    assert main([*argv, "--iters", "1", "--no-graph", "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out)
    assert lines[-2].startswith("2 rows, 0 errors; not written") and lines[-1].startswith("best: 4 tokens local/")


def test_generate_fits_100_columns(narrow, capsys, tmp_path):
    make_hf_model("qwen3_moe", seed=3).save_pretrained(tmp_path)
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    assert main([*argv, "--ranks", "1", "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out, tmp_path)
    assert lines[0] == f"moe-sbo generate: {tmp_path} (qwen3_moe)" and lines[1].startswith("  1 cpu ranks, alltoall")


@pytest.mark.parametrize("argv", [[], ["--batch", "4096"], ["--model", "qwen3-30b-a3b", "--ep", "4"]])
def test_plan_fits_100_columns_and_ends_with_its_verdict(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # its verdicts' "why" column wraps to the terminal, by design
    assert main(["plan", *argv]) == 0
    last = _fits(capsys.readouterr().out)[-1]
    assert last.startswith("verdict: serial a2a ")


def test_plan_verdict_names_what_fits_and_what_misses(capsys):
    assert main(["plan"]) == 0  # the worked example: DeepSeek-V3 decode, batch 256, 20 ms
    assert capsys.readouterr().out.splitlines()[-1] == (
        "verdict: serial a2a misses the 20 ms TPOT; overlaps that fit: sbo-dispatch, sbo-combine, tbo"
    )
    assert main(["plan", "--batch", "4096"]) == 0
    assert capsys.readouterr().out.endswith("overlaps that fit: sbo-dispatch, sbo-combine\n")


def test_demo_and_check_show_progress_on_stderr_and_keep_stdout(narrow, monkeypatch, capsys, tmp_path):
    """On a terminal: a spinner while the ranks start, then rank 0's bar per dispatcher (x overlap),
    on stderr; stdout still ends with the verdict line."""
    drawn = io.StringIO()
    terminal = Console(file=drawn, force_terminal=True, width=WIDTH)
    monkeypatch.setattr(progress, "progress_console", lambda: terminal)
    argv = ["demo", "--ranks", "1", "--dispatcher", "local", "--overlap", "split", "--tokens", "4", "--iters", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("2/2 dispatcher x overlap runs match") and "starting" not in out
    assert "starting 1 cpu ranks" in drawn.getvalue() and "demo local / split" in drawn.getvalue()
    path, _ = write_published_v3(tmp_path, fp8=False)
    assert main(["check", "--checkpoint", str(path), "--ranks", "1", "--tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1/1 dispatchers match")
    assert "check local" in drawn.getvalue()


def test_progress_draws_nothing_off_a_terminal(capsys):
    assert progress.rank_progress(0, 3, "demo") is None  # pytest captures stderr: not a terminal
    with progress.starting_ranks(2, "cpu"):
        pass
    assert capsys.readouterr() == ("", "")

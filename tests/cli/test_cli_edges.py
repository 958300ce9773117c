"""The command line's edges: --version, ``python -m moe_sbo``, help texts, the shared rank default and
its check, CPU bench defaults and the memory check, stopping a sweep after a rank is killed, table
widths, logging, profiler noise, and ``MoELayer``'s dtype default (float32 on CPU)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from rich.console import Console

import moe_sbo
from moe_sbo.bench import sweep
from moe_sbo.bench.sbo import sbo_legend, sbo_table
from moe_sbo.bench.tbo import tbo_table
from moe_sbo.cli import check, demo_report
from moe_sbo.cli.main import main
from moe_sbo.cli.parsers import build_parser, parse_args
from moe_sbo.cli.parsers.bench import BENCH_MODES
from moe_sbo.cli.plan import main as plan_main
from moe_sbo.config import get_preset
from moe_sbo.launch.failures import RankError, RankFailure
from moe_sbo.layer import MoELayer
from moe_sbo.measure import memory, options, run
from moe_sbo.measure.results import ResultFile

COMMANDS = ("demo", "bench", "check", "generate", "plan")


def _run(*args, timeout=240):
    """``python -m moe_sbo ARGS`` in a fresh process, 100 columns wide (its ranks' output included)."""
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "moe_sbo", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture
def no_ranks(monkeypatch):
    """Bad input must be refused before any rank (and so any collective) starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started for bad input")

    monkeypatch.setattr(run, "LocalRanks", refuse)
    monkeypatch.setattr(run, "RankPool", refuse)


# ---- --version, python -m, help -----------------------------------------------------------------


def test_version_reports_the_environment(capsys):
    """The version line first (what scripts read), then Python, torch, Triton, CUDA, NCCL and the GPU."""
    import platform

    import torch

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"moe-sbo {moe_sbo.__version__}" and len(lines) == 3
    assert lines[1].startswith(f"Python {platform.python_version()}, torch {torch.__version__}, Triton ")
    assert lines[2].startswith(f"CUDA {torch.version.cuda or 'none'}, NCCL ") and ", GPU " in lines[2]
    proc = subprocess.run([sys.executable, "-m", "moe_sbo.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == f"moe-sbo {moe_sbo.__version__}"  # the old entry


def test_version_does_not_import_torch():
    """--version answers at once: its report comes from package metadata, torch is not imported."""
    code = (
        "import sys; from moe_sbo.cli.main import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'rich', 'transformers')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_every_subcommand_help_ends_with_examples_the_parser_accepts():
    """Each --help shows 2-3 real command lines; each parses (torchrun's after ``-m moe_sbo``)."""
    import shlex

    parser = build_parser()
    for name, sub in _subparsers(parser).items():
        text = sub.format_help()
        examples = text.split("examples:\n")[1].splitlines()
        assert 2 <= len(examples) <= 3 and all(len(line) <= 100 for line in examples), name
        for line in examples:
            argv = shlex.split(line.split("  #")[0].split(" | ")[0])
            argv = argv[argv.index("moe_sbo") + 1 :] if argv[0] == "torchrun" else argv[1:]
            assert argv[0] == name and parse_args(argv).command == name, line


def test_parsers_are_built_without_importing_torch():
    """--help, --version and usage errors answer in a tenth of a second: torch (seconds) is imported
    only when a command runs. A fresh process, since this one has torch loaded already."""
    code = (
        "import sys; from moe_sbo.cli.parsers import build_parser, parse_args; build_parser().format_help(); "
        f"[parse_args(['bench', mode, '--out', 'x.json']) for mode in {sorted(BENCH_MODES)!r}]; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rich', 'transformers')); "
        "print(heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_help_is_plain_text_lists_the_commands_and_shows_defaults():
    parser = build_parser()
    top = parser.format_help()
    assert "usage: moe-sbo [-h] [--version] [-v] [--log-level LEVEL] COMMAND ..." in top
    for command in COMMANDS:
        assert f"\n  {command}  " in top.split("subcommands:")[1]
    subparsers = _subparsers(parser)
    assert list(subparsers) == list(COMMANDS)
    for name, sub in subparsers.items():
        text = sub.format_help()
        assert "``" not in text and text.startswith(f"usage: moe-sbo {name} "), name
        formatter = sub._get_formatter()
        for action in sub._actions:
            default = action.default
            if action.option_strings and default not in (None, argparse.SUPPRESS) and default is not False:
                assert "default" in formatter._expand_help(action), (name, action.option_strings)
    assert "``" not in top


# ---- ranks ---------------------------------------------------------------------------------------


def test_one_rank_default_for_every_command():
    assert options.resolve_ranks(None, "cpu") == options.default_ep_size("cpu") == 2
    assert options.resolve_ranks(3, "cpu") == 3


@pytest.mark.parametrize("command", ["demo", "bench", "check"])
@pytest.mark.parametrize("ranks", ["0", "-1"])
def test_ranks_below_one_is_refused_in_one_line(command, ranks, capsys, no_ranks, tmp_path):
    extra = ["--checkpoint", str(tmp_path)] if command == "check" else []
    assert main([command, "--device", "cpu", "--ranks", ranks, *extra]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"moe-sbo {command}: error: --ranks must be >= 1, got {ranks}; "
        "leave it out for the default (every GPU on CUDA, 2 on CPU)\n"
    )


# ---- bench on CPU: defaults, memory, stopping ----------------------------------------------------


def test_bench_defaults_depend_on_the_device_and_keep_given_values():
    args = parse_args(["bench", "--tokens", "7"])  # no mode: sbo
    sweep.resolve_defaults(args, "cpu")
    assert (args.mode, args.preset, args.tokens, args.warmup, args.iters) == ("sbo", "tiny", [7], 1, 3)  # --tokens kept
    args = parse_args(["bench", "tbo"])
    sweep.resolve_defaults(args, "cpu")
    assert (args.prefill_tokens, args.decode_seqs, args.kv_len, args.heads) == ([128], [4, 16], 64, 4)
    args = parse_args(["bench", "sbo"])
    sweep.resolve_defaults(args, "cuda")
    assert (args.preset, args.tokens, args.warmup, args.iters) == ("deepseek-v3", [128, 512, 2048, 4096, 8192], 5, 20)
    args = parse_args(["bench", "tbo", "--decode-seqs"])  # empty: no decode sizes, kept
    sweep.resolve_defaults(args, "cuda")
    assert (args.decode_seqs, args.prefill_tokens, args.heads, args.kv_heads) == ([], [4096, 8192], 128, 8)


def test_bench_on_cpu_without_sizes_is_a_quick_tiny_sweep(tmp_path, capsys):
    out = tmp_path / "sbo.json"
    argv = ["bench", "--device", "cpu", "--dispatcher", "alltoall", "--overlap", "split", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["preset"] == "tiny" and result["meta"]["iters"] == 3 and result["meta"]["world_size"] == 2
    assert {r["tokens_per_rank"] for r in result["rows"]} == {16, 64}
    assert result["meta"]["wall_s"] < 60
    # The wire: the one the run crossed (gloo on CPU ranks, not --wire's default nvlink), named in the
    # meta and in every row; the physical references ride along.
    assert result["meta"]["wire"] == "gloo-cpu" and all(r["wire"] == "gloo-cpu" for r in result["rows"])
    assert all(r["t_wire_us"] > 0 and r["t_floor_us"] > 0 for r in result["rows"])
    for r in result["rows"]:
        assert r["t_limit_us"] == max(r["t_floor_us"], r["t_wire_us"])
        assert r["limit_ratio"] == pytest.approx(r["t_layer_us"] / r["t_limit_us"], rel=1e-2)  # fields are rounded
    assert result["meta"]["wire_all_to_all_GBps"] > 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("memory per rank, estimated: ") and "MemAvailable / 2 ranks" in lines[0]
    assert "weights" not in printed  # the estimate's parts: --detail
    assert "each mode: t(none)/t" in printed and "CPU timings: gloo on" in printed
    assert lines[-2] == f"4 rows, 0 errors; written to {out}"  # the path whole, however long
    assert lines[-1].startswith("best: 16 tokens alltoall/") and "; 64 tokens alltoall/" in lines[-1]
    assert max(len(line) for line in lines[:-2]) <= 100  # all but the path line and the verdict


def test_bench_refuses_the_emulated_wire_on_cpu_in_one_line(capsys, no_ranks):
    assert main(["bench", "--wire", "emulated-internode", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "moe-sbo bench: error: --wire emulated-internode needs CUDA GPUs (it routes NCCL through host memory), "
        "got --device cpu; run on GPUs or leave out --wire\n"
    )


def test_emulated_wire_takes_nccl_and_refuses_transports_that_bypass_it():
    args = parse_args(["bench", "--wire", "emulated-internode"])
    assert "transport nccl" in sweep.resolve_wire(args, "cuda", 2) and args.transport == "nccl"
    for transport in ("symm_mem", "copy_engine"):
        args = parse_args(["bench", "tbo", "--wire", "emulated-internode", "--transport", transport])
        with pytest.raises(ValueError, match=f"--transport {transport} writes the peer's memory over NVLink"):
            sweep.resolve_wire(args, "cuda", 2)
    with pytest.raises(ValueError, match="needs >= 2 ranks, got 1"):
        sweep.resolve_wire(parse_args(["bench", "eplb", "--wire", "emulated-internode"]), "cuda", 1)
    args = parse_args(["bench"])
    assert sweep.resolve_wire(args, "cpu", 2) is None and args.wire == "gloo-cpu"  # not the default nvlink


def test_one_rank_crosses_no_wire():
    """A one-rank run's rows must not claim a link between ranks (the default --wire is nvlink)."""
    args = parse_args(["bench"])
    assert sweep.resolve_wire(args, "cpu", 1) is None and args.wire == "none"


def test_bench_refuses_what_cannot_fit_before_any_rank(tmp_path, monkeypatch, capsys, no_ranks):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4194304 kB\nMemAvailable:   2097152 kB\n")  # 2 GiB
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    assert main(["bench", "--device", "cpu", "--preset", "deepseek-v3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-sbo bench: error: the memory per rank must be <= the 1.1 GB available ")
    assert "(MemAvailable / 2 ranks), got an estimated 22.8 GB: weights 22.7 GB (128 local" in err
    assert err.rstrip().endswith("; use --preset tiny or fewer --experts, or a GPU") and err.count("\n") == 1


def test_memory_estimate_counts_local_experts_shared_experts_and_router():
    cfg = get_preset("tiny")  # H 64, I 32, 16 experts, 1 shared expert (J 32), top-4
    estimate = memory.estimate_rank_bytes(cfg, ranks=2, dtype="bfloat16", tokens=10)
    assert estimate.local_experts == 8
    assert estimate.weights_B == (8 * 3 * 64 * 32 + 3 * 64 * 32) * 2 + 16 * 64 * 4
    assert estimate.activations_B > 2 * 10 * 64 * 2  # at least every rank's tokens, in bf16
    assert memory.size(22.8e9) == "22.8 GB" and memory.size(880) == "880 B"


def _died(rank: int, cause: str, kind: str = "died") -> RankError:
    return RankError("step failed", (RankFailure(rank, kind, cause, cause, 0.0),))


class _Pool:
    """A rank pool whose calls answer or fail as told, in order."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), 0

    def run(self, fn, *args):
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _steps(n):
    return [
        sweep.Step(f"step {i}", None, (), lambda per_rank, i=i: [{"step": i}], {"tokens_per_rank": i}) for i in range(n)
    ]


@pytest.mark.parametrize(
    "fatal",
    [
        _died(1, "process killed by signal 9 (SIGKILL)"),
        _died(0, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", kind="raised"),
        _died(0, "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate", kind="raised"),
    ],
)
def test_sweep_stops_after_a_rank_is_killed_or_runs_out_of_memory(fatal):
    results, pool = ResultFile(None, {}), _Pool([[[]], fatal, [[]], [[]]])
    stopped = sweep.run_steps(_steps(4), pool, results, Console(file=open(os.devnull, "w")), "sbo")
    assert pool.calls == 2 and results.errors == 1 and len(results.rows) == 2
    assert results.rows[1]["step"] == "step 1" and results.rows[1]["tokens_per_rank"] == 1
    assert stopped.startswith(f"sweep stopped after step step 1: rank {fatal.first.rank} ")
    assert "2 remaining steps skipped" in stopped


def test_sweep_goes_on_after_an_ordinary_failure():
    results, pool = ResultFile(None, {}), _Pool([_died(0, "ValueError: bad", kind="raised"), [[]], [[]]])
    assert sweep.run_steps(_steps(3), pool, results, Console(file=open(os.devnull, "w")), "sbo") is None
    assert pool.calls == 3 and results.errors == 1


# ---- tables --------------------------------------------------------------------------------------


def test_numbers_are_compact():
    assert [options.compact(v) for v in (812.4, 9999, 12_345, 999_949, 4.5e6, None)] == [
        "812",
        "9999",
        "12.3k",
        "999.9k",
        "4.5M",
        "-",
    ]
    assert [options.sci(v) for v in (0.0, 1.07e-6, 2.5e-12)] == ["0", "1.1e-6", "2.5e-12"]


def _width(table) -> int:
    """Columns the table needs to print without folding anything."""
    return Console(width=300).measure(table).maximum


def test_tables_fit_100_columns_with_the_widest_values():
    big = {"max_abs_err": 1.23e-12, "rel_err": 2.34e-12, "ok": False, "same_as_none": False, "bytes_sent": 123e6}
    times = dict.fromkeys(("t_route_us", "t_dispatch_us", "t_experts_us", "t_combine_us", "t_layer_us"), 999_000.0)
    nodes = {"inter_node_bytes": 0, "nodes": 1, "ranks_per_node": 2}
    demo_rows = [{"dispatcher": "low_latency", "overlap": "combine_sm", **big, **times, **nodes}]
    assert _width(demo_report.demo_table(demo_rows)) <= 100
    sbo = {
        "experts_per_gpu": 384,
        "tokens_per_rank": 16384,
        "dispatcher": "low_latency",
        "overlap": "combine_sm",
        "graph": True,
        **dict.fromkeys(("t_layer_us", "t_dispatch_us", "t_routed_us", "t_combine_us", "t_shared_us"), 999e3),
        "t_comm_us": 999e3,
        "speedup_vs_none": 10.5,
        "efficiency": -123.45,
    }
    error = {"bench": "sbo", "step": "E=384 low_latency T=16384", "experts_per_gpu": 48, "error": "x"}
    assert _width(sbo_table([sbo, {**error, "dispatcher": "low_latency", "tokens_per_rank": 16384}])) <= 100
    assert len(sbo_legend([sbo])) <= 100
    tbo = {
        "regime": "prefill",
        "tokens_per_rank": 16384,
        "sequences_per_rank": 16,
        "dispatcher": "low_latency",
        "overlap": "combine_sm",
        "tbo": True,
        "delay": 2,
        "graph": True,
        "t_layer_us": 999e3,
        "speedup_vs_none": 1.5,
    }
    assert _width(tbo_table([tbo])) <= 100
    check_row = {"dispatcher": "low_latency", **big, "bytes_read": 45e9}
    assert _width(check.check_table([check_row], 2e-2)) <= 100


def test_console_takes_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "137")
    assert options.make_console().width == 137
    monkeypatch.setenv("COLUMNS", "100")
    assert options.make_console().width == 100


def test_plan_fits_100_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    assert plan_main(["--detail"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "10.9 GB/s" in out  # numbers are never folded


# ---- logging, python -m moe_sbo, profiler noise --------------------------------------------------


def test_log_level_flags():
    assert options.log_level(None, None) is None
    assert options.log_level(1, None) == logging.INFO and options.log_level(2, None) == logging.DEBUG
    assert options.log_level(2, "WARNING") == logging.WARNING
    assert build_parser().parse_args(["--log-level", "debug", "plan"]).log_level == "DEBUG"
    try:
        options.configure_logging(logging.DEBUG)
        assert logging.getLogger("moe_sbo.tbo").getEffectiveLevel() == logging.DEBUG
        assert options.in_ranks(print) == options._Logged(print, logging.DEBUG)
    finally:
        options.configure_logging(None)
    assert options.in_ranks(print) is print
    assert logging.getLogger("moe_sbo").level == logging.NOTSET


def test_module_entry_logs_in_ranks_and_timeline_is_quiet(tmp_path):
    """``python -m moe_sbo``: --log-level reaches the ranks; --timeline leaks no profiler lines."""
    png = tmp_path / "tbo.png"
    proc = _run(
        "--log-level",
        "debug",
        "bench",
        "tbo",
        "--device",
        "cpu",
        "--dispatcher",
        "alltoall",
        "--overlap",
        "none",
        "--prefill-tokens",
        "8",
        "--decode-seqs",
        "--delay",
        "0",
        "--timeline",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 1: moe_sbo.tbo: DEBUG: two-batch overlap off for this batch" in proc.stderr
    assert "USDT" not in proc.stdout + proc.stderr and "profiler_start" not in proc.stdout + proc.stderr
    assert f"timeline: {png} (spans: {png.with_suffix('.spans.json')})" in proc.stdout
    assert proc.stdout.splitlines()[-2] == "2 rows, 0 errors; not written (no --out)"
    # Which of the two rows wins is CPU timing; that the line names the size and a row is not.
    assert proc.stdout.splitlines()[-1].startswith("best: prefill 8 alltoall/none ")
    assert max(len(line) for line in proc.stdout.splitlines() if str(tmp_path) not in line) <= 100  # paths unbroken


# ---- MoELayer's dtype default --------------------------------------------------------------------


def test_layer_dtype_defaults_to_float32_on_cpu_and_keeps_explicit_values():
    cfg = get_preset("tiny")
    layer = MoELayer(cfg)
    assert layer.dtype == torch.float32 and layer.experts.gate_up_proj.dtype == torch.float32
    assert layer(torch.randn(3, cfg.hidden_size)).dtype == torch.float32  # float32 input works as is
    assert MoELayer(cfg, dtype=torch.bfloat16).dtype == torch.bfloat16

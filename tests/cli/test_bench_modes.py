"""``moe-sbo bench <mode>``: every registered mode has a torch-free parser and a runner with ``main``;
no mode runs ``sbo``; an unknown mode, or a mode spelled as a flag, exits 2 with one clear line."""

from __future__ import annotations

import argparse
import importlib

import pytest

from moe_sbo.cli.main import main
from moe_sbo.cli.parsers import build_parser, parse_args
from moe_sbo.cli.parsers.bench import BENCH_MODES, DEFAULT_MODE, MODE_FLAGS


def _mode_parsers() -> dict[str, argparse.ArgumentParser]:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return next(a for a in commands["bench"]._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("mode", sorted(BENCH_MODES))
def test_each_mode_has_a_parser_module_and_a_runner_with_main(mode):
    help_, parser_module, runner_module = BENCH_MODES[mode]
    assert help_ and "\n" not in help_
    parser = importlib.import_module(parser_module)
    assert callable(parser.add_arguments) and parser.DESCRIPTION.strip()
    runner = importlib.import_module(runner_module)
    assert callable(runner.main) and runner_module == f"moe_sbo.bench.{mode.replace('-', '_')}"


@pytest.mark.parametrize("mode", sorted(BENCH_MODES))
def test_each_mode_help_is_plain_text_and_shows_defaults(mode):
    sub = _mode_parsers()[mode]
    text = sub.format_help()
    assert text.startswith(f"usage: moe-sbo bench {mode} ") and "``" not in text
    formatter = sub._get_formatter()
    for action in sub._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS, False):
            assert "default" in formatter._expand_help(action), (mode, action.option_strings)


def test_bench_help_lists_every_mode_and_the_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-sbo bench [-h] [MODE] [options]")
    for mode, (help_, _, _) in BENCH_MODES.items():
        assert f"  {mode} " in out and help_ in out
    assert f"moe-sbo bench with no mode runs {DEFAULT_MODE}" in out


def test_no_mode_is_sbo_with_its_options():
    assert DEFAULT_MODE == "sbo"
    args = parse_args(["bench", "--tokens", "4", "--overlap", "split"])
    assert (args.command, args.mode, args.tokens, args.overlap) == ("bench", "sbo", [4], ["split"])
    assert parse_args(["-v", "--log-level", "info", "bench"]).mode == "sbo"


def test_an_unknown_mode_exits_2_naming_the_modes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "sideways", "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    choices = ", ".join(f"'{mode}'" for mode in BENCH_MODES)
    assert f"moe-sbo bench: error: argument MODE: invalid choice: 'sideways' (choose from {choices})" in err


@pytest.mark.parametrize("flag", sorted(MODE_FLAGS))
def test_a_mode_given_as_a_flag_exits_2_with_the_new_spelling(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--device", "cpu", flag, "--ranks", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"moe-sbo bench: error: the bench mode is a word after bench, not a flag, got {flag}; "
        f"run moe-sbo bench {MODE_FLAGS[flag]} [options] (modes: {', '.join(BENCH_MODES)})\n"
    )


@pytest.mark.parametrize("mode", sorted(BENCH_MODES))
def test_a_mode_runs_its_runner_main_and_returns_its_status(mode, monkeypatch):
    runner = importlib.import_module(BENCH_MODES[mode][2])
    seen = []
    monkeypatch.setattr(runner, "main", lambda args: seen.append(args.mode) or 7)
    assert main(["bench", mode, "--out", "x.json"]) == 7 and seen == [mode]


@pytest.mark.parametrize("mode", ["sbo", "tbo", "eplb"])
def test_each_mode_help_is_a_screenful_at_80_columns(mode, monkeypatch):
    """A mode's --help fits an 80x50 terminal: grouped options, one line each where it can; the
    reference detail is in docs/BENCH_OPTIONS.md, which the help names."""
    monkeypatch.setenv("COLUMNS", "80")
    sub = _mode_parsers()[mode]
    lines = sub.format_help().splitlines()
    assert len(lines) <= 50 and max(map(len, lines)) <= 80, (len(lines), max(lines, key=len))
    titles = [group.title for group in sub._action_groups if group._group_actions]
    assert titles[:4] == ["what to time", "ranks and wire", "timing", "output"] and max(map(len, titles)) <= 80
    assert "docs/BENCH_OPTIONS.md" in "\n".join(lines)
    for action in sub._actions:  # every option listed, -h among them
        assert any(line.lstrip().startswith(action.option_strings[0]) for line in lines), action.option_strings


def test_bench_help_fits_80_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 80


@pytest.mark.parametrize("mode", sorted(BENCH_MODES))
def test_every_mode_answers_help(mode, capsys):
    """``moe-sbo bench MODE --help`` prints the mode's options and exits 0, before any required option
    is asked for."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", mode, "--help"])
    assert exit_.value.code == 0 and f"moe-sbo bench {mode}" in capsys.readouterr().out

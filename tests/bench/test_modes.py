"""Every ``moe-sbo bench`` mode of ``moe_sbo.bench``: its parser imports without torch, describes the
mode and takes its defaults, its runner has ``main``, the choices a parser names without torch equal
the runner's, and the sweep options refuse bad input before any rank starts."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from bench_modes import ROOT

MODES = ("foundation", "fp8-experts", "dense-experts", "generate", "low-latency", "prefill", "router", "load-memory")


def _parser(mode: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"moe-sbo bench {mode}")
    importlib.import_module(f"moe_sbo.cli.bench_parsers.{mode.replace('-', '_')}").add_arguments(parser)
    return parser


def test_parsers_import_without_torch():
    """``--help`` must answer at once: no parser module imports torch (or rich, or transformers)."""
    names = [f"moe_sbo.cli.bench_parsers.{m.replace('-', '_')}" for m in MODES]
    script = (
        f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rich', 'transformers')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_parses_its_defaults_and_has_a_runner(mode):
    """And a plain-text description for its ``--help``; the help itself (every default shown) prints."""
    options = importlib.import_module(f"moe_sbo.cli.bench_parsers.{mode.replace('-', '_')}")
    assert isinstance(options.DESCRIPTION, str) and options.DESCRIPTION.strip()
    parser = _parser(mode)
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    assert "--out" in parser.format_help()
    args = parser.parse_args(["--out", "somewhere"])
    assert args.out is not None
    assert callable(importlib.import_module(f"moe_sbo.bench.{mode.replace('-', '_')}").main)


def test_choices_named_without_torch_are_the_runners():
    from moe_sbo.bench import low_latency
    from moe_sbo.cli.bench_parsers import low_latency as low_latency_options
    from moe_sbo.experts.routed import DENSE_KERNELS

    assert low_latency_options.EXPERT_KERNELS == DENSE_KERNELS
    assert low_latency_options.FP8_CHOICES == tuple(sorted(low_latency.FP8_CHOICES))


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--ranks", "0"], "--ranks must be >= 1"), (["--iters", "0"], "--iters >= 1"), (["--tokens", "-1"], "--tokens")],
)
def test_sweep_options_refuse_bad_input(argv, message):
    from moe_sbo.bench.ep_sweep import EpSweep

    args = _parser("foundation").parse_args(["--out", "somewhere", "--device", "cpu", *argv])
    with pytest.raises(ValueError, match=message):
        EpSweep.from_args(args, args.tokens)

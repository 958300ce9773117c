"""The EP-size sweeps' options (``foundation``, ``low-latency``, ``prefill``): bad input is refused on
the launching process, before any rank starts, naming the option."""

from __future__ import annotations

import pytest

from moe_sbo.bench.ep_sweep import EpSweep
from moe_sbo.cli.parsers import parse_args


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--ranks", "0"], "--ranks must be >= 1"), (["--iters", "0"], "--iters >= 1"), (["--tokens", "-1"], "--tokens")],
)
def test_sweep_options_refuse_bad_input(argv, message):
    args = parse_args(["bench", "foundation", "--out", "somewhere", "--device", "cpu", *argv])
    with pytest.raises(ValueError, match=message):
        EpSweep.from_args(args, args.tokens)


def test_defaults_are_every_gpu_or_two_cpu_ranks_and_quick_iterations():
    args = parse_args(["bench", "low-latency", "--out", "somewhere", "--device", "cpu", "--quick"])
    assert EpSweep.from_args(args, args.tokens) == EpSweep("cpu", warmup=1, iters=3, ep_sizes=[2])
    args = parse_args(["bench", "prefill", "--out", "somewhere", "--device", "cpu", "--ranks", "1", "4"])
    assert EpSweep.from_args(args, args.tokens) == EpSweep("cpu", warmup=10, iters=20, ep_sizes=[1, 4])

"""What the parsers share: the help formatter, a subcommand's parser, and the options several
subcommands or bench modes take. Torch-free, like every module of ``cli.parsers``."""

from __future__ import annotations

import argparse

from ...bench.defaults import DEVICE_DEFAULTS, WIRES
from ...config import DISPATCHER_NAMES, PRESETS
from ..usage import EXAMPLES


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions kept as laid out; every option's default appended to its help, unless it has none
    worth showing (None: the help says what happens; a flag) or the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default == argparse.SUPPRESS  # not 0: 0 == False
        if not action.option_strings or nothing or "default" in text:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"  # help strings are %-formatted


class BenchHelpFormatter(HelpFormatter):
    """``HelpFormatter`` for the bench modes: options' help a little further right, so each option
    name, ``[N ...]`` included, shares its line with its help."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=28)


RANKS_HELP = (
    "ranks to start (default: every GPU on CUDA, 2 on CPU); more ranks than GPUs share them round-robin "
    "(a functional run: correctness, not wire speed)"
)
EXPERT_DTYPES = ("bf16", "fp8")  # --expert-dtype choices; bf16 is the layer's own dtype (expert_dtype=None)
# --policy choices: moe_sbo.eplb.PLACEMENT_POLICIES, named here without importing torch (a test holds them equal).
PLACEMENT_POLICY_NAMES = ("trivial", "global", "hierarchical")
# The end of every bench sweep's --help description.
SWEEP_NOTES = """\
Defaults: on GPUs a DeepSeek-V3 layer; on CPU ranks a smoke run of the tiny
preset (not GPU numbers). Every option and field: docs/BENCH_OPTIONS.md."""
SKEW_HELP = (
    "the expert load: zipf:S (Zipf popularity of exponent S >= 0 over the experts in a seeded random order; "
    "zipf:0 is even) or a load file written by bench eplb --record-load"
)


def add_command(subparsers, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand's parser: ``summary`` for the list, ``description`` (plain text) for its --help."""
    return subparsers.add_parser(
        name, help=summary, description=description, epilog=EXAMPLES.get(name), formatter_class=HelpFormatter
    )


def add_expert_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--expert-dtype``: the routed experts' weight format, as ``MoELayer(expert_dtype=...)`` takes it."""
    p.add_argument(
        "--expert-dtype",
        default=None,
        choices=EXPERT_DTYPES,
        help="routed experts' weights: fp8 = float8 e4m3 with one scale per 128x128 block (DeepSeek-V3's "
        "format; hidden and moe intermediate sizes must be multiples of 128); bf16 (the default) = in "
        "--dtype, like every other weight",
    )


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """``--device``: where the ranks run."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if a GPU is visible")


def device_default(key: str, what: str) -> str:
    """``what``, then the GPU and CPU defaults of ``DEVICE_DEFAULTS[key]``."""
    gpu, cpu = (" ".join(map(str, v)) if isinstance(v, list) else v for v in DEVICE_DEFAULTS[key])
    return f"{what} (default: {gpu}; CPU: {cpu})"


def add_tokens_arg(group) -> None:
    """``--tokens``: the bench modes that sweep tokens per rank (``sbo``, ``eplb``)."""
    group.add_argument(
        "--tokens", type=int, nargs="+", default=None, metavar="T", help=device_default("tokens", "tokens per rank")
    )


def add_sweep_arguments(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The options every bench sweep (``sbo``, ``tbo``, ``eplb``) takes, in groups a mode adds its own
    options to (returned by name: ``what``, ``ranks``, ``timing``, ``output``): the model and the
    dispatchers, the ranks and their wire, the timing, the output. Help one line each where it can:
    the detail is in docs/BENCH_OPTIONS.md."""
    groups = {
        "what": p.add_argument_group("what to time"),
        "ranks": p.add_argument_group("ranks and wire"),
        "timing": p.add_argument_group("timing"),
        "output": p.add_argument_group("output"),
    }
    what = groups["what"]
    what.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        metavar="NAME",
        help=device_default("preset", "model shapes"),
    )
    what.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="routed experts, a sweep each (default: preset's)",
    )
    what.add_argument(
        "--dispatcher",
        nargs="+",
        default=["all"],
        metavar="D",
        help=f"among {', '.join(sorted(DISPATCHER_NAMES))}, or all",
    )
    what.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        metavar="DTYPE",
        help="float32, bfloat16 (default: bfloat16, CPU float32)",
    )
    what.add_argument(
        "--expert-dtype",
        default=None,
        choices=EXPERT_DTYPES,
        metavar="DTYPE",
        help="experts' weights: bf16 (as --dtype) or fp8",
    )
    ranks = groups["ranks"]
    ranks.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        metavar="DEV",
        help="auto (cuda if a GPU), cpu, cuda",
    )
    ranks.add_argument("--ranks", type=int, default=None, metavar="N", help="EP size (default: every GPU; CPU: 2)")
    ranks.add_argument(
        "--wire",
        default="nvlink",
        choices=WIRES,
        metavar="WIRE",
        help="nvlink (default) or emulated-internode",
    )
    ranks.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl", "symm_mem", "copy_engine"],
        metavar="NAME",
        help="low_latency's: auto (default), nccl, symm_mem, copy_engine",
    )
    ranks.add_argument("--index-rows", action="store_true", help="low_latency: experts read rows in place")
    ranks.add_argument(
        "--sm-budget", type=int, default=None, metavar="SMS", help="combine_sm's SMs (default: all but 32)"
    )
    timing = groups["timing"]
    timing.add_argument("--warmup", type=int, default=None, metavar="N", help=device_default("warmup", "untimed calls"))
    timing.add_argument("--iters", type=int, default=None, metavar="N", help=device_default("iters", "timed calls"))
    timing.add_argument("--no-graph", action="store_true", help="no CUDA-graph rows")
    timing.add_argument(
        "--graph-max-tokens", type=int, default=512, metavar="T", help="most tokens/rank timed from graphs"
    )
    timing.add_argument("--seed", type=int, default=0, metavar="N", help="seed of weights and inputs")
    output = groups["output"]
    output.add_argument(
        "--out", default=None, metavar="PATH", help="JSON file of {meta, rows}, kept every step; -: standard output"
    )
    output.add_argument("--detail", action="store_true", help="every row and phase, the memory's parts")
    output.add_argument("-h", "--help", action="help", help="show this help and exit")
    return groups


def add_ep_sweep_args(p: argparse.ArgumentParser, file_name: str, iters: int) -> None:
    """The options of the EP-size sweeps (``bench foundation``, ``low-latency``, ``prefill``; resolved by
    ``bench.ep_sweep.EpSweep``); ``iters``: the default timed calls (``--quick``: 3)."""
    p.add_argument("--out", required=True, help=f"directory for {file_name}")
    p.add_argument(
        "--ranks", type=int, nargs="+", default=None, help="EP sizes, one pool each (default: every GPU; 2 on CPU)"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; --quick 1)")
    p.add_argument("--iters", type=int, default=None, help=f"timed calls (default {iters}; --quick 3)")
    p.add_argument("--quick", action="store_true", help="few iterations: a smoke run, not a measurement")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(default_iters=iters)

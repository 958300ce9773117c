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


RANKS_HELP = (
    "ranks to start (default: every GPU on CUDA, 2 on CPU); more ranks than GPUs share them round-robin "
    "(a functional run: correctness, not wire speed)"
)
EXPERT_DTYPES = ("bf16", "fp8")  # --expert-dtype choices; bf16 is the layer's own dtype (expert_dtype=None)
# --policy choices: moe_sbo.eplb.PLACEMENT_POLICIES, named here without importing torch (a test holds them equal).
PLACEMENT_POLICY_NAMES = ("trivial", "global", "hierarchical")
# The end of every bench sweep's --help description.
SWEEP_NOTES = """\
Rows go to --out (JSON) after every step; a step that fails on a rank becomes an error row, and
after a rank is killed or runs out of memory the sweep stops.

Defaults depend on the device: on GPUs a DeepSeek-V3 layer at realistic sizes; on CPU ranks the
tiny preset at a few tokens, a smoke run of the whole sweep (CPU times are not GPU numbers). Before
any rank starts, a per-rank memory estimate is printed and a run that cannot fit is refused."""
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
    return f"{what} (default: {gpu}; on CPU: {cpu})"


def add_tokens_arg(p: argparse.ArgumentParser) -> None:
    """``--tokens``: the bench modes that sweep tokens per rank (``sbo``, ``eplb``)."""
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=device_default("tokens", "tokens per rank"))


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The options every bench sweep (``sbo``, ``tbo``, ``eplb``) takes: the model, the dispatchers, the
    ranks and their wire, the timing, the result file."""
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        metavar="NAME",
        help=device_default("preset", f"model shapes, one of {', '.join(sorted(PRESETS))}"),
    )
    add_expert_dtype_arg(p)
    p.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=None,
        help="routed experts in total, one sweep each (default: the preset's; label: experts per GPU)",
    )
    p.add_argument("--dispatcher", nargs="+", default=["all"], help=f"among {sorted(DISPATCHER_NAMES)}, or all")
    p.add_argument("--ranks", type=int, default=None, help=f"EP size: {RANKS_HELP}")
    add_device_arg(p)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument(
        "--sm-budget",
        type=int,
        default=None,
        help="SMs for the shared experts in combine_sm (default: all but the 32 left to communication)",
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl", "symm_mem", "copy_engine"],
        help="low_latency's transport (auto: symmetric memory on CUDA from 2 GPUs, else NCCL; copy_engine: "
        "peer copies, no SMs in flight)",
    )
    p.add_argument(
        "--index-rows",
        action="store_true",
        help="low_latency's index_rows: the experts read the received rows in place through the layout's "
        "index instead of a copy in expert order (rows record index_rows)",
    )
    p.add_argument(
        "--wire",
        default="nvlink",
        choices=WIRES,
        help="the link between the ranks: nvlink (the GPUs' own), or emulated-internode: NCCL with "
        "NCCL_P2P_DISABLE=1, so its traffic goes through host memory (24 GB/s all-to-all measured at "
        "236 MB on 2x H200, an inter-node-class wire on one host); CUDA and >= 2 ranks only. "
        "low_latency then uses --transport nccl: symm_mem and copy_engine write the peer's memory over "
        "NVLink, outside NCCL, so they cannot emulate the slower wire (auto becomes nccl; asking for "
        "them is refused)",
    )
    p.add_argument("--warmup", type=int, default=None, help=device_default("warmup", "untimed calls first"))
    p.add_argument("--iters", type=int, default=None, help=device_default("iters", "timed calls"))
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph rows")
    p.add_argument("--graph-max-tokens", type=int, default=512, help="largest tokens/rank timed as graph replays")
    p.add_argument("--out", default=None, help="JSON file for {meta, rows}; -: standard output (default: none written)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")


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

"""``moe-sbo bench <mode>``: the registry of bench modes and the ``bench`` parser, one subparser per mode.

Each mode names its parser module (torch-free, in this package: ``add_arguments(parser)`` and a
plain-text ``DESCRIPTION``) and its runner module (``moe_sbo.bench.<mode>``: ``main(args) -> int``),
which ``cli.bench`` imports only when that mode runs, so ``--help`` of every mode answers without torch.
A mode is added here and nowhere else in the command line.
"""

from __future__ import annotations

import argparse
import importlib

from .common import BenchHelpFormatter

# mode -> (one-line help, parser module, runner module).
BENCH_MODES: dict[str, tuple[str, str, str]] = {
    "sbo": ("overlap modes x dispatchers x token counts", "moe_sbo.cli.parsers.bench_sbo", "moe_sbo.bench.sbo"),
    "tbo": (
        "a decoder layer without and with two-batch overlap",
        "moe_sbo.cli.parsers.bench_tbo",
        "moe_sbo.bench.tbo",
    ),
    "eplb": (
        "rank load and layer time before and after a rebalance",
        "moe_sbo.cli.parsers.bench_eplb",
        "moe_sbo.bench.eplb",
    ),
    "foundation": (
        "eager dispatchers per phase per EP size; grouped vs dense GEMM",
        "moe_sbo.cli.parsers.bench_foundation",
        "moe_sbo.bench.foundation",
    ),
    "low-latency": (
        "low_latency at decode sizes, eager and replayed, vs raw NCCL",
        "moe_sbo.cli.parsers.bench_low_latency",
        "moe_sbo.bench.low_latency",
    ),
    "prefill": (
        "low_latency at prefill sizes vs the wire and compute floor",
        "moe_sbo.cli.parsers.bench_prefill",
        "moe_sbo.bench.prefill",
    ),
    "dense-experts": (
        "dense experts' GEMV, tiled GEMM, torch._grouped_mm (one GPU)",
        "moe_sbo.cli.parsers.bench_dense_experts",
        "moe_sbo.bench.dense_experts",
    ),
    "fp8-experts": (
        "FP8 experts vs bf16 on one GPU: the MLP, the layer, the GEMMs",
        "moe_sbo.cli.parsers.bench_fp8_experts",
        "moe_sbo.bench.fp8_experts",
    ),
    "router": (
        "the router's selection: torch ops vs the fused Triton kernel",
        "moe_sbo.cli.parsers.bench_router",
        "moe_sbo.bench.router",
    ),
    "generate": (
        "a DeepSeek-V3-shaped model: transformers vs moe-sbo, N ranks",
        "moe_sbo.cli.parsers.bench_generate",
        "moe_sbo.bench.generate",
    ),
    "deep-ep": (
        "moe_sbo.deep_ep's LL dispatch + combine vs the native path",
        "moe_sbo.cli.parsers.bench_deep_ep",
        "moe_sbo.bench.deep_ep",
    ),
    "load-memory": (
        "host memory a rank adds loading a whole model (CPU ranks)",
        "moe_sbo.cli.parsers.bench_load_memory",
        "moe_sbo.bench.load_memory",
    ),
}
DEFAULT_MODE = "sbo"  # ``moe-sbo bench [options]`` with no mode runs it
# Flags that chose a mode before modes were positional: refused with the spelling that replaces them.
MODE_FLAGS = {"--tbo": "tbo", "--eplb": "eplb"}

SUMMARY = "benchmarks on N ranks, one mode each: sbo (the default), tbo, eplb, ... (GPUs; CPU: a smoke run)"


def description() -> str:
    """``moe-sbo bench --help``'s text: the modes, one line each."""
    width = max(map(len, BENCH_MODES))
    modes = "\n".join(f"  {mode:<{width}}  {help_}" for mode, (help_, _, _) in BENCH_MODES.items())
    return (
        "Benchmarks of the MoE layer on N local ranks (GPUs; on CPU ranks a quick smoke\nrun), one mode each:\n"
        f"{modes}\n\n"
        f"moe-sbo bench with no mode runs {DEFAULT_MODE}.\nOptions of one mode: moe-sbo bench MODE --help."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subparser per mode of ``BENCH_MODES``, its options added by its parser module."""
    parser.usage = "%(prog)s [-h] [MODE] [options]"  # MODE: its list is in the description
    modes = parser.add_subparsers(dest="mode", metavar="MODE", help=argparse.SUPPRESS, prog="moe-sbo bench")
    for mode, (help_, parser_module, _) in BENCH_MODES.items():
        module = importlib.import_module(parser_module)
        # -h is in the mode's output group (``common.add_sweep_arguments``): no group of its own.
        sub = modes.add_parser(
            mode, help=help_, description=module.DESCRIPTION, formatter_class=BenchHelpFormatter, add_help=False
        )
        module.add_arguments(sub)
        if not any("-h" in action.option_strings for action in sub._actions):  # a mode without groups
            sub.add_argument("-h", "--help", action="help", help="show this help and exit")


def with_mode(argv: list[str]) -> list[str]:
    """``argv`` (what follows ``bench``) with ``DEFAULT_MODE`` put first when it names no mode.
    ``ValueError`` for a flag that chose a mode before modes were positional (``--tbo``, ``--eplb``)."""
    old = next((a for a in argv if a in MODE_FLAGS), None)
    if old is not None and argv[0] not in BENCH_MODES:
        raise ValueError(
            f"the bench mode is a word after bench, not a flag, got {old}; "
            f"run moe-sbo bench {MODE_FLAGS[old]} [options] (modes: {', '.join(BENCH_MODES)})"
        )
    if argv and (argv[0] in BENCH_MODES or argv[0] in ("-h", "--help") or not argv[0].startswith("-")):
        return argv  # a mode, bench's own help, or a word argparse refuses as an unknown mode
    return [DEFAULT_MODE, *argv]

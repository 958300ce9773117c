"""The command line's parsers: the ``moe-sbo`` parser, then one module per subcommand (``demo``,
``bench``, ``check``, ``generate``, ``plan``) and one per bench mode (``bench_<mode>``), each with
``add_arguments(parser)`` and its plain-text ``DESCRIPTION``; shared options in ``common``.

The hard part is speed: ``moe-sbo --help``, ``--version`` and every usage error must answer at once,
so nothing in this package imports torch (seconds to import) or a module that does; the names offered
come from ``moe_sbo.config``, and each subcommand's module (which needs torch) is imported only to run it.
``--help`` texts are the descriptions here (plain text), not the modules' docstrings.
"""

from __future__ import annotations

import argparse
import sys

from ..usage import VersionAction
from . import bench, check, demo, generate, plan
from .common import HelpFormatter, add_command

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The subcommands, in the order DESCRIPTION lists them: name -> parser module.
COMMANDS = {"demo": demo, "bench": bench, "check": check, "generate": generate, "plan": plan}

DESCRIPTION = """\
Expert-parallel MoE layers with communication/computation overlap, on local ranks.

subcommands:
  demo    run every dispatcher on local ranks and compare it with a single-rank layer
  bench   benchmarks on N ranks, one mode each: sbo (overlap modes x dispatchers x token counts),
          tbo, eplb, foundation, low-latency, prefill, dense-experts, fp8-experts, router, ...
  check   run one MoE layer of a Hugging Face checkpoint against transformers' own module
  generate  generate with a Hugging Face MoE model whose MoE layers are expert parallel
  plan    communication budget: bytes, bandwidth and which overlap fits (no GPU needed)
"""

EPILOG = """\
Bad options exit 2 before any rank starts; a failing rank exits 1 with its traceback.
Options of one subcommand: moe-sbo COMMAND --help."""


def build_parser() -> argparse.ArgumentParser:
    """The ``moe-sbo`` parser: global options, then one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="moe-sbo",
        usage="%(prog)s [-h] [--version] [-v] [--log-level LEVEL] COMMAND ...",  # COMMAND: its list is hidden
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument(
        "-v", "--verbose", action="count", default=None, help="log the library's INFO messages; -vv: DEBUG too"
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=None,
        metavar="LEVEL",
        help=f"log level of the library's loggers (moe_sbo.*), one of {', '.join(LOG_LEVELS)}; overrides -v",
    )
    # The subcommands are listed in DESCRIPTION, in this order: argparse's own list would repeat it.
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="moe-sbo"
    )
    for name, module in COMMANDS.items():
        description = module.description() if name == "bench" else module.DESCRIPTION
        module.add_arguments(add_command(subparsers, name, module.SUMMARY, description))
    return parser


def command_index(argv: list[str]) -> int | None:
    """Where the subcommand's name is in ``argv``: the first word that is not a global option or the
    value of ``--log-level``; None when there is none."""
    skip = False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return index
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (default: the process's) parsed; ``moe-sbo bench`` with no mode runs the default
    mode (``bench.with_mode``). A usage error exits 2 with one line naming it, ``--help`` exits 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    index = command_index(argv)
    if index is not None and argv[index] == "bench":
        try:
            argv[index + 1 :] = bench.with_mode(argv[index + 1 :])
        except ValueError as err:
            parser.exit(2, f"moe-sbo bench: error: {err}\n")
    return parser.parse_args(argv)

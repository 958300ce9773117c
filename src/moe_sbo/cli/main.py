"""``moe-sbo``: the command line, one module per subcommand: ``demo`` (dispatchers vs one rank),
``bench`` (overlap modes on GPUs or CPU ranks), ``check`` (a real checkpoint's MoE layer vs
``transformers``), ``generate`` (a whole model with expert-parallel MoE layers), ``plan``
(communication budget).

Every subcommand checks its options before any rank starts; a bad value exits 2 with a message
naming it, a failing rank exits 1 with that rank's traceback. ``--help`` texts are the parsers' own
plain-text descriptions (``DESCRIPTION`` here, one per subcommand module), not these docstrings.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..runtime import RankError
from . import bench, check, demo, generate, plan
from .options import LOG_LEVELS, HelpFormatter, configure_logging, log_level

DESCRIPTION = """\
Expert-parallel MoE layers with communication/computation overlap, on local ranks.

subcommands:
  demo    run every dispatcher on local ranks and compare it with a single-rank layer
  bench   time overlap modes x dispatchers x token counts (GPUs; CPU ranks: a quick smoke run)
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
    parser.add_argument("--version", action="version", version=f"moe-sbo {__version__}")
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
    demo.add_demo_parser(subparsers)
    bench.add_bench_parser(subparsers)
    check.add_check_parser(subparsers)
    generate.add_generate_parser(subparsers)
    plan.add_plan_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(log_level(args.verbose, args.log_level))
    run = {
        "demo": demo.run_demo,
        "plan": plan.run_plan,
        "bench": bench.run_bench,
        "check": check.run_check,
        "generate": generate.run_generate,
    }
    try:
        return run[args.command](args)
    except ValueError as err:
        print(f"moe-sbo {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RankError as err:  # a rank failed: its traceback is in the message, the other ranks were stopped
        print(f"moe-sbo {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

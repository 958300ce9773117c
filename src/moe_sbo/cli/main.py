"""``moe-sbo``: the command line, one module per subcommand: ``demo`` (dispatchers vs one rank),
``bench`` (overlap modes on GPUs or CPU ranks), ``check`` (a real checkpoint's MoE layer vs
``transformers``), ``plan`` (communication budget).

Every subcommand checks its options before any rank starts; a bad value exits 2 with a message
naming it, a failing rank exits 1 with that rank's traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..runtime import RankError
from . import bench, check, demo, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-sbo", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    demo.add_demo_parser(subparsers)
    plan.add_plan_parser(subparsers)
    bench.add_bench_parser(subparsers)
    check.add_check_parser(subparsers)
    run = {"demo": demo.run_demo, "plan": plan.run_plan, "bench": bench.run_bench, "check": check.run_check}
    args = parser.parse_args(argv)
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

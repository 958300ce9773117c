"""``moe-sbo``: the command line, one module per subcommand: ``demo`` (dispatchers vs one rank),
``bench <mode>`` (timings on GPUs or CPU ranks), ``check`` (a real checkpoint's MoE layer vs
``transformers``), ``generate`` (a whole model with expert-parallel MoE layers), ``plan``
(communication budget).

Every subcommand checks its options before any rank starts; a bad value exits 2 with a message
naming it, a failing rank exits 1 with that rank's traceback. ``--help`` texts are the parsers' own
plain-text descriptions (``parsers/``), not these docstrings.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading

from .. import env
from ..launch.signals import signals_deferred
from .parsers import parse_args

# The subcommands (and torch) are imported inside ``_run``, where a Ctrl-C is caught: at the prompt a
# user may interrupt while torch is still importing, and must get one line, not a traceback (or an
# abort from inside a native library: ``launch.signals``). The
# parser imports neither: ``--help``, ``--version`` and usage errors answer without torch.

INTERRUPTED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM as an exception, so it unwinds like Ctrl-C: the ranks are stopped on the way out."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """``moe-sbo``: parse, run the subcommand; its exit status (0 ok, 1 a rank failed, 2 bad input,
    130 / 143 interrupted by SIGINT / SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    command = next((a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("-")), "")
    try:
        args = parse_args(argv)
        command = args.command
        return _run(args)
    except KeyboardInterrupt:
        return _interrupted(command, signal.SIGINT)
    except Terminated:
        return _interrupted(command, signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def entry() -> int:
    """The ``moe-sbo`` executable: ``main``, then an exit that a late Ctrl-C or SIGTERM cannot turn
    into a traceback (the ranks are already stopped; what is left is the interpreter's own exit)."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if code in INTERRUPTED_CODES or env.torchrun_rank() is not None:
        # Skip the interpreter's finalisation once the work is done. Interrupted, the ranks are
        # stopped, and under load that finalisation was seen to end the process by the signal itself
        # (status -2) after the line above was printed. As a torchrun rank, its C++ teardown was seen
        # to abort a gloo rank ("terminate called without an active exception", SIGABRT) after its
        # results were written, about one run in ten, with or without the process group destroyed.
        # First the closed queues' feeder threads finish, and a collection runs the finalisers that
        # unlink the queues' semaphores (else multiprocessing's resource tracker warns about them).
        for thread in threading.enumerate():
            if thread.name == "QueueFeederThread":
                try:
                    thread.join(timeout=1.0)
                except RuntimeError:  # listed while still starting (the signal came mid-start): nothing to flush
                    pass
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _interrupted(command: str, signum: signal.Signals) -> int:
    """One line, no traceback; the shell's status for a signal: 128 + its number (130, 143)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
    print(f"moe-sbo{' ' + command if command else ''}: interrupted ({signum.name})", file=sys.stderr)
    return 128 + signum


def _run(args: argparse.Namespace) -> int:
    # Held while torch and Triton import: a signal inside their native libraries can abort the process.
    with signals_deferred():
        from ..launch.failures import RankError
        from ..measure.options import configure_logging, log_level
        from . import bench, check, demo, generate, plan

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
    sys.exit(entry())

"""``moe-sbo``: the command line. Sub-commands: ``demo`` (dispatchers vs one rank), ``plan``
(communication budget), ``check`` (a real checkpoint's MoE layer vs ``transformers``)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from .bench import add_bench_parser, run_bench
from .check_cli import add_check_parser, run_check
from .config import PRESETS
from .dispatch import DISPATCHERS
from .overlap import OVERLAP_MODES
from .plan_cli import add_plan_parser, run_plan
from .runtime import RankError


def make_console() -> Console:
    """A console that keeps wide tables readable when output is piped (rich assumes 80 columns)."""
    return Console(width=None if sys.stdout.isatty() else 160)


def _add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run every dispatcher on local ranks and compare with one rank")
    p.add_argument("--ranks", type=int, default=None, help="ranks to start (default: 4 on CPU, every GPU on CUDA)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dispatcher", default="all", help=f"one of {sorted(DISPATCHERS)}, or all")
    p.add_argument("--tbo", action="store_true",
                   help="put the MoE in a decoder layer (attention + MoE) run with two-batch overlap")
    p.add_argument("--overlap", default="none",
                   help=f"one of {list(OVERLAP_MODES)}, or all; other than none, none runs too for comparison")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--iters", type=int, default=5, help="timed forwards per dispatcher (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON ({meta, rows})")
    p.add_argument("--checkpoint", metavar="DIR", help="run MoE layer --layer of this Hugging Face model "
                   "directory instead of --preset with random weights (see docs/CHECKPOINTS.md)")
    p.add_argument("--layer", type=int, default=None, help="with --checkpoint: layer index (default: first MoE layer)")


def run_demo(args: argparse.Namespace) -> int:
    from .bench_meta import default_dtype_name, result_meta
    from .demo import run_demo_rank, summarise
    from .runtime import LocalRanks, default_world_size, resolve_device

    device = resolve_device(args.device)
    ranks = args.ranks or default_world_size(device)
    names = sorted(DISPATCHERS) if args.dispatcher == "all" else [args.dispatcher]
    for name in names:
        if name not in DISPATCHERS:
            raise ValueError(f"--dispatcher must be one of {sorted(DISPATCHERS)} or all, got {name!r}")
    if args.tokens < 0:
        raise ValueError(f"--tokens must be >= 0, got {args.tokens}")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    overlaps = _overlap_modes(args.overlap)
    model = PRESETS[args.preset]
    if args.checkpoint:  # checked before any rank starts: config.json, the layer, every tensor header
        from .checkpoint import Checkpoint

        checkpoint = Checkpoint(args.checkpoint)
        args.layer, model = checkpoint.validate_layer(args.layer), checkpoint.moe_config
    model.experts_per_rank(ranks)  # raises before any rank starts if they do not divide
    dtype = args.dtype or default_dtype_name(device)

    console = make_console()
    source = f"{args.checkpoint} layer {args.layer}" if args.checkpoint else f"preset {args.preset}"
    console.print(f"[bold]moe-sbo demo[/]: {source}, {ranks} {device} ranks, "
                  f"{args.tokens} tokens/rank, {dtype}"
                  + (", decoder layer with two-batch overlap" if args.tbo else ""))
    with LocalRanks(ranks, device=device) as workers:
        per_rank = workers.run(run_demo_rank, args.preset, names, args.tokens, args.seed, dtype, args.iters,
                               overlaps, checkpoint=args.checkpoint, layer_index=args.layer, tbo=args.tbo)
    rows = summarise(per_rank)

    table = Table(title="each dispatcher vs the single-rank reference (times: slowest rank, median)")
    for col in ("dispatcher", "overlap", "max |err|", "rel err", "match", "= none", "sent B/rank", "recv B/rank",
                "route µs", "dispatch µs", "experts µs", "combine µs", "layer µs"):
        table.add_column(col, justify="left" if col in ("dispatcher", "overlap", "match", "= none") else "right")
    for r in rows:
        table.add_row(r["dispatcher"], r["overlap"], f"{r['max_abs_err']:.2e}", f"{r['rel_err']:.2e}",
                      "[green]yes[/]" if r["ok"] else "[red]NO[/]",
                      "bitwise" if r["same_as_none"] else "no", f"{r['bytes_sent']:,}",
                      f"{r['bytes_recv']:,}", *(f"{r[k]:.0f}" for k in
                      ("t_route_us", "t_dispatch_us", "t_experts_us", "t_combine_us", "t_layer_us")))
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": result_meta(device=device, world_size=ranks), "rows": rows}, f, indent=1)
        console.print(f"rows written to {args.json}")
    # On CPU every mode must equal none bitwise; on GPU the SM budget may pick other GEMM kernels.
    return 0 if all(r["ok"] and (r["same_as_none"] or device == "cuda") for r in rows) else 1


def _overlap_modes(choice: str) -> tuple[str, ...]:
    """``--overlap`` -> the modes to run, ``none`` first (the others are compared with it)."""
    if choice == "all":
        return OVERLAP_MODES
    if choice not in OVERLAP_MODES:
        raise ValueError(f"--overlap must be one of {list(OVERLAP_MODES)} or all, got {choice!r}")
    return ("none",) if choice == "none" else ("none", choice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-sbo", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo_parser(subparsers)
    add_plan_parser(subparsers)
    add_bench_parser(subparsers)
    add_check_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "check":
            return run_check(args)
    except ValueError as err:
        print(f"moe-sbo {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RankError as err:  # a rank failed: its traceback is in the message, the other ranks were stopped
        print(f"moe-sbo {args.command}: {err}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The command line's parsers: the ``moe-sbo`` parser and one per subcommand, with their help texts.

The hard part is speed: ``moe-sbo --help``, ``--version`` and every usage error must answer at once,
so nothing here imports torch (seconds to import) or a module that does; the names offered come from
``moe_sbo.config``, and each subcommand's module (which needs torch) is imported only to run it.
``--help`` texts are the descriptions here (plain text), not the modules' docstrings.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from .. import __version__, planner
from ..config import DECODE_LOOPS, DISPATCHER_NAMES, MLA_STEPS, OVERLAP_MODES, PRESETS

# ---- shared pieces -------------------------------------------------------------------------------


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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
RANKS_HELP = (
    "ranks to start (default: every GPU on CUDA, 2 on CPU); more ranks than GPUs share them round-robin "
    "(a functional run: correctness, not wire speed)"
)
EXPERT_DTYPES = ("bf16", "fp8")  # --expert-dtype choices; bf16 is the layer's own dtype (expert_dtype=None)
# --policy choices: moe_sbo.eplb.PLACEMENT_POLICIES, named here without importing torch (a test holds them equal).
PLACEMENT_POLICY_NAMES = ("trivial", "global", "hierarchical")
SKEW_HELP = (
    "the expert load: zipf:S (Zipf popularity of exponent S >= 0 over the experts in a seeded random order; "
    "zipf:0 is even) or a load file written by bench --eplb --record-load"
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


def output_file(flag: str, value: str | None) -> Path | None:
    """The file ``flag`` (``--json``, ``--out``, ...) names, ready to be written: its folder is made
    now, before any work, as every subcommand does, so writing the results cannot fail after the
    work. ``ValueError`` (exit 2) for a path that names a folder or cannot be written; None for None."""
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{flag} must name a file, got the folder {value}; add a file name, e.g. {path / 'out.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        existing = next(p for p in path.parents if p.exists())
        why = f"{existing} is a file" if not existing.is_dir() else err.strerror
        raise ValueError(
            f"{flag} must be in a folder that can be made, got {value}: {why}; choose another path"
        ) from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} must be a path this user can write, got {value}; choose another path")
    return path


def add_command(subparsers, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand's parser: ``summary`` for the list, ``description`` (plain text) for its --help."""
    return subparsers.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """``--device``: where the ranks run."""
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if a GPU is visible")


# ---- moe-sbo -------------------------------------------------------------------------------------

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
    add_demo_parser(subparsers)
    add_bench_parser(subparsers)
    add_check_parser(subparsers)
    add_generate_parser(subparsers)
    add_plan_parser(subparsers)
    return parser


# ---- demo ----------------------------------------------------------------------------------------

DEMO_DESCRIPTION = """\
Run every dispatcher (or --dispatcher) on N local ranks and compare each rank's output with the
single-rank reference layer (dispatcher local: all experts, same seed, so the same weights). Shows
the error, the bytes each rank sent and the time of each phase; --overlap all also checks every
overlap mode against none. Exit code 0 only if every run matches."""


def add_demo_parser(subparsers) -> None:
    p = add_command(
        subparsers, "demo", "run every dispatcher on local ranks and compare with one rank", DEMO_DESCRIPTION
    )
    p.add_argument("--ranks", type=int, default=None, help=RANKS_HELP)
    p.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"model shapes: {', '.join(sorted(PRESETS))}",
    )
    p.add_argument("--dispatcher", default="all", help=f"one of {sorted(DISPATCHER_NAMES)}, or all")
    p.add_argument(
        "--tbo", action="store_true", help="put the MoE in a decoder layer (attention + MoE) run with two-batch overlap"
    )
    p.add_argument(
        "--overlap",
        default="none",
        help=f"one of {list(OVERLAP_MODES)}, or all; other than none, none runs too for comparison",
    )
    p.add_argument(
        "--eplb",
        action="store_true",
        help="expert load balancing: each layer with one redundant expert slot per rank (none on one rank), its "
        "router skewed to a Zipf(1) load; shows the rank load before and after a rebalance, the experts moved, "
        "and checks the output against the reference both times",
    )
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    add_device_arg(p)
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA"
    )
    add_expert_dtype_arg(p)
    p.add_argument("--iters", type=int, default=5, help="timed forwards per dispatcher (after one warm-up)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON ({meta, rows})")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="run MoE layer --layer of this Hugging Face model "
        "directory instead of --preset with random weights (see docs/CHECKPOINTS.md)",
    )
    p.add_argument("--layer", type=int, default=None, help="with --checkpoint: layer index (default: first MoE layer)")


# ---- bench ---------------------------------------------------------------------------------------

# Defaults per device, (GPU, CPU), for options left out. The GPU ones measure; the CPU ones only show
# that the sweep works, in well under two minutes on two cores (a DeepSeek-sized layer would not even
# fit in a laptop's memory). Values given on the command line are kept as they are.
DEVICE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "preset": ("deepseek-v3", "tiny"),
    "tokens": ([128, 512, 2048, 4096, 8192], [16, 64]),
    "warmup": (5, 1),
    "iters": (20, 3),
    "prefill_tokens": ([4096, 8192], [128]),
    "decode_seqs": ([32, 64, 128, 256], [4, 16]),
    "kv_len": (2048, 64),
    "heads": (128, 4),
    "kv_heads": (8, 2),
    "head_dim": (128, 16),
}

# Links a sweep can run over (``--wire``); what emulated-internode changes: ``bench.EMULATED_INTERNODE_ENV``.
WIRES = ("nvlink", "emulated-internode")

BENCH_DESCRIPTION = """\
Time the MoE layer on N ranks: every overlap mode x dispatcher x token count (single-batch overlap),
or with --tbo a decoder layer (attention + MoE) without and with two-batch overlap, or with --eplb
expert load balancing on a skewed router (rank load before and after a rebalance, its cost, the
layer time). Rows go to --out (JSON) after every step; a step that fails on a rank becomes an error
row, and after a rank is killed or runs out of memory the sweep stops. Each mode's efficiency and
speedup are measured against overlap none.

Defaults depend on the device: on GPUs a DeepSeek-V3 layer at realistic sizes; on CPU ranks the
tiny preset at a few tokens, a smoke run of the whole sweep (CPU times are not GPU numbers). Before
any rank starts, a per-rank memory estimate is printed and a run that cannot fit is refused."""


def gemm_sm_budget_arg(text: str) -> int | str | None:
    """``--tbo-gemm-sm-budget``: a number of SMs, ``auto`` or ``all`` (None: no budget)."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a number of SMs, 'auto' or 'all', got {text!r}")


def _device_default(key: str, what: str) -> str:
    gpu, cpu = (" ".join(map(str, v)) if isinstance(v, list) else v for v in DEVICE_DEFAULTS[key])
    return f"{what} (default: {gpu}; on CPU: {cpu})"


def add_bench_parser(subparsers) -> None:
    p = add_command(
        subparsers,
        "bench",
        "time overlap modes x dispatchers x token counts on N ranks (GPUs; CPU: a smoke run)",
        BENCH_DESCRIPTION,
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        metavar="NAME",
        help=_device_default("preset", f"model shapes, one of {', '.join(sorted(PRESETS))}"),
    )
    add_expert_dtype_arg(p)
    p.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=None,
        help="routed experts in total, one sweep each (default: the preset's; label: experts per GPU)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=_device_default("tokens", "tokens per rank"))
    p.add_argument("--dispatcher", nargs="+", default=["all"], help=f"among {sorted(DISPATCHER_NAMES)}, or all")
    p.add_argument("--overlap", nargs="+", default=["all"], help=f"among {list(OVERLAP_MODES)}, or all")
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
    p.add_argument("--warmup", type=int, default=None, help=_device_default("warmup", "untimed calls first"))
    p.add_argument("--iters", type=int, default=None, help=_device_default("iters", "timed calls"))
    p.add_argument("--no-graph", action="store_true", help="no CUDA-graph rows")
    p.add_argument("--graph-max-tokens", type=int, default=512, help="largest tokens/rank timed as graph replays")
    p.add_argument("--out", default=None, help="JSON file for {meta, rows} (default: none written)")
    p.add_argument("--timeline", default=None, metavar="PNG", help="draw one forward per mode at --timeline-tokens")
    p.add_argument("--timeline-tokens", type=int, default=None, help="default: largest of --tokens up to 4096")
    p.add_argument("--trace", default=None, metavar="PREFIX", help="also keep Chrome traces PREFIX.<mode>.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    tbo = p.add_argument_group("two-batch overlap (--tbo): a decoder layer, attention + MoE")
    tbo.add_argument("--tbo", action="store_true", help="bench the decoder layer without and with TBO")
    tbo.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="*",
        default=None,
        help=_device_default("prefill_tokens", "prefill tokens per rank"),
    )
    tbo.add_argument(
        "--decode-seqs",
        type=int,
        nargs="*",
        default=None,
        help=_device_default("decode_seqs", "decode sequences per rank"),
    )
    tbo.add_argument(
        "--kv-len", type=int, default=None, help=_device_default("kv_len", "cached tokens per decode sequence")
    )
    tbo.add_argument("--heads", type=int, default=None, help=_device_default("heads", "attention heads"))
    tbo.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help=_device_default("kv_heads", "GQA key/value heads (8: about MLA's cache)"),
    )
    tbo.add_argument("--head-dim", type=int, default=None, help=_device_default("head_dim", "attention head dimension"))
    tbo.add_argument(
        "--delay",
        type=int,
        nargs="+",
        default=[0, 1],
        help="stages micro-batch A runs before B starts; one TBO row per value",
    )
    tbo.add_argument(
        "--auto-tbo",
        action="store_true",
        help="also a row per overlap mode where TBO is on or off as moe_sbo.overlap.tbo_auto.AutoTbo "
        "chooses after timing both (with the first --delay); its choice is in the row",
    )
    tbo.add_argument(
        "--tbo-gemm-sm-budget",
        type=gemm_sm_budget_arg,
        default="auto",
        metavar="SMS|auto|all",
        help="CUDA: the SMs every GEMM under TBO plans for, leaving the others to the other micro-batch's "
        "transfer: a number, 'all', or 'auto' (default: all but the SMs the transfer holds, "
        "moe_sbo.overlap.tbo.resolve_gemm_sm_budget); the number used is in every TBO row as tbo_gemm_sm_budget",
    )
    eplb = p.add_argument_group(
        "expert load balancing (--eplb): per dispatcher, tokens and redundant count, the router skewed to "
        "--skew, the rank load and layer time before and after a rebalance (overlap none)"
    )
    eplb.add_argument("--eplb", action="store_true", help="bench expert load balancing")
    eplb.add_argument(
        "--redundant",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="redundant expert slots per rank, one case each (default: 0 1 2; 0 with --policy trivial or one rank)",
    )
    eplb.add_argument("--skew", default=None, metavar="zipf:S|PATH", help=f"{SKEW_HELP} (default: zipf:1)")
    eplb.add_argument(
        "--policy",
        default=None,
        choices=PLACEMENT_POLICY_NAMES,
        help="how the rebalance places experts (default: global); hierarchical: nodes of 8 ranks from "
        "16 ranks on, the model's expert groups",
    )
    eplb.add_argument(
        "--record-load",
        default=None,
        metavar="PATH",
        help="write the EP group's measured tokens per expert (every case's load window, summed) as JSON, "
        "for --skew PATH and plan --load",
    )


# ---- check ---------------------------------------------------------------------------------------

CHECK_DESCRIPTION = """\
Load one MoE layer of a Hugging Face checkpoint (config.json + safetensors), each rank reading only
its own experts, run every dispatcher on it, and compare each rank's output with transformers' own
MoE block for the model (built in this process on the whole layer, in float32). Tolerance, relative
L2 error per rank: 1e-5 with --dtype float32, 2e-2 with bfloat16, 6e-2 with --expert-dtype fp8
(e4m3 expert weights with 128x128 block scales; the reference runs on those weights dequantised, and
the experts' two e4m3 activation quantisations, ~2.6% RMS each, leave ~4%). Exit code 0 only if
every dispatcher on every rank is within it. The checkpoint is checked (config.json, layer, every
tensor name, shape and FP8 scale) before any rank starts."""


def add_check_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``check`` to an ``argparse`` subparsers object; returns the new parser."""
    parser = add_command(
        subparsers,
        "check",
        "load one MoE layer of a checkpoint, run every dispatcher, compare with transformers",
        CHECK_DESCRIPTION,
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="model directory: config.json + model.safetensors or model.safetensors.index.json",
    )
    parser.add_argument("--layer", type=int, default=None, help="decoder layer index (default: the first MoE layer)")
    parser.add_argument("--ranks", type=int, default=None, help=RANKS_HELP)
    parser.add_argument(
        "--dispatcher",
        default="all",
        help=f"one of {sorted(DISPATCHER_NAMES)}, or all (the expert-parallel ones; local on 1 rank)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="random tokens per rank")
    add_device_arg(parser)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="our layer's dtype; the transformers reference runs in float32",
    )
    add_expert_dtype_arg(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON ({meta, rows})")
    return parser


# ---- generate ------------------------------------------------------------------------------------

GENERATE_DESCRIPTION = """\
Generate with a Hugging Face MoE model (DeepSeek-V2/V3, Qwen3-MoE) whose MoE layers are expert
parallel: each rank holds the attention and dense layers whole and only its share of the routed
experts, runs its own prompts, and moves tokens to the experts' ranks with the dispatcher chosen.
Greedy decoding, ranks in step: it stops when every prompt on every rank has ended, or after
--max-new-tokens; on CUDA each decode step is replayed from a CUDA graph (--decode). Prints the
new tokens per prompt and per rank the prefill time, time per output token (TPOT) and tokens/s.
Under torchrun (torchrun --nproc-per-node N -m moe_sbo generate ...) it runs on torchrun's ranks;
rank 0 prints."""


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``generate`` to an ``argparse`` subparsers object."""
    parser = add_command(
        subparsers,
        "generate",
        "generate with a Hugging Face MoE model whose MoE layers are expert parallel",
        GENERATE_DESCRIPTION,
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="model directory (config.json + safetensors)"
    )
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--prompt", action="append", metavar="TEXT", help="a prompt (repeat for more); needs a tokenizer"
    )
    prompts.add_argument("--prompts-file", metavar="FILE", help="one prompt per line; needs a tokenizer")
    prompts.add_argument(
        "--prompt-ids", action="append", metavar="IDS", help="a prompt as token ids, e.g. 1,2,3 (repeat for more)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--ranks", type=int, default=None, help=RANKS_HELP)
    add_device_arg(parser)
    parser.add_argument(
        "--dispatcher", default="alltoall", choices=sorted(DISPATCHER_NAMES), help="how tokens reach the experts"
    )
    parser.add_argument("--overlap", default="none", choices=list(OVERLAP_MODES), help="where the shared experts run")
    parser.add_argument(
        "--decode",
        default="auto",
        choices=["auto", *DECODE_LOOPS],
        help="the decode loop: cuda_graph (each step replayed from a CUDA graph; the MoE layers decode "
        "through low_latency), static (the same fixed-shape steps, eager), transformers (model.generate); "
        "auto: cuda_graph on CUDA, static on CPU",
    )
    parser.add_argument(
        "--mla",
        default="absorbed",
        choices=MLA_STEPS,
        help="DeepSeek-V2/V3 decode attention: absorbed (in the latent space, reading the cache once) or "
        "transformers' own step (expands the whole cache every step); other families ignore it",
    )
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA, float32 on CPU"
    )
    add_expert_dtype_arg(parser)
    parser.add_argument("--json", metavar="PATH", help="write prompts, new tokens and timings as JSON")
    return parser


# ---- plan ----------------------------------------------------------------------------------------

PLAN_DESCRIPTION = """\
The communication-budget planner: bytes per token, per all-to-all and per decode step, the per-GPU
bandwidth a time-per-output-token target needs, and which overlap (single- or two-batch) fits. With
no options it reproduces the seed's DeepSeek-V3 decode example line by line, then shows what the
byte model adds, and the weights each GPU holds at a few EP sizes. With --load (or --skew) also the
expert load balance each placement policy reaches per EP size. Needs no GPU."""


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to an ``argparse`` subparsers object; returns the new parser."""
    parser = add_command(
        subparsers,
        "plan",
        "communication budget: bytes, bandwidth and overlap feasibility (seed example by default)",
        PLAN_DESCRIPTION,
    )
    add_plan_arguments(parser)
    return parser


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    d = planner.PlanInputs.__dataclass_fields__
    parser.add_argument(
        "--model",
        default=planner.SEED_INPUTS["model"],
        help=f"preset ({', '.join(sorted(PRESETS))}) or path to a Hugging Face config.json",
    )
    parser.add_argument("--batch", type=int, default=d["batch"].default, help="decode tokens per GPU")
    parser.add_argument("--tpot-ms", type=float, default=d["tpot_ms"].default, help="time per output token SLO")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers with an all-to-all (default: all layers in the seed convention, MoE layers in the byte model)",
    )
    parser.add_argument("--attn-us", type=float, default=d["attn_us"].default, help="attention time per layer, T")
    parser.add_argument("--moe-us", type=float, default=d["moe_us"].default, help="MoE compute time per layer, t")
    parser.add_argument("--ep", type=int, default=d["ep"].default, help="expert-parallel size P")
    parser.add_argument("--hw", default=d["hw"].default, help=f"hardware: {', '.join(planner.HARDWARE)}")
    parser.add_argument(
        "--dispatch-dtype", default="fp8", choices=sorted(planner.ELEMENT_B), help="element type dispatch sends"
    )
    parser.add_argument(
        "--combine-dtype", default="bf16", choices=sorted(planner.ELEMENT_B), help="element type combine sends"
    )
    parser.add_argument(
        "--weight-dtype",
        default="bf16",
        choices=sorted(planner.ELEMENT_B),
        help="shared-expert weights, for the SBO time estimate",
    )
    parser.add_argument(
        "--micro-batches", type=int, default=d["micro_batches"].default, help="2 = two-batch overlap (TBO), 1 = none"
    )
    parser.add_argument(
        "--fanout",
        default="uniform",
        choices=planner.FANOUT_MODELS,
        help="destination ranks per token: exact uniform model, router Monte-Carlo, or worst case",
    )
    parser.add_argument(
        "--memory-ep",
        type=int,
        nargs="+",
        metavar="EP",
        help=(
            "EP sizes of the weight-memory table, routed experts / EP and the rest replicated (default: "
            f"{' '.join(map(str, planner.DEFAULT_MEMORY_EP))}, those that divide the experts, else --ep)"
        ),
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--load",
        metavar="FILE",
        help="a load file (bench --eplb --record-load): add the expert load balance per EP size, redundant "
        "count and placement policy, and the predicted gain on the expert time",
    )
    load.add_argument("--skew", metavar="zipf:S|FILE", help=f"as --load, from {SKEW_HELP}")
    parser.add_argument(
        "--eplb-ep",
        type=int,
        nargs="+",
        metavar="EP",
        help=(
            "EP sizes of the load-balance table (default: "
            f"{' '.join(map(str, planner.DEFAULT_BALANCE_EP))}, those that divide the experts)"
        ),
    )
    parser.add_argument(
        "--redundant",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="redundant expert slots per rank of the load-balance table (default: "
        f"{' '.join(map(str, planner.DEFAULT_REDUNDANT))})",
    )
    parser.add_argument(
        "--node-aware-ep",
        type=int,
        nargs="+",
        metavar="EP",
        help="EP sizes (whole nodes of --hw's GPUs) of a table comparing flat and node-aware dispatch: "
        "crossings per token and dispatch + combine time of --batch tokens per GPU, e.g. 16 32 64 128 256",
    )
    parser.add_argument("--json", metavar="PATH", help="write inputs and results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: batch vs a2a time and bandwidth")
    parser.add_argument(
        "--calibrate",
        metavar="RESULT.json",
        help="benchmark result file whose measured bandwidth/latency replace the datasheet",
    )

"""``moe-sbo generate``'s options: a Hugging Face MoE model whose MoE layers are expert parallel."""

from __future__ import annotations

import argparse

from ...config import DECODE_LOOPS, DISPATCHER_NAMES, MLA_STEPS, OVERLAP_MODES
from .common import RANKS_HELP, add_device_arg, add_expert_dtype_arg

SUMMARY = "generate with a Hugging Face MoE model whose MoE layers are expert parallel"
DESCRIPTION = """\
Generate with a Hugging Face MoE model (DeepSeek-V2/V3, Qwen3-MoE) whose MoE layers are expert
parallel: each rank holds the attention and dense layers whole and only its share of the routed
experts, runs its own prompts, and moves tokens to the experts' ranks with the dispatcher chosen.
Greedy decoding, ranks in step: it stops when every prompt on every rank has ended, or after
--max-new-tokens; on CUDA each decode step is replayed from a CUDA graph (--decode). Prints the
new tokens per prompt and per rank the prefill time, time per output token (TPOT) and tokens/s.
Under torchrun (torchrun --nproc-per-node N -m moe_sbo generate ...) it runs on torchrun's ranks;
rank 0 prints."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--json", metavar="PATH", help="write prompts, new tokens and timings as JSON (-: standard output)"
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="elastic EP (docs/ELASTIC.md) with --kill-rank: that rank, which must own no prompt, is killed in the "
        "first decode step and the others generate on without it (decode transformers)",
    )
    parser.add_argument(
        "--kill-rank", type=int, default=None, metavar="R", help="with --elastic: the rank to kill (it owns no prompt)"
    )

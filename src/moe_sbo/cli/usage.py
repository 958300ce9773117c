"""What ``--help`` and ``--version`` show beyond the options: a few real command lines per
subcommand (each ``--help``'s epilog) and the environment report of ``--version``.

The hard part is that both must answer at once: nothing here imports torch (``measure.environment``
reads package metadata), and every example is a command line the parser accepts (a test parses each).
"""

from __future__ import annotations

import argparse
import sys

from ..measure.environment import version_report

EXAMPLES = {
    "demo": """\
examples:
  moe-sbo demo --device cpu                     # every dispatcher on 2 CPU ranks vs one rank
  moe-sbo demo --overlap all --ranks 4          # and every overlap mode, on 4 GPUs
  moe-sbo demo --eplb --dispatcher alltoall --json demo.json  # load balancing; rows as JSON""",
    "bench": """\
examples:
  moe-sbo bench --device cpu --preset tiny   # mode sbo, a smoke run on CPU
  moe-sbo bench sbo --dispatcher low_latency --tokens 128 4096 --out sbo.json
  moe-sbo bench tbo --overlap none combine --out - | jq '.rows[0]'  # JSON""",
    "check": """\
examples:
  moe-sbo check --checkpoint tiny-qwen3 --device cpu  # the tiny model of docs/CHECKPOINTS.md
  moe-sbo check --checkpoint ./DeepSeek-V3 --layer 3 --expert-dtype fp8 --json check.json""",
    "generate": """\
examples:
  moe-sbo generate --checkpoint tiny-qwen3 --prompt-ids 1,2,3 --device cpu
  moe-sbo generate --checkpoint ./Qwen3-30B-A3B --prompt "The capital of France is" --ranks 2
  torchrun --nproc-per-node 8 -m moe_sbo generate --checkpoint ./DeepSeek-V3 --prompts-file p.txt""",
    "plan": """\
examples:
  moe-sbo plan                                  # DeepSeek-V3 decode: batch 256, 20 ms TPOT, EP8
  moe-sbo plan --model qwen3-30b-a3b --ep 4 --batch 64 --hw h200 --json -
  moe-sbo plan --node-aware-ep 16 32 64 --batch 4096 --detail""",
}


class VersionAction(argparse.Action):
    """``--version``: the ``moe-sbo X.Y.Z`` line, then Python, torch, Triton, CUDA, NCCL and the GPU."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        kwargs.setdefault("help", "show the version and the environment (Python, torch, Triton, CUDA, NCCL, GPU)")
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> None:
        print(version_report(), file=sys.stdout, flush=True)
        parser.exit()

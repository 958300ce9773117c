"""Where a decode step's time goes: ``torch.profiler`` over greedy generation of the
``bench_generate.py`` model on one GPU, for ``transformers`` and for moe-sbo's layers at EP1
(``local`` dispatcher). Prints each one's top operators by host and by device time.

Usage (GPU): ``python benchmarks/profile_generate.py [--checkpoint-dir DIR]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_generate import prompts_for, write_checkpoint
from moe_sbo.hf.model import generate, load_model


def show(name: str, model, prompts, steps: int) -> None:
    generate(model, prompts, 2)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = generate(model, prompts, steps)
    print(f"== {name}: prefill {result.prefill_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.1f} ms", flush=True)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48), flush=True)
    print(table.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=48), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    bench_args = argparse.Namespace(tiny=False, vocab=32000, layers=3, experts=32, batch=8, prompt_len=256)
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as tmp:
        path = Path(tmp) / "model"
        write_checkpoint(path, bench_args, "cuda")
        prompts = prompts_for(bench_args)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
        show("transformers", model, prompts, args.steps)
        del model
        torch.cuda.empty_cache()
        show("moe-sbo EP1 local", load_model(path, dispatcher="local", device="cuda"), prompts, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where generation's time goes: ``torch.profiler`` over greedy generation of the ``bench_generate.py``
model, printing the top operators by host and by device time.

``--impl transformers``: ``transformers`` on one GPU. ``--impl moe-sbo``: moe-sbo's layers on
``--ranks`` GPUs (rank 0's profile; ``alltoall`` prefill at EP > 1, ``local`` at EP1, a
``low_latency`` decode dispatcher), with ``--decode`` (``static`` shows each decode kernel's device
time, the same kernels a ``cuda_graph`` step replays). Two profiles each: the prefill alone
(one new token) and a generation of ``--steps`` tokens.

Usage (GPU): ``python benchmarks/profile_generate.py --impl moe-sbo --ranks 2 --decode static``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_generate import prompts_for, write_checkpoint
from moe_sbo.hf.generate import DECODE_LOOPS, generate
from moe_sbo.hf.model import load_model
from moe_sbo.launch.ranks import LocalRanks


def profiles(model, prompts, steps: int, decode: str) -> str:
    """The prefill's and a ``steps``-token generation's operator tables, after a warm-up."""
    generate(model, prompts, steps, decode=decode)
    out = []
    for name, tokens in (("prefill (1 token)", 1), (f"generation ({steps} tokens)", steps)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = generate(model, prompts, tokens, decode=decode)
        table = prof.key_averages()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out.append(f"== {name}: prefill {result.prefill_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.2f} ms")
        out.append(f"device: {len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.2f} ms in all")
        out.append(table.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90))
        out.append(table.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    return "\n".join(out)


def moe_sbo_rank(device, path, shares, steps, decode):
    import torch.distributed as dist

    ranks = len(shares)
    model = load_model(
        path,
        dispatcher="alltoall" if ranks > 1 else "local",
        device=device,
        decode_dispatcher="low_latency",
        decode_dispatcher_options={"max_tokens_per_rank": max(len(s) for s in shares)},
    )
    return profiles(model, shares[dist.get_rank()], steps, decode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--impl", nargs="+", default=["transformers", "moe-sbo"], choices=["transformers", "moe-sbo"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--decode", default="static", choices=DECODE_LOOPS)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    bench_args = argparse.Namespace(tiny=False, vocab=32000, layers=3, experts=32, batch=8, prompt_len=256)
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as tmp:
        path = Path(tmp) / "model"
        write_checkpoint(path, bench_args, "cuda")
        prompts = prompts_for(bench_args)
        if "transformers" in args.impl:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
            print("#### transformers, one GPU\n" + profiles(model, prompts, args.steps, "transformers"), flush=True)
            del model
            torch.cuda.empty_cache()
        if "moe-sbo" in args.impl:
            shares = [prompts[r :: args.ranks] for r in range(args.ranks)]
            with LocalRanks(args.ranks, device="cuda") as ranks:
                tables = ranks.run(moe_sbo_rank, str(path), shares, args.steps, args.decode)
            print(f"#### moe-sbo EP{args.ranks}, decode {args.decode}, rank 0\n" + tables[0], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

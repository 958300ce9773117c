"""Whole-model generation: ``transformers`` on one GPU against moe-sbo's expert-parallel MoE layers on
``--ranks`` GPUs, the same checkpoint and the same prompts, in one run.

The checkpoint is DeepSeek-V3-shaped and random, written by ``transformers`` itself: real hidden,
attention (MLA) and expert dims, ``--layers`` layers of which the first is dense, ``--experts``
routed experts (top-8, one shared), a ``--vocab`` word vocabulary. Rows (``OUT/generate.json``):

- ``impl="transformers"``: ``DeepseekV3ForCausalLM.from_pretrained`` on GPU 0, bf16, its default
  experts implementation, greedy ``generate`` of the whole batch;
- ``impl="moe-sbo"``: ``moe_sbo.hf.model.load_model`` on every rank (each reads its experts only),
  the batch split over the ranks (DP attention), ``--dispatcher`` for the MoE layers, eager.

Each row: ``prefill_ms`` (prompt to first token), ``tpot_ms`` (mean time per later token),
``tokens_per_s`` (new tokens of the whole batch / the slowest rank's time; each implementation first
runs the same generation once, untimed, so cuDNN's per-length attention plans are built), ``load_rss_growth_mb``
(the host memory a rank's load added, peak), ``same_tokens`` (moe-sbo's new tokens equal
``transformers``' for the first ``--compare-tokens``; bf16 on different kernels may drift later).

Usage (GPU): ``python benchmarks/bench_generate.py --out DIR``; CPU smoke:
``python benchmarks/bench_generate.py --out DIR --device cpu --tiny``.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import torch

from moe_sbo.hf.model import generate, load_model
from moe_sbo.measure.results import result_meta
from moe_sbo.runtime import LocalRanks


def deepseek_v3_config(dims: dict, *, vocab: int, layers: int, experts: int, **extra):
    """A ``DeepseekV3Config`` of ``dims`` (hidden, attention and expert sizes) with DeepSeek-V3's
    routing (top-8 of ``experts``, 8 groups, 4 kept, one shared expert) and the first layer dense."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **dims,
        vocab_size=vocab,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        num_key_value_heads=dims["num_attention_heads"],
        **extra,
    )


def write_checkpoint(path: Path, args, device: str) -> None:
    """A random DeepSeek-V3-shaped model saved by ``transformers`` (bf16 safetensors)."""
    from transformers import DeepseekV3ForCausalLM

    dims = (
        dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
             q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
        if args.tiny
        else dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                  q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    )  # fmt: skip
    config = deepseek_v3_config(
        dims,
        vocab=args.vocab,
        layers=args.layers,
        experts=args.experts,
        max_position_embeddings=4096,
        eos_token_id=1,
        bos_token_id=0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # a trained router's correction bias is not zero
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)


def prompts_for(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(2, args.vocab, (args.batch, args.prompt_len), generator=generator).tolist()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def transformers_row(path: Path, prompts, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    before = peak_rss_mb()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()
    grown = peak_rss_mb() - before
    experts_implementation = getattr(model.config, "_experts_implementation", None)
    # Warm-up: the same generation once. cuDNN builds an attention plan per sequence length (~10 ms
    # of host time each, measured), which a server pays once; the timed run then reuses them.
    generate(model, prompts, args.new_tokens)
    result = generate(model, prompts, args.new_tokens)
    del model
    row = _row("transformers", 1, result.token_ids, result.prefill_s, result.tpot_s, args, grown)
    row["experts_implementation"] = experts_implementation
    return row


def ep_rank(device, path, shares, new_tokens, dispatcher):
    import torch.distributed as dist

    before = peak_rss_mb()
    model = load_model(path, dispatcher=dispatcher, device=device)
    grown = peak_rss_mb() - before
    mine = shares[dist.get_rank()]
    generate(model, mine, new_tokens)  # warm-up, as for transformers (an empty rank joins with 0-token calls)
    result = generate(model, mine, new_tokens)
    return result.token_ids, result.prefill_s, result.tpot_s, grown


def _row(impl, ranks, token_ids, prefill_s, tpot_s, args, grown_mb) -> dict:
    total_s = prefill_s + tpot_s * (args.new_tokens - 1)
    return {
        "bench": "generate",
        "impl": impl,
        "ranks": ranks,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "layers": args.layers,
        "experts": args.experts,
        "prefill_ms": prefill_s * 1e3,
        "tpot_ms": tpot_s * 1e3,
        "tokens_per_s": args.batch * args.new_tokens / total_s,
        "load_rss_growth_mb": grown_mb,
        "token_ids": token_ids,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small dims (CPU smoke)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dispatcher", default="alltoall")
    parser.add_argument("--compare-tokens", type=int, default=8)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="where to write it (default: a temp dir)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    meta = {**result_meta(args.device, args.ranks), "timer": "host clock, CUDA synchronised per token"}
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as tmp:
        path = Path(tmp) / "model"
        write_checkpoint(path, args, args.device)
        meta["checkpoint_gb"] = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        prompts = prompts_for(args)
        rows.append(transformers_row(path, prompts, args, args.device))
        print({k: v for k, v in rows[-1].items() if k != "token_ids"}, flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        shares = [prompts[r :: args.ranks] for r in range(args.ranks)]
        with LocalRanks(args.ranks, device=args.device) as ranks:
            per_rank = ranks.run(ep_rank, str(path), shares, args.new_tokens, args.dispatcher)
    token_ids: list[list[int]] = [[] for _ in prompts]
    for r, (ids, _, _, _) in enumerate(per_rank):
        for j, row_ids in enumerate(ids):
            token_ids[r + j * args.ranks] = row_ids
    prefill = max(p for _, p, _, _ in per_rank)
    tpot = max(t for _, _, t, _ in per_rank)
    row = _row("moe-sbo", args.ranks, token_ids, prefill, tpot, args, max(g for *_, g in per_rank))
    row["dispatcher"] = args.dispatcher
    n = args.compare_tokens
    row["same_tokens"] = all(a[:n] == b[:n] for a, b in zip(token_ids, rows[0]["token_ids"]))
    row["tpot_speedup"] = rows[0]["tpot_ms"] / row["tpot_ms"]
    row["prefill_speedup"] = rows[0]["prefill_ms"] / row["prefill_ms"]
    rows.append(row)
    print({k: v for k, v in row.items() if k != "token_ids"}, flush=True)
    (args.out / "generate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

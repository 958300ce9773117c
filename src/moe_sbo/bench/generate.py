"""Whole-model generation: ``transformers`` on one GPU against moe-sbo's expert-parallel MoE layers on
``--ranks`` GPUs, the same checkpoint and the same prompts, in one run.

The checkpoint is DeepSeek-V3-shaped and random, written by ``transformers`` itself: real hidden,
attention (MLA) and expert dims, ``--layers`` layers of which the first is dense, ``--experts``
routed experts (top-8, one shared), a ``--vocab`` word vocabulary. Rows (``OUT/generate.json``):

- ``impl="transformers"``: ``DeepseekV3ForCausalLM.from_pretrained`` on GPU 0, bf16, its default
  experts implementation, greedy ``generate`` of the whole batch;
- ``impl="moe-sbo"``, one row per ``--ranks`` x ``--dispatcher`` x ``--decode``:
  ``moe_sbo.hf.model.load_model`` on every rank (each reads its experts only), the batch split over
  the ranks (DP attention), the dispatcher for prefill (``low_latency`` sized to a rank's prompt
  tokens; EP1: ``local``), the MoE layers' ``--overlap`` mode (default ``none``); ``decode``:
  ``transformers`` (``model.generate``), ``static`` (fixed-shape steps through a ``low_latency``
  decode dispatcher, eager) or ``cuda_graph`` (those steps replayed from a graph); ``mla``:
  ``absorbed`` (decode attention in the latent space, ``moe_sbo.hf.mla``, the default) or
  ``transformers`` (its own step, which expands the whole cache every step), per ``--mla``.

Each row: ``prefill_ms`` (prompt to first token), ``tpot_ms`` (mean time per later token; the
slowest rank's), each the median of ``--repeats`` timed generations (all of them in ``*_ms_runs``;
host-bound eager decoding varies by ~20 % from one machine to the next), ``tokens_per_s`` (new tokens
of the whole batch / the slowest rank's time; each implementation first runs the same generation
once, untimed, so cuDNN's per-length attention plans are built and graphs are captured),
``t_weights_us`` (the decode floor: reading every weight a rank holds but the embedding once, timed
in the same run as a sum over a buffer of that many bytes on the same GPU; a small batch's step
reads them all), ``layer_tpot_us`` (TPOT / layers) beside
``planner_layer_share_us`` (``moe-sbo plan``'s per-layer share of DeepSeek-V3's 20 ms TPOT),
``load_rss_growth_mb`` (the host memory a rank's load added, peak), ``same_tokens`` (moe-sbo's new
tokens equal ``transformers``' for the first ``--compare-tokens``; bf16 on different kernels may drift
later, docs/MODELS.md).

Usage (GPU): ``moe-sbo bench generate --out DIR``; CPU smoke:
``moe-sbo bench generate --out DIR --device cpu --tiny --decode transformers static``.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path
from statistics import median

import torch

from ..hf.generate import generate, prefill_tokens
from ..hf.model import load_model
from ..launch.ranks import LocalRanks
from ..measure.results import result_meta
from ..measure.timing import memory_read_us
from ..planner.inputs import SEED_INPUTS
from ..planner.inputs import load_model as load_plan_model

# moe-sbo plan's per-layer share of a token's time for DeepSeek-V3: 20 ms TPOT over its 61 layers.
PLANNER_LAYER_SHARE_US = SEED_INPUTS["tpot_ms"] * 1e3 / load_plan_model(SEED_INPUTS["model"]).num_hidden_layers


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
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    with torch.no_grad():  # a trained router's correction bias is not zero
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(path)


def prompts_for(args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(2, args.vocab, (args.batch, args.prompt_len), generator=generator).tolist()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weight_read_us(model, device: str) -> float:
    """Microseconds to read as many bytes as ``model``'s weights but its embedding table, once
    (``memory_read_us``; 0 off CUDA)."""
    if device != "cuda":
        return 0.0
    embedding = model.get_input_embeddings().weight
    tied = getattr(model.config, "tie_word_embeddings", False)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding or tied)
    return memory_read_us(nbytes, torch.device(device))


def transformers_row(path: Path, prompts, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    before = peak_rss_mb()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()  # type: ignore[arg-type]
    grown = peak_rss_mb() - before
    experts_implementation = getattr(model.config, "_experts_implementation", None)
    # Warm-up: the same generation once. cuDNN builds an attention plan per sequence length (~10 ms
    # of host time each, measured), which a server pays once; the timed run then reuses them.
    generate(model, prompts, args.new_tokens)
    timed = [generate(model, prompts, args.new_tokens) for _ in range(args.repeats)]
    floor_us = weight_read_us(model, device)
    del model
    prefills, tpots = [r.prefill_s for r in timed], [r.tpot_s for r in timed]
    row = _row("transformers", 1, timed[0].token_ids, median(prefills), median(tpots), args, grown)
    row.update(experts_implementation=experts_implementation, decode="transformers", t_weights_us=floor_us)
    row.update(prefill_ms_runs=[p * 1e3 for p in prefills], tpot_ms_runs=[t * 1e3 for t in tpots])
    return row


def ep_rank(device, path, shares, new_tokens, dispatcher, decodes, repeats, overlap="none", absorb_mla=True):
    """One rank: load once, then per decode loop a warm-up generation and a timed one."""
    import torch.distributed as dist

    before = peak_rss_mb()
    most = max(1, *(len(s) for s in shares))
    capacity = max(prefill_tokens(s) for s in shares)
    model = load_model(
        path,
        dispatcher=dispatcher,
        dispatcher_options={"max_tokens_per_rank": capacity} if dispatcher == "low_latency" else None,
        overlap=overlap,
        device=device,
        decode_dispatcher="low_latency",
        decode_dispatcher_options={"max_tokens_per_rank": most},
        absorb_mla=absorb_mla,
    )
    grown = peak_rss_mb() - before
    mine = shares[dist.get_rank()]
    results = {}
    for decode in decodes:
        generate(model, mine, new_tokens, decode=decode)  # warm-up (an empty rank joins with 0-token calls)
        timed = [generate(model, mine, new_tokens, decode=decode) for _ in range(repeats)]
        results[decode] = (timed[0].token_ids, [r.prefill_s for r in timed], [r.tpot_s for r in timed])
    return results, grown, weight_read_us(model, str(torch.device(device).type))


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
        "layer_tpot_us": tpot_s * 1e6 / args.layers,
        "planner_layer_share_us": PLANNER_LAYER_SHARE_US,
        "load_rss_growth_mb": grown_mb,
        "token_ids": token_ids,
    }


def moe_sbo_rows(path: Path, prompts, args, baseline: dict) -> list[dict]:
    rows = []
    runs = [
        (ranks, d, mla)
        for ranks in args.ranks
        for d in (args.dispatcher if ranks > 1 else ["local"])
        for mla in args.mla
    ]
    for ranks, dispatcher, mla in runs:
        shares = [prompts[r::ranks] for r in range(ranks)]
        with LocalRanks(ranks, device=args.device) as workers:
            per_rank = workers.run(
                ep_rank,
                str(path),
                shares,
                args.new_tokens,
                dispatcher,
                args.decode,
                args.repeats,
                args.overlap,
                mla == "absorbed",
            )
        for decode in args.decode:
            token_ids: list[list[int]] = [[] for _ in prompts]
            for r, (results, _, _) in enumerate(per_rank):
                for j, row_ids in enumerate(results[decode][0]):
                    token_ids[r + j * ranks] = row_ids
            # Each repeat's time is its slowest rank's; the row gives the median repeat.
            prefills = [max(vals) for vals in zip(*(results[decode][1] for results, _, _ in per_rank))]
            tpots = [max(vals) for vals in zip(*(results[decode][2] for results, _, _ in per_rank))]
            grown = max(g for _, g, _ in per_rank)
            row = _row("moe-sbo", ranks, token_ids, median(prefills), median(tpots), args, grown)
            row.update(prefill_ms_runs=[p * 1e3 for p in prefills], tpot_ms_runs=[t * 1e3 for t in tpots])
            n = args.compare_tokens
            row.update(
                dispatcher=dispatcher,
                overlap=args.overlap,
                mla=mla,
                decode=decode,
                decode_dispatcher="low_latency" if decode != "transformers" else dispatcher,
                t_weights_us=max(f for *_, f in per_rank),
                same_tokens=all(a[:n] == b[:n] for a, b in zip(token_ids, baseline["token_ids"])),
                tpot_speedup=baseline["tpot_ms"] / row["tpot_ms"],
                prefill_speedup=baseline["prefill_ms"] / row["prefill_ms"],
            )
            rows.append(row)
            print({k: v for k, v in row.items() if k != "token_ids"}, flush=True)
    return rows


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench generate``: write the checkpoint, then the transformers row and moe-sbo's."""
    if args.device != "cuda" and "cuda_graph" in args.decode:
        raise ValueError("--decode cuda_graph needs --device cuda; leave cuda_graph out of --decode on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    timer = "transformers decode: host clock, CUDA synchronised per token; static and cuda_graph: CUDA events"
    meta = {**result_meta(args.device, max(args.ranks)), "timer": timer}
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir) as tmp:
        path = Path(tmp) / "model"
        write_checkpoint(path, args, args.device)
        meta["checkpoint_gb"] = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        prompts = prompts_for(args)
        baseline = transformers_row(path, prompts, args, args.device)
        print({k: v for k, v in baseline.items() if k != "token_ids"}, flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        rows = [baseline, *moe_sbo_rows(path, prompts, args, baseline)]
    (args.out / "generate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0

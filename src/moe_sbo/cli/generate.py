"""``moe-sbo generate``: a Hugging Face MoE model served with expert-parallel MoE layers, greedy.

Every rank loads the whole model but only its own experts (``hf/model.py``), takes its share of the
prompts (one prompt: every rank runs it; several: prompt i goes to rank i mod N, so a rank may have
none) and generates in step with the others. Prints the new tokens per prompt (text when the
checkpoint has a tokenizer) and per rank the prefill time, the time per output token (TPOT) and
tokens/s; ``--json`` writes them. Runs on ``LocalRanks`` (``--ranks``), or on the ranks ``torchrun``
started (``torchrun --nproc-per-node N -m moe_sbo generate ...``; rank 0 prints).

The hard part is failing before any rank starts: the checkpoint's family, the prompts (ids in the
vocabulary, a tokenizer when text is given) and the options are checked here first.
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from rich.markup import escape

from .. import env
from ..hf.checkpoint import Checkpoint, LayerLoader
from ..hf.config import model_family, moe_layer_indices
from ..hf.generate import check_prompt_ids, generate, prefill_tokens
from ..hf.model import WHOLE_MODEL_FAMILIES, load_model, moe_blocks
from ..launch import elastic
from ..launch.elastic import ElasticMoE, ElasticOptions
from ..launch.group import init_from_torchrun, resolve_device
from ..launch.ranks import LocalRanks
from ..measure.memory import check_memory, estimate_rank_bytes, memory_fix
from ..measure.options import (
    default_dtype_name,
    make_console,
    make_table,
    print_notes,
    resolve_expert_dtype,
    resolve_ranks,
)
from ..measure.progress import rank_progress
from ..measure.results import STDOUT, result_meta
from ..measure.run import Ranks, output_file, write_json
from .demo_elastic import spare_slots_needed


def parse_prompt_ids(texts: list[str], vocab_size: int) -> list[list[int]]:
    """``--prompt-ids`` values -> id lists, checked as ``generate`` checks them (``check_prompt_ids``)."""
    prompts = []
    for text in texts:
        try:
            prompts.append([int(part) for part in text.split(",") if part.strip()])
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}; e.g. 1,2,3") from None
    check_prompt_ids(prompts, vocab_size, what="--prompt-ids")
    return prompts


def share_prompts(prompts: list[list[int]], ranks: int) -> list[list[tuple[int, list[int]]]]:
    """Each rank's (prompt index, ids): one prompt goes to every rank, several round-robin."""
    if len(prompts) == 1:
        return [[(0, prompts[0])] for _ in range(ranks)]
    return [[(i, p) for i, p in enumerate(prompts) if i % ranks == rank] for rank in range(ranks)]


def run_generate(args: argparse.Namespace) -> int:
    """Check everything, run the ranks, print and write the results. Returns 0."""
    json_path = output_file("--json", args.json)  # every command: its output checked first
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    checkpoint = Checkpoint(args.checkpoint)
    family = model_family(checkpoint.hf_config)
    if family not in WHOLE_MODEL_FAMILIES:
        raise ValueError(f"--checkpoint must be one of the families {WHOLE_MODEL_FAMILIES}, got {family}")
    expert_dtype = resolve_expert_dtype(args.expert_dtype, checkpoint.moe_config)
    tokenizer = _tokenizer(checkpoint.path) if args.prompt_ids is None else None
    prompts = _prompts(args, tokenizer, int(checkpoint.hf_config.get("vocab_size", 0)))
    torchrun = env.torchrun_rank()
    device = resolve_device(args.device)
    if args.elastic and args.decode == "auto":
        args.decode = "transformers"  # the elastic layers' own dispatchers: no fixed-shape decode steps
    args.decode = resolve_decode(args.decode, device)  # what ran, as the report and --json say
    ranks = torchrun[1] if torchrun is not None else resolve_ranks(args.ranks, device)
    shares = share_prompts(prompts, ranks)
    # Every rank holds all MoE layers' shared experts and its share of their routed experts.
    cfg, dtype = checkpoint.moe_config, args.dtype or default_dtype_name(device)
    most_tokens = max(prefill_tokens([ids for _, ids in share]) for share in shares)
    estimate = estimate_rank_bytes(cfg, ranks, dtype, most_tokens, layers=cfg.num_moe_layers, layers_are="MoE layers")
    check_memory(estimate, device, ranks, fix=memory_fix(device, "a smaller model or more --ranks"))
    options = {
        "path": str(checkpoint.path),
        "dispatcher": args.dispatcher,
        "overlap": args.overlap,
        "expert_dtype": expert_dtype,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "dispatcher_options": _dispatcher_options(args.dispatcher, shares, args.elastic),
        "decode": args.decode,
        "absorb_mla": args.mla == "absorbed",
    }
    if args.elastic:
        options.update(_elastic_options(args, shares, ranks, torchrun is not None, checkpoint))
        with LocalRanks(ranks, device=device, elastic=ElasticOptions(options["spare"], dead_after_s=2.0)) as workers:
            per_rank = workers.run(generate_rank, shares, **{k: v for k, v in options.items() if k != "spare"})
        _report(
            args, checkpoint, prompts, [r for r in per_rank if isinstance(r, dict)], tokenizer, device, ranks, json_path
        )
        return 0
    if torchrun is not None:
        torch_device = init_from_torchrun(device)
        mine = generate_rank(torch_device, shares, **options)
        gathered: list = [None] * ranks if dist.get_rank() == 0 else []
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return 0
        per_rank = gathered
    else:
        per_rank = Ranks(device, ranks, make_console()).run(generate_rank, shares, **options)
    _report(args, checkpoint, prompts, per_rank, tokenizer, device, ranks, json_path)
    return 0


def resolve_decode(decode: str, device: str) -> str:
    """``--decode auto`` -> ``cuda_graph`` on CUDA, ``static`` elsewhere; ``cuda_graph`` off CUDA is refused."""
    if decode == "auto":
        return "cuda_graph" if device == "cuda" else "static"
    if decode == "cuda_graph" and device != "cuda":
        raise ValueError(f"--decode cuda_graph needs CUDA, the device is {device}; use --decode static")
    return decode


def generate_rank(
    device,
    shares,
    *,
    path,
    dispatcher,
    overlap,
    expert_dtype,
    dtype,
    max_new_tokens,
    dispatcher_options,
    decode,
    absorb_mla,
    kill_rank=None,
):
    """One rank's share (``LocalRanks.run`` or torchrun): load, generate, return plain data. With
    ``kill_rank`` (``--elastic``, on ``LocalRanks(elastic=...)``): every MoE block elastic, and that
    rank killed in the first decode step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = elastic.session() if kill_rank is not None else None
    # Fixed-shape decode steps move a rank's prompts (one token each) through low_latency, sized to
    # the most prompts any rank decodes; prefill keeps --dispatcher.
    most_prompts = max(1, *(len(share) for share in shares))
    model = load_model(
        path,
        dispatcher=dispatcher,
        dispatcher_options=dispatcher_options,
        overlap=overlap,
        expert_dtype=expert_dtype,
        dtype=getattr(torch, dtype) if dtype else None,
        device=device,
        decode_dispatcher=None if decode == "transformers" else "low_latency",
        decode_dispatcher_options=None if decode == "transformers" else {"max_tokens_per_rank": most_prompts},
        absorb_mla=absorb_mla,
        eplb=None if group is None else group.options.eplb(),
    )
    if group is not None:
        _make_elastic(model, path, group, rank == kill_rank)
    mine = shares[rank]
    prompts = [ids for _, ids in mine]
    result = generate(
        model, prompts, max_new_tokens, on_step=rank_progress(rank, max_new_tokens, "generating"), decode=decode
    )
    new_tokens = sum(len(ids) for ids in result.token_ids)
    total_s = result.prefill_s + sum(result.step_s)
    return {
        "rank": rank,
        "prompts": [index for index, _ in mine],
        "token_ids": result.token_ids,
        "prefill_s": result.prefill_s,
        "tpot_s": result.tpot_s,
        "tokens_per_s": new_tokens / total_s if total_s else 0.0,
        "forwards": result.forwards,
        "recoveries": [] if group is None else [asdict(r) for r in group.recoveries],
    }


def _elastic_options(args, shares, ranks: int, torchrun: bool, checkpoint) -> dict:
    """``--elastic``'s checks (before any rank starts) and the options it adds."""
    if torchrun:
        raise ValueError("--elastic starts its own ranks (the launcher hosts the store); run it without torchrun")
    if args.kill_rank is None or not 0 <= args.kill_rank < ranks or ranks < 2:
        raise ValueError(f"--elastic needs --ranks >= 2 and --kill-rank in [0, {ranks}), got {args.kill_rank}")
    if shares[args.kill_rank]:
        raise ValueError(
            f"--kill-rank {args.kill_rank} owns prompts {[i for i, _ in shares[args.kill_rank]]}: a lost rank's own "
            "requests are its caller's to re-submit; give fewer prompts than ranks and kill one without any"
        )
    if args.decode != "transformers":
        raise ValueError(
            f"--elastic decodes through the layers' own dispatchers: --decode transformers, got {args.decode}"
        )
    checkpoint.moe_config.experts_per_rank(ranks)
    return {
        "kill_rank": args.kill_rank,
        "decode": "transformers",
        "spare": spare_slots_needed(checkpoint.moe_config.num_experts, ranks),
    }


def _make_elastic(model, path: str, group, victim: bool) -> None:
    """Every MoE block through an ``ElasticMoE`` (lost experts restored from the checkpoint); the
    victim dies with its first layer's dispatch in flight in the first decode step."""
    checkpoint = Checkpoint(path)
    for block, index in zip(moe_blocks(model), moe_layer_indices(checkpoint.hf_config)):
        block.elastic = ElasticMoE(block.moe, group, LayerLoader(checkpoint, index).expert_source(block.moe))
    if victim:
        calls = [0]

        def die(dispatcher, payload):
            calls[0] += 1
            if calls[0] == 2:  # prefill was call 1
                os.kill(os.getpid(), signal.SIGKILL)

        moe_blocks(model)[0].moe.dispatcher.hooks.register("dispatch_in_flight", die)


def _dispatcher_options(
    dispatcher: str, shares: list[list[tuple[int, list[int]]]], elastic: bool = False
) -> dict | None:
    """``low_latency`` needs a capacity: the most tokens one rank's forward carries (its prefill);
    elastic, a transport whose wait raises on a lost peer (``launch.elastic_layer.check_transport``)."""
    if dispatcher != "low_latency":
        return None
    prefill = [prefill_tokens([ids for _, ids in share]) for share in shares]
    return {"max_tokens_per_rank": max(1, *prefill), **({"transport": "nccl"} if elastic else {})}


def _tokenizer(path: Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _prompts(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[list[int]]:
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids, vocab_size)
    if args.prompt is not None:
        texts = args.prompt
    else:
        try:
            texts = Path(args.prompts_file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"--prompts-file must be a readable text file, got {args.prompts_file}: {err}") from None
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError("the prompts must hold at least one non-empty line")
    encoded = [tokenizer(t)["input_ids"] for t in texts] if tokenizer is not None else []
    # No tokenizer files: DeepSeek's directories give none; Qwen3's give transformers' empty stand-in,
    # which encodes every text to no ids. Either way there is no tokenizer to encode with.
    if not encoded or not all(encoded):
        raise ValueError(
            f"{args.checkpoint} has no tokenizer, so text prompts cannot be encoded; pass token ids with "
            "--prompt-ids 1,2,3 instead"
        )
    return encoded


def _report(args, checkpoint, prompts, per_rank, tokenizer, device: str, ranks: int, json_path) -> None:
    console = make_console(stdout_taken=json_path is STDOUT)
    console.print(
        f"[bold]moe-sbo generate[/]: {escape(str(checkpoint.path))} ({checkpoint.model_type})",
        soft_wrap=True,  # the path is printed whole
    )
    console.print(
        f"  {ranks} {device} ranks, {args.dispatcher}, overlap {args.overlap}, decode {args.decode}, "
        f"{args.max_new_tokens} new tokens",
        highlight=False,
    )
    outputs: dict[int, list[int]] = {}
    for result in per_rank:
        for index, ids in zip(result["prompts"], result["token_ids"]):
            outputs.setdefault(index, ids)  # a prompt given once runs on every rank: same tokens
    for index, ids in sorted(outputs.items()):
        head = f"prompt {index}: "
        if tokenizer is not None:
            console.print(f"[bold]{head}[/]" + escape(tokenizer.decode(ids, skip_special_tokens=True)), highlight=False)
            continue
        lines = wrap_ids(ids, console.width - len(head))
        console.print(f"[bold]{head}[/]" + ("\n" + " " * len(head)).join(lines), highlight=False)
    table = make_table(
        "per rank",
        [("rank", "right"), ("prompts", "right"), ("prefill ms", "right"), ("TPOT ms", "right"), ("tok/s", "right")],
    )
    for r in per_rank:
        table.add_row(
            str(r["rank"]),
            str(len(r["prompts"])),
            f"{r['prefill_s'] * 1e3:.1f}",
            f"{r['tpot_s'] * 1e3:.2f}",
            f"{r['tokens_per_s']:.1f}",
        )
    console.print(table)
    print_notes(console, "TPOT: mean time per output token after the first; tok/s: a rank's new tokens / its time")
    if json_path:
        meta = {**result_meta(device=device, world_size=ranks), "checkpoint": str(checkpoint.path)}
        meta.update(dispatcher=args.dispatcher, overlap=args.overlap, max_new_tokens=args.max_new_tokens)
        meta.update(decode=args.decode, mla=args.mla)
        rows = [{"prompt": i, "prompt_ids": prompts[i], "token_ids": ids} for i, ids in sorted(outputs.items())]
        write_json(json_path, {"meta": meta, "rows": rows, "ranks": per_rank}, console, f"written to {json_path}")
    lost = [r for result in per_rank for r in result.get("recoveries", ())]
    if lost:
        first = lost[0]
        console.print(
            f"elastic: rank(s) {list(first['lost'])} lost mid-generation (owning no prompt); the "
            f"{len(per_rank)} others agreed, re-formed in {max(r['t_reform_ms'] for r in lost):.0f} ms, restored "
            f"{len(first['missing_experts'])} expert(s) from the checkpoint and generated on",
            highlight=False,
        )
    console.print(result_line(outputs, per_rank), highlight=False, soft_wrap=True)  # one line, for scripts


def wrap_ids(ids: list[int], width: int) -> list[str]:
    """``ids`` as ``1,2,3`` (as ``--prompt-ids`` takes them), in lines of at most ``width`` columns,
    broken after a comma, never inside an id."""
    lines, line = [], ""
    for i, token in enumerate(ids):
        part = str(token) + ("," if i < len(ids) - 1 else "")
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
    return [*lines, line]


def result_line(outputs: dict[int, list[int]], per_rank: list[dict]) -> str:
    """The closing line: what was generated, and the slowest rank's prefill and time per token."""
    new = sum(len(ids) for ids in outputs.values())
    prefill_ms = max(r["prefill_s"] for r in per_rank) * 1e3
    tpot_ms = max(r["tpot_s"] for r in per_rank) * 1e3
    return (
        f"{new} new tokens for {len(outputs)} prompt(s) on {len(per_rank)} ranks; slowest rank: prefill "
        f"{prefill_ms:.1f} ms, TPOT {tpot_ms:.2f} ms"
    )

"""Host memory a rank adds while ``moe_sbo.hf.model.load_model`` loads a whole model, against what
the rank must hold: its share of the routed experts plus everything else whole.

Writes a random DeepSeek-V3-style checkpoint with ``transformers`` (float32, experts dominating the
bytes), then loads it on ``--ranks`` fresh CPU ranks (gloo) and reports, per rank, the growth of
its peak resident set (``ru_maxrss``) during the load, the bytes it must hold, and the largest
tensor of the checkpoint. Prints one JSON object; ``--out`` writes it too.

Usage (CPU): ``moe-sbo bench load-memory [--ranks 2] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import torch

from ..hf.model import load_model
from ..launch.ranks import LocalRanks
from .generate import deepseek_v3_config


def write_checkpoint(path: Path, experts: int, layers: int) -> None:
    from transformers import DeepseekV3ForCausalLM

    dims = dict(
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
    )
    config = deepseek_v3_config(dims, vocab=8000, layers=layers, experts=experts)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).save_pretrained(path)


def load_rank(device, path: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = load_model(path, dispatcher="alltoall", device=device)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {"peak_rss_growth_mb": (after - before) / 1024, "held_mb": held / 2**20}


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench load-memory``: write the checkpoint, load it on the ranks, print the result."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        write_checkpoint(path, args.experts, args.layers)
        from safetensors import safe_open

        sizes = []
        for file in path.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                sizes += [f.get_slice(n).get_shape() for n in f.keys()]
        largest = max(torch.Size(s).numel() for s in sizes) * 4 / 2**20
        checkpoint_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        with LocalRanks(args.ranks, device="cpu") as ranks:
            per_rank = ranks.run(load_rank, str(path))
    result = {
        "ranks": args.ranks,
        "checkpoint_mb": checkpoint_mb,
        "largest_tensor_mb": largest,
        "per_rank": per_rank,
        "peak_over_held_plus_one_tensor": max(r["peak_rss_growth_mb"] / (r["held_mb"] + largest) for r in per_rank),
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0

"""The router's expert selection: ``routing.router.select_experts`` (torch ops) against
``routing.kernel.select_experts_fused`` (one Triton launch), same logits, one GPU.

Rows (``bench="router"``, ``OUT/router.json``) per preset and token count: ``t_graph_torch_us`` and
``t_graph_triton_us`` (the whole ``Router`` forward — float32 gate GEMM, then the selection —
replayed from a CUDA graph: device time, launch gaps included; None on CPU), ``t_host_torch_us`` and
``t_host_triton_us`` (host time per eager call: the mean of ``--host-calls`` back-to-back calls
without a sync, which is what an eager forward pays on the host), and ``same_experts`` (the two
paths picked the same set for every token).

Usage (GPU): ``moe-sbo bench router --out DIR``; CPU smoke (Triton's interpreter, host times
meaningless): ``moe-sbo bench router --out DIR --device cpu --tokens 4 --host-calls 2``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from ..config import get_preset
from ..measure.results import result_meta
from ..measure.timing import time_fn
from ..routing.router import Router


def host_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Mean host µs per call over ``calls`` back-to-back calls (the device runs behind)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return took / calls * 1e6


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench router``: both selections per preset and token count."""
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    graph = device.type == "cuda"
    rows = []
    for preset in args.presets:
        cfg = get_preset(preset)
        router = Router(cfg, device=device)
        with torch.no_grad():
            router.weight.normal_(0, 0.02)
            router.e_score_correction_bias.normal_(0, 0.05)
        for tokens in args.tokens:
            x = torch.randn(tokens, cfg.hidden_size, device=device, dtype=torch.bfloat16)
            row = {"bench": "router", "preset": preset, "experts": cfg.num_experts, "tokens": tokens}
            picks = {}
            for kernel in ("torch", "triton"):
                router.kernels = kernel
                with torch.inference_mode():
                    picks[kernel] = router(x).topk_ids_TK.sort(dim=-1).values
                    row[f"t_host_{kernel}_us"] = host_us(lambda: router(x), args.host_calls, device)
                    row[f"t_graph_{kernel}_us"] = time_fn(lambda: router(x), device, 3, 20, graph) if graph else None
            row["same_experts"] = bool(torch.equal(picks["torch"], picks["triton"]))
            rows.append(row)
            print(row, flush=True)
    out = args.out / "router.json"
    out.write_text(json.dumps({"meta": result_meta(args.device, 1), "rows": rows}, indent=1))
    return 0

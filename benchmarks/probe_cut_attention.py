"""What attending a cut sequence costs: the second part of a prefill sequence that two-batch overlap
cut in two, against the whole sequence, on one GPU.

A sequence of ``L`` tokens cut after ``start`` tokens (``--cuts``: start / L): the second part's
``L - start`` queries attend to all ``L`` keys with the causal mask aligned bottom-right. Timed in one
run, per cut (CUDA-graph replays, median µs; DeepSeek-V3-sized stand-in: 128 query heads, 8
key/value heads, head dim 128):

- ``whole``: the uncut sequence, ``is_causal`` (what the layer without TBO runs);
- ``first``: the first part alone, ``is_causal``;
- ``second_mask``: the second part with an explicit boolean mask (every query-key block computed);
- ``second_<way>``: the second part through ``model.attention.attend_after_prefix`` with ``way`` =
  ``merge`` (two calls merged by their log-sum-exp; the default), ``padded`` and ``lower_right``;
- ``max_abs_diff``: the second-part outputs against the explicit mask's, and the parts (first, and
  the default way's second) against ``whole``.

Usage (GPU): ``python benchmarks/probe_cut_attention.py --out DIR``. Writes ``DIR/cut_attention.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_sbo.decoder.attention import attend_after_prefix, bottom_right_mask
from moe_sbo.measure.results import result_meta
from moe_sbo.measure.timing import time_fn

WAYS = ("merge", "padded", "lower_right")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 16384])
    parser.add_argument("--cuts", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for length, cut in [(length, cut) for length in args.lengths for cut in args.cuts]:
        q = torch.randn(1, args.heads, length, args.head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, args.kv_heads, length, args.head_dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        start = int(length * cut)
        second = q[0, :, start:]
        mask = bottom_right_mask(start, length - start, device)
        cases = {
            "whole": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "first": lambda: F.scaled_dot_product_attention(
                q[:, :, :start], k[:, :, :start], v[:, :, :start], is_causal=True, enable_gqa=True
            ),
            "second_mask": lambda: F.scaled_dot_product_attention(
                second[None], k, v, attn_mask=mask, enable_gqa=True
            ).squeeze(0),
        }
        for way in WAYS:
            cases[f"second_{way}"] = functools.partial(attend_after_prefix, second, k[0], v[0], start, True, way)
        with torch.inference_mode():
            outs = {name: fn() for name, fn in cases.items()}
            row = {"bench": "cut_attention", "length": length, "start": start}
            for name, fn in cases.items():
                row[f"t_{name}_us"] = time_fn(fn, device, warmup=3, iters=args.iters, graph=True)
        row["max_abs_diff_second"] = max((outs["second_mask"] - outs[f"second_{w}"]).abs().max().item() for w in WAYS)
        row["max_abs_diff_vs_whole"] = max(
            (outs["first"] - outs["whole"][:, :, :start]).abs().max().item(),
            (outs["second_merge"] - outs["whole"][0, :, start:]).abs().max().item(),
        )
        print(row, flush=True)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "cut_attention.json"
    path.write_text(json.dumps({"meta": result_meta("cuda", 1), "rows": rows}, indent=1))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

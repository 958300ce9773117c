"""The routed experts' grouped GEMM with the rows a router gives, whole and cut in two, against equal rows.

Two-batch overlap (TBO) gives each micro-batch half the tokens, so each expert's grouped GEMM half
the rows. With equal rows per expert the GEMM-only benchmark (``bench_fp8_experts.py``) runs 512 and
1,024 rows per expert at nearly the same rate; this probe asks what the router's uneven counts add.
Per (experts, tokens): the bf16 routed-expert MLP (``RoutedExperts``: gate_up, SwiGLU, down through
``torch._grouped_mm``) on

- ``routed``: the counts DeepSeek-V3's router (seeded weights, random tokens) gives the batch;
- ``routed_halves``: the same tokens as two micro-batches (first and second half), one after the other;
- ``equal`` / ``equal_halves``: the same total rows split equally among the experts.

Each is one CUDA graph, timed by ``KernelTimer`` (``triton.testing.do_bench``, L2 cleared, median).
Rows (``bench="uneven_rows"``) in ``OUT/uneven_rows.json`` carry ``t_us``, ``tflops`` (real rows),
``rows_per_expert`` (mean), ``max_over_mean`` (the busiest expert's rows / the mean) and
``tile_waste`` (rows padded up to whole 128-row tiles, as a share of the real rows: a kernel that
tiles each expert's rows by 128 computes that much more), and the halves rows ``ratio_vs_whole``.

Usage (GPU): ``python benchmarks/probe_uneven_rows.py --out DIR``. CPU smoke: ``--device cpu
--quick --experts 8 --tokens 64 --hidden-size 256`` (host clock: not a measurement).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from moe_sbo.config import get_preset
from moe_sbo.dispatch.layout import group_rows_by_expert
from moe_sbo.layer import MoELayer
from moe_sbo.measure.results import ResultFile, result_meta
from moe_sbo.measure.timing import KernelTimer
from moe_sbo.streams import capture_graph

TILE_ROWS = 128


def routed_rows(layer: MoELayer, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_RH: each token's row once per chosen expert, grouped by expert; counts_L), laid out as the
    ``local`` dispatcher lays them out (every expert is on this GPU)."""
    topk = layer.router(x_TH)
    layout = group_rows_by_expert(
        topk.topk_ids_TK, topk.topk_weights_TK, layer.cfg.num_experts, num_pairs=topk.topk_ids_TK.numel()
    )
    return x_TH[layout.row_R], layout.num_rows_per_expert_L


def equal_counts(num_rows: int, num_experts: int, device: torch.device) -> torch.Tensor:
    counts_L = torch.full((num_experts,), num_rows // num_experts, dtype=torch.int64, device=device)
    counts_L[: num_rows % num_experts] += 1
    return counts_L


def shape_of(counts: list[torch.Tensor]) -> dict:
    """Mean rows per expert, the busiest expert's rows / the mean (worst call), and the padding of
    each expert's rows up to whole 128-row tiles as a share of the real rows (all calls)."""
    real = sum(int(c.sum()) for c in counts)
    tiled = sum(int(((c + TILE_ROWS - 1) // TILE_ROWS).sum()) * TILE_ROWS for c in counts)
    mean = real / sum(c.numel() for c in counts)
    return {
        "rows_per_expert": mean,
        "max_over_mean": max(int(c.max()) * c.numel() / int(c.sum()) for c in counts),
        "tile_waste": tiled / real - 1,
    }


def time_calls(layer: MoELayer, calls: list[tuple[torch.Tensor, torch.Tensor]], timer: KernelTimer) -> float:
    """µs of the experts run on each (x_RH, counts_L) in turn, as one CUDA graph (eager off CUDA)."""

    def run() -> None:
        for x_RH, counts_L in calls:
            layer.experts(x_RH, counts_L)

    if layer.experts.gate_up_proj.device.type != "cuda":
        return timer(run)
    graph, _ = capture_graph(run)
    return timer(graph.replay)


def probe(num_experts: int, tokens: int, args, timer: KernelTimer, device: torch.device) -> list[dict]:
    cfg = get_preset("deepseek-v3").with_num_experts(num_experts)
    if args.hidden_size:
        cfg = cfg.replace(hidden_size=args.hidden_size)
    layer = MoELayer(cfg, device=device, seed=0)
    generator = torch.Generator(device=device).manual_seed(tokens)
    x_TH = torch.randn(tokens, cfg.hidden_size, generator=generator, device=device).to(layer.dtype)
    k, half = cfg.num_experts_per_tok, tokens // 2
    rows = []
    with torch.no_grad():
        whole = [routed_rows(layer, x_TH)]
        halves = [routed_rows(layer, x_TH[:half]), routed_rows(layer, x_TH[half:])]
        x_RH = whole[0][0]
        equal = [(x_RH, equal_counts(tokens * k, num_experts, device))]
        equal_halves = [(x_RH[: half * k], equal_counts(half * k, num_experts, device))] * 2
        cases = {"routed": whole, "routed_halves": halves, "equal": equal, "equal_halves": equal_halves}
        times = {}
        for case, calls in cases.items():
            times[case] = time_calls(layer, calls, timer)
            flops = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * sum(int(c.sum()) for _, c in calls)
            row = {
                "bench": "uneven_rows",
                "case": case,
                "experts": num_experts,
                "tokens": tokens,
                "top_k": k,
                "t_us": times[case],
                "tflops": flops / times[case] / 1e6,
                **shape_of([c for _, c in calls]),
            }
            if case.endswith("_halves"):
                row["ratio_vs_whole"] = times[case] / times[case.removesuffix("_halves")]
            rows.append(row)
            print(
                f"E={num_experts:3d} T={tokens:6d} {case:14s} {row['t_us']:9.1f} us {row['tflops']:6.1f} TFLOP/s "
                f"rows/expert {row['rows_per_expert']:7.1f} max/mean {row['max_over_mean']:.2f} "
                f"tile waste {row['tile_waste']:.3f}"
                + (f" x whole {row['ratio_vs_whole']:.3f}" if "ratio_vs_whole" in row else ""),
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="short timings (CPU smoke)")
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 8], help="routed experts on the GPU")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--hidden-size", type=int, default=None, help="override DeepSeek-V3's H (smoke runs)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    results = ResultFile(args.out / "uneven_rows.json", result_meta(device.type, 1))
    timer = KernelTimer(device, args.quick)
    results.meta["timer"] = timer.name
    for num_experts in args.experts:
        for tokens in args.tokens:
            results.rows.extend(probe(num_experts, tokens, args, timer, device))
            results.save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

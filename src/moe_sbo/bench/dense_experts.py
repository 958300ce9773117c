"""Dense routed experts from decode to prefill sizes: ``gemv_kernels``' grouped GEMV,
``tiled_gemm``' tiled grouped GEMM and ``torch._grouped_mm``, one GPU, DeepSeek-V3 dims,
against the weight-read floor and the compute floor measured in the same run.

Rows (``bench="gemv"``, ``OUT/gemv.json``) per experts on the GPU (L: 8, 16, 32 by default; EP2's
share of 16, 32 and 64) and rows in all (R, every one real: the experts' rule counts the rows to
expect, ``DispatchOutput.expected_rows``), each row on one of the L experts at random (seeded;
``--draw equal``: R / L rows on every expert, as a router's top-k of as many experts gives them;
the row's ``draw`` says which): ``t_gemv_us``,
``t_tiled_us`` and ``t_grouped_mm_us`` for the whole routed MLP (gate_up, SwiGLU, down; ``measure.timing.KernelTimer``:
``triton.testing.do_bench`` median, L2 cleared, each call launched from the host; ``--graph``: replayed from
a CUDA graph, the kernels' GPU time alone, as a replayed layer runs them, and the rows say ``graph``;
the GEMV is not timed above ``--gemv-max-rows``, where
it re-reads each weight slice per 16 rows), ``experts_with_rows``; ``t_floor_us`` = max(the touched
experts' weight bytes at ``read_gbps``, the rate a sum over a 2 GB buffer reads HBM at in the same
run; the MLP's FLOPs at ``mm_tflops``, a dense 8192 x 7168 x 4096 bf16 ``torch.mm`` in the same run),
each time's ratio to it, and ``rel_err_*`` (||kernel - grouped_mm|| / ||grouped_mm||). The data
behind ``experts.conditions.GEMV_MAX_ROWS_PER_EXPERT`` and ``TILED_MAX_ROWS_PER_EXPERT``. SwiGLU between
the GEMMs alone on ``[R, 2I]`` rows: ``t_swiglu_us`` (``experts.swiglu``, one launch),
``t_swiglu_torch_us`` (torch's two) and ``t_swiglu_floor_us`` (3 x R x I bf16 values at ``read_gbps``).

``--sweep`` writes instead rows (``bench="dense_gemm_config"``, ``OUT/dense_gemm_config.json``) timing
each GEMM of the MLP (gate_up, down) alone through the tiled GEMM under each tile config of
``SWEEP_CONFIGS``, equal rows per expert, with
``tflops`` and ``t_floor_us`` (that GEMM's weight read or FLOPs, whichever takes longer at the run's
rates): the data behind ``tiled_gemm.dense_config``.

Usage (GPU): ``moe-sbo bench dense-experts --out DIR [--sweep]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch

from ..experts.routed import RoutedExperts
from ..experts.swiglu import swiglu
from ..experts.tiled_gemm import grouped_gemm
from ..experts.tiles import GemmConfig
from ..measure.results import result_meta
from ..measure.timing import KernelTimer, memory_read_us

READ_PROBE_BYTES = 1 << 31  # the buffer the read rate is measured on: 2 GB, far past L2
PATHS = {"gemv": "gemv", "tiled": "tiled", "grouped_mm": "torch"}  # row key -> RoutedExperts.kernels
POINTER_CONFIGS = [
    GemmConfig(block_m, block_n, group_m, warps, stages, block_k)
    for block_m, block_n, group_m, warps, stages, block_k in [
        (32, 128, 8, 4, 4, 128),
        (64, 64, 8, 4, 4, 128),
        (64, 128, 8, 4, 4, 64),
        (64, 128, 8, 4, 4, 128),
        (64, 256, 8, 4, 3, 64),
        (64, 256, 8, 4, 4, 64),
        (128, 64, 8, 4, 4, 64),
        (128, 128, 8, 4, 4, 64),
        (128, 128, 8, 8, 4, 64),
        (128, 256, 8, 8, 3, 64),
        (128, 256, 8, 8, 4, 64),
        (256, 128, 8, 8, 3, 64),
    ]
]
# The same tiles with tensor-descriptor loads (``tiled_gemm.dense_config``'s from 256 rows per expert).
SWEEP_CONFIGS = POINTER_CONFIGS + [dataclasses.replace(c, tma=True) for c in POINTER_CONFIGS]


def row_counts(num_experts: int, num_rows: int, draw: str) -> torch.Tensor:
    """Rows per expert [L] (int64, CPU): each of the R rows on a random expert (seeded by R), or R / L
    on every expert (``"equal"``; the first R mod L experts one more)."""
    if draw == "equal":
        counts = torch.full((num_experts,), num_rows // num_experts, dtype=torch.int64)
        counts[: num_rows % num_experts] += 1
        return counts
    generator = torch.Generator().manual_seed(num_rows)
    return torch.bincount(torch.randint(num_experts, (num_rows,), generator=generator), minlength=num_experts)


def config_name(config: GemmConfig) -> str:
    """``128x256x64_g8_w8_s3``, with ``_tma`` appended for descriptor loads."""
    c = config
    return f"{c.block_m}x{c.block_n}x{c.block_k}_g{c.group_m}_w{c.num_warps}_s{c.num_stages}" + ("_tma" * c.tma)


def pick_configs(patterns: list[str] | None) -> list[GemmConfig]:
    """``SWEEP_CONFIGS`` whose names contain one of ``patterns`` (all of them without any)."""
    if not patterns:
        return SWEEP_CONFIGS
    picked = [c for c in SWEEP_CONFIGS if any(p in config_name(c) for p in patterns)]
    if not picked:
        raise ValueError(
            f"--configs must match a tile config, got {patterns}; names look like {config_name(SWEEP_CONFIGS[0])}"
        )
    return picked


def dense_mm_tflops(timer: KernelTimer, device: torch.device) -> float:
    """TFLOP/s of one large bf16 ``torch.mm`` (8192 x 7168 x 4096): the compute rate the floor uses."""
    a = torch.randn(8192, 7168, dtype=torch.bfloat16, device=device)
    b = torch.randn(7168, 4096, dtype=torch.bfloat16, device=device)
    return 2 * 8192 * 7168 * 4096 / timer(lambda: a @ b) / 1e6


def sweep_case(
    num_experts: int,
    per_expert: int,
    hidden: int,
    inter: int,
    timer: KernelTimer,
    gbps: float,
    tflops: float,
    configs: list[GemmConfig],
) -> list[dict]:
    """gate_up and down alone through the tiled GEMM under each of ``configs``, and through
    ``torch._grouped_mm`` (the row with ``kernel="grouped_mm"``), equal rows."""
    device = torch.device("cuda")
    offsets_L = torch.arange(1, num_experts + 1, device=device, dtype=torch.int32) * per_expert
    rows = num_experts * per_expert
    shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    out = []
    for gemm, (n, k) in shapes.items():
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
        w = torch.randn(num_experts, n, k, dtype=torch.bfloat16, device=device) * k**-0.5
        floor_us = max(w.numel() * 2 / (gbps * 1e3), 2 * rows * n * k / (tflops * 1e6))
        for config in [None, *configs]:
            row: dict[str, Any] = {
                "bench": "dense_gemm_config",
                "gemm": gemm,
                "experts": num_experts,
                "rows_per_expert": per_expert,
            }
            if config is None:
                row["kernel"] = "grouped_mm"
            else:
                row.update(kernel="tiled", config=config_name(config), **vars(config))
            try:
                if config is None:
                    t_us = timer(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets_L))
                else:
                    t_us = timer(lambda: grouped_gemm(x, w, offsets_L, config=config))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not the end
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            else:
                row.update(
                    t_us=t_us, tflops=2 * rows * n * k / t_us / 1e6, t_floor_us=floor_us, floor_ratio=t_us / floor_us
                )
            out.append(row)
        timed = [r for r in out if r["gemm"] == gemm and "t_us" in r]
        best = min((r for r in timed if r["kernel"] == "tiled"), key=lambda r: r["t_us"], default=None)
        if best:
            reference = next((r["t_us"] for r in timed if r["kernel"] == "grouped_mm"), float("nan"))
            print(
                f"{gemm} L={num_experts} {per_expert} rows/expert: best {best['config']} {best['t_us']:.1f} us "
                f"({best['floor_ratio']:.2f}x floor), torch._grouped_mm {reference:.1f} us",
                flush=True,
            )
    return out


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench dense-experts``: the routed MLP per path, experts and rows (``--sweep``: each
    GEMM per tile config)."""
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    timer = KernelTimer(device, quick=False, graph=args.graph)
    gbps = READ_PROBE_BYTES / memory_read_us(READ_PROBE_BYTES, device) / 1e3
    tflops = dense_mm_tflops(timer, device)
    print(f"read {gbps:.0f} GB/s, dense mm {tflops:.0f} TFLOP/s", flush=True)
    if args.sweep:
        configs, rows, meta = pick_configs(args.configs), [], result_meta("cuda", 1)
        for num_experts in args.experts:
            for per_expert in args.rows_per_expert:
                rows += sweep_case(
                    num_experts, per_expert, args.hidden, args.intermediate, timer, gbps, tflops, configs
                )
                # Saved after each case: a run stopped at a time limit keeps what it measured.
                (args.out / "dense_gemm_config.json").write_text(json.dumps({"meta": meta, "rows": rows}))
        return 0
    rows = []
    for num_experts in args.experts:
        experts = RoutedExperts(num_experts, args.hidden, args.intermediate, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            experts.gate_up_proj.normal_(std=args.hidden**-0.5)
            experts.down_proj.normal_(std=args.intermediate**-0.5)
        expert_bytes = 3 * args.hidden * args.intermediate * 2
        for num_rows in args.rows:
            counts = row_counts(num_experts, num_rows, args.draw)
            counts_dev = counts.cuda()
            x = torch.randn(num_rows, args.hidden, dtype=torch.bfloat16, device="cuda")
            times, outs = {}, {}
            for name, kernels in PATHS.items():
                if name == "gemv" and num_rows > args.gemv_max_rows:
                    continue
                experts.kernels = kernels

                def forward():
                    return experts(x, counts_dev)

                with torch.no_grad():
                    outs[name] = forward()
                    times[name] = timer(forward)
            touched = int((counts > 0).sum())
            read_floor_us = touched * expert_bytes / (gbps * 1e9) * 1e6
            compute_floor_us = 2 * num_rows * 3 * args.hidden * args.intermediate / (tflops * 1e6)
            floor_us = max(read_floor_us, compute_floor_us)
            ref = outs["grouped_mm"].float()
            row = {
                "bench": "gemv",
                "experts": num_experts,
                "rows": num_rows,
                "rows_per_expert": num_rows / num_experts,
                "draw": args.draw,
                "graph": args.graph,
                "experts_with_rows": touched,
                "t_read_floor_us": read_floor_us,
                "t_compute_floor_us": compute_floor_us,
                "t_floor_us": floor_us,
                "read_gbps": gbps,
                "mm_tflops": tflops,
            }
            for name, t in times.items():
                row[f"t_{name}_us"] = t
                row[f"{name}_floor_ratio"] = t / floor_us
                if name != "grouped_mm":
                    row[f"rel_err_{name}"] = ((outs[name].float() - ref).norm() / ref.norm()).item()
            # SwiGLU between the GEMMs alone, one launch against torch's two, beside its floor: gate and
            # up read once, the product written once, at the run's read rate.
            gate_up = torch.randn(num_rows, 2 * args.intermediate, dtype=torch.bfloat16, device="cuda")
            offsets_L = counts_dev.cumsum(0, dtype=torch.int32)
            row["t_swiglu_us"] = timer(lambda: swiglu(gate_up, offsets_L))
            row["t_swiglu_torch_us"] = timer(lambda: swiglu(gate_up, offsets_L, kernels="torch"))
            row["t_swiglu_floor_us"] = 3 * num_rows * args.intermediate * 2 / (gbps * 1e3)
            best = min(times, key=times.__getitem__)
            row["fastest"] = best
            if "gemv" in times:
                row["speedup"] = times["grouped_mm"] / times["gemv"]  # the GEMV against grouped_mm
            row["speedup_tiled"] = times["grouped_mm"] / times["tiled"]
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    meta = result_meta("cuda", 1)
    (args.out / "gemv.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0

"""FP8 routed experts against bf16 on the same weights, one GPU, DeepSeek-V3 dims.

Rows (``bench="fp8_experts"``) in ``OUT/fp8_experts.json``, per experts on the GPU (L, default 8 and
32) and rows per expert (decode 16-512, prefill 512-4096), each for ``weight_dtype`` ``bf16``
(``torch._grouped_mm``) and ``fp8`` (``fp8_gemm``: quantise, block-scaled grouped GEMM, SwiGLU and
quantise, grouped GEMM): the whole routed-expert MLP (gate_up, SwiGLU, down), ``t_us`` the median
of CUDA-graph replays (``triton.testing.do_bench``, L2 cleared between runs, so weights are read from
HBM as in a model; a graph runs the Triton GEMMs), ``t_eager_us`` the same forward issued eagerly
(from 2048 rows per expert the eager FP8 forward runs cuBLAS's block-wise GEMMs: ``eager_path``);
``tflops`` (2 x rows x 3 x H x I per expert row), ``weight_gbps`` (weight bytes read / t),
``speedup_vs_bf16`` (bf16 t / fp8 t), ``speedup_eager_vs_bf16`` (the same for the eager times) and,
on fp8 rows, ``rel_err_vs_bf16``: ||y_fp8 - y_bf16|| / ||y_bf16|| with the bf16 experts holding the
dequantised FP8 weights (so the error is the activations' quantisation and the GEMMs' rounding).

Layer rows (``bench="fp8_layer"``): the whole MoE layer on this GPU per ``--layer-tokens`` (decode
sizes, and 4096 tokens: prefill; EP1, ``low_latency``,
``--layer-experts`` routed experts: one GPU's share at EP8 of DeepSeek-V3 by default), replayed from a
CUDA graph, for ``experts`` bf16 or fp8 and ``dispatch`` bf16 or fp8 (fp8 dispatch hands e4m3 rows
straight to FP8 experts), with ``speedup_vs_bf16`` against bf16 experts and bf16 dispatch, and on the
FP8 row ``rel_err_vs_bf16`` against the bf16 layer holding the same weights dequantised. On CUDA the
fp8 MLP rows and the sweep's rows carry ``ref_scaled_mm_tflops``: the GPU's FP8 rate on the same GEMM
shapes (cuBLAS's row-wise ``torch._scaled_mm``, replayed in the same run; it multiplies every row by one
expert's weights, so at decode sizes, where reading all L experts' weights is the cost, it is no floor).

``--sweep`` adds rows (``bench="fp8_gemm_config"``) timing each GEMM alone for each tile config, the
data behind ``fp8_gemm.gemm_config``, and the quantisers between them (``quantize_rows`` of rows read
through an index: ``gather_then_quantize`` against ``quantize_through_index``).

Usage (GPU): ``moe-sbo bench fp8-experts --out DIR [--sweep]``. CPU smoke (Triton interpreter):
``TRITON_INTERPRET=1 moe-sbo bench fp8-experts --out DIR --device cpu --quick``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from ..config import get_preset
from ..experts import fp8_gemm, fp8_gemm_sm90
from ..experts.conditions import Conditions
from ..experts.fp8_torch import grouped_scaled_mm
from ..experts.routed import RoutedExperts
from ..experts.routes import SCALED_MM
from ..layer import MoELayer
from ..measure.results import ResultFile, result_meta
from ..measure.timing import KernelTimer, time_fn
from ..quant import kernels as quant_kernels
from ..streams import capture_graph
from ..weights import layer_weights, seeded_normal

SWEEP_CONFIGS = [
    fp8_gemm.GemmConfig(block_m, block_n, group_m, warps, stages, tma=tma)
    for block_m, block_n, group_m, warps, stages in [
        (64, 128, 4, 4, 4),
        (128, 128, 8, 8, 3),
        (128, 128, 8, 8, 4),
        (128, 64, 8, 4, 4),
        (128, 256, 8, 8, 3),
        # decode (weight-read bound): smaller row tiles leave shared memory for deeper pipelines
        (16, 128, 1, 4, 6),
        (32, 128, 1, 4, 6),
        (64, 128, 4, 4, 6),
        (16, 256, 1, 4, 4),
    ]
    for tma in (False, True)
]


# The warp-specialised sm90 kernel (fp8_gemm_sm90): three and two consumer warp groups (192- and 128-row
# tiles; ``config_for`` chooses between them by rows per expert), two with 1, 2 or 4 K steps per turn
# (each step's MMA issued before the previous product is promoted) and 4 or 5 stages.
SM90_SWEEP_CONFIGS = [
    fp8_gemm_sm90.DEFAULT_CONFIG,
    *(
        dataclasses.replace(fp8_gemm_sm90.TWO_CONSUMERS_CONFIG, k_unroll=k_unroll, stages=stages)
        for k_unroll, stages in ((1, 4), (2, 4), (4, 4), (4, 5))
    ),
]


def make_experts(num_experts: int, hidden: int, inter: int, device: torch.device, dtype: torch.dtype):
    """FP8 experts with seeded weights, and dense experts holding the same weights dequantised."""
    fp8 = RoutedExperts(num_experts, hidden, inter, dtype=dtype, device=device, fp8=True)
    dense = RoutedExperts(num_experts, hidden, inter, dtype=dtype, device=device)
    for e in range(num_experts):
        fp8.set_expert(
            e,
            seeded_normal((2 * inter, hidden), hidden**-0.5, 0, "gate_up", e, device),
            seeded_normal((hidden, inter), inter**-0.5, 0, "down", e, device),
        )
        dense.set_expert(
            e, fp8.gate_up_proj[e], fp8.down_proj[e], fp8.gate_up_proj_scale_inv[e], fp8.down_proj_scale_inv[e]
        )
    return fp8, dense


def graph_time(fn: Callable[[], object], timer: KernelTimer, device: torch.device) -> float:
    """Median µs of replays of a CUDA graph holding one ``fn()`` (eager ``fn`` off CUDA)."""
    if device.type != "cuda":
        return timer(fn)
    graph, _ = capture_graph(fn)
    return timer(graph.replay)


def bench_case(fp8, dense, rows_per_expert: int, timer: KernelTimer, device: torch.device, dtype) -> list[dict]:
    num_experts, hidden, inter = fp8.num_local_experts, fp8.gate_up_proj.shape[2], fp8.down_proj.shape[2]
    counts_L = torch.full((num_experts,), rows_per_expert, dtype=torch.int64, device=device)
    generator = torch.Generator(device=device).manual_seed(rows_per_expert)
    x_RH = torch.randn(num_experts * rows_per_expert, hidden, generator=generator, device=device).to(dtype)
    with torch.no_grad():
        y_fp8 = fp8(x_RH, counts_L).float()
        y_dense = dense(x_RH, counts_L).float()
    rel_err = ((y_fp8 - y_dense).norm() / y_dense.norm()).item()
    flops = 2 * num_experts * rows_per_expert * 3 * hidden * inter
    out = []
    for name, experts in (("bf16", dense), ("fp8", fp8)):
        with torch.no_grad():
            t_us = graph_time(lambda: experts(x_RH, counts_L), timer, device)
            t_eager_us = timer(lambda: experts(x_RH, counts_L))
        weight_bytes = num_experts * 3 * hidden * inter * (1 if name == "fp8" else 2)
        out.append(
            {
                "bench": "fp8_experts",
                "weight_dtype": name,
                "experts": num_experts,
                "rows_per_expert": rows_per_expert,
                "phase": "decode" if rows_per_expert <= 256 else "prefill",
                "t_us": t_us,
                "t_eager_us": t_eager_us,
                "tflops": flops / t_us / 1e6,
                "weight_gbps": weight_bytes / t_us / 1e3,
            }
        )
    out[1]["speedup_vs_bf16"] = out[0]["t_us"] / out[1]["t_us"]
    out[1]["speedup_eager_vs_bf16"] = out[0]["t_eager_us"] / out[1]["t_eager_us"]
    out[1]["eager_path"] = fp8.route(x_RH).name  # a graph never runs "scaled_mm"
    out[1]["rel_err_vs_bf16"] = rel_err
    if device.type == "cuda":
        # The GPU's FP8 rate on the MLP's two GEMM shapes (cuBLAS row-wise, all rows against expert 0's
        # weights, replayed), as the MLP's TFLOP/s would be at it.
        t_ref_us = 0.0
        for w_NK, k in ((fp8.gate_up_proj[0], hidden), (fp8.down_proj[0], inter)):
            q_RK = torch.randn(x_RH.shape[0], k, generator=generator, device=device).to(torch.float8_e4m3fn)
            ones_R1, ones_1N = torch.ones(x_RH.shape[0], 1, device=device), torch.ones(1, w_NK.shape[0], device=device)
            t_ref_us += graph_time(
                lambda: torch._scaled_mm(q_RK, w_NK.t(), ones_R1, ones_1N, out_dtype=dtype),
                timer,
                device,
            )
        out[1]["ref_scaled_mm_tflops"] = flops / t_ref_us / 1e6
    return out


def sweep_case(
    fp8, rows_per_expert: int, timer: KernelTimer, device: torch.device, dtype, configs: list[fp8_gemm.GemmConfig]
) -> list[dict]:
    """Each GEMM alone under each tile config, beside the hardware's FP8 rate on the same shape
    (cuBLAS's row-wise ``torch._scaled_mm`` over all the rows against one expert's weight) and
    cuBLAS's block-wise GEMM once per expert; and ``silu_mul_quantize`` between them."""
    num_experts, hidden, inter = fp8.num_local_experts, fp8.gate_up_proj.shape[2], fp8.down_proj.shape[2]
    rows = num_experts * rows_per_expert
    offsets_L = torch.arange(1, num_experts + 1, device=device, dtype=torch.int32) * rows_per_expert
    generator = torch.Generator(device=device).manual_seed(1)
    # Scales K-major, as the MLP's quantisers write them (the sm90 kernel would copy row-major ones).
    x_RH, h_RI = (torch.randn(rows, width, generator=generator, device=device) for width in (hidden, inter))
    q_x, s_x = quant_kernels.quantize_rows(x_RH, offsets_L, k_major=True)
    q_h, s_h = quant_kernels.quantize_rows(h_RI, offsets_L, k_major=True)
    gate_up_R2I = torch.randn(rows, 2 * inter, generator=generator, device=device).to(dtype)
    gemms = {
        "gate_up": (q_x, s_x, fp8.gate_up_proj, fp8.gate_up_proj_scale_inv),
        "down": (q_h, s_h, fp8.down_proj, fp8.down_proj_scale_inv),
    }
    case = {"experts": num_experts, "rows_per_expert": rows_per_expert}
    out = []

    def row(gemm: str, n: int, k: int, fn: Callable[[], object], **extra) -> None:
        entry = {"bench": "fp8_gemm_config", "gemm": gemm, **case, **extra}
        try:
            t_us = timer(fn)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not the end
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        else:
            entry.update(t_us=t_us, tflops=2 * rows * n * k / t_us / 1e6, weight_gbps=num_experts * n * k / t_us / 1e3)
        out.append(entry)

    for gemm, (q, s, w, ws) in gemms.items():
        n, k = w.shape[1], w.shape[2]
        for config in configs:
            row(
                gemm,
                n,
                k,
                lambda: fp8_gemm.grouped_gemm(q, s, w, ws, offsets_L, dtype, config),
                **vars(config),
            )
        if fp8_gemm_sm90.supported(q, w):
            for ws_config in SM90_SWEEP_CONFIGS:
                row(
                    gemm,
                    n,
                    k,
                    lambda: fp8_gemm_sm90.grouped_gemm(q, s, w, ws, offsets_L, dtype, ws_config),
                    impl="sm90_ws",
                    block_m=ws_config.block_m,
                    **vars(ws_config),
                )
        if device.type == "cuda":
            # The GPU's FP8 rate on this shape: cuBLAS row-wise over all rows against expert 0's weight.
            w_KN = w[0].t()
            ones_R1 = torch.ones(rows, 1, device=device)
            ones_1N = torch.ones(1, n, device=device)
            row(
                gemm,
                n,
                k,
                lambda: torch._scaled_mm(q, w_KN, ones_R1, ones_1N, out_dtype=dtype),
                impl="scaled_mm_rowwise",
            )
            if SCALED_MM.supports(Conditions.of(q, True, rows_per_expert)) is None:
                counts = [rows_per_expert] * num_experts
                row(
                    gemm,
                    n,
                    k,
                    lambda: grouped_scaled_mm(q, s, w, ws, counts, dtype),
                    impl="scaled_mm_blockwise_per_expert",
                )
    row(
        "silu_mul_quantize",
        inter,
        1,
        lambda: quant_kernels.silu_mul_quantize(gate_up_R2I, offsets_L, k_major=True),
        impl="silu_mul_quantize",
    )
    # The rows entering gate_up read through an index into a wider receive buffer (low_latency's
    # index_rows): copied into expert order and then quantised, or quantised where they lie.
    buffer = torch.randn(rows + num_experts, hidden + 128, generator=generator, device=device).to(dtype)
    x_view, rows_R = buffer[:, :hidden], torch.randperm(rows + num_experts, device=device)[:rows]
    for impl, fn in (
        (
            "gather_then_quantize",
            lambda: quant_kernels.quantize_rows(x_view.index_select(0, rows_R), offsets_L, k_major=True),
        ),
        ("quantize_through_index", lambda: quant_kernels.quantize_rows(x_view, offsets_L, rows_R, k_major=True)),
    ):
        row("quantize_rows", hidden, 1, fn, impl=impl)
    for gemm in gemms:
        ref = next((r for r in out if r["gemm"] == gemm and r.get("impl") == "scaled_mm_rowwise" and "t_us" in r), None)
        for r in out:
            if ref and r["gemm"] == gemm and "t_us" in r:
                r["ref_scaled_mm_tflops"] = ref["tflops"]
    return out


def print_sweep(rows: list[dict]) -> None:
    """The best config per GEMM and size, beside the references, as a table."""
    table = Table(title="FP8 GEMMs alone (CUDA-graph replay)")
    for column in (
        "gemm",
        "L",
        "rows/expert",
        "best Triton config",
        "µs",
        "TFLOP/s",
        "sm90 µs (TFLOP/s)",
        "row-wise cuBLAS µs",
        "best vs row-wise",
        "block-wise cuBLAS µs",
        "failed",
    ):
        table.add_column(column)
    keys = sorted({(r["gemm"], r["experts"], r["rows_per_expert"]) for r in rows if r["gemm"] != "silu_mul_quantize"})
    for gemm, experts, per_expert in keys:
        same = [r for r in rows if (r["gemm"], r["experts"], r["rows_per_expert"]) == (gemm, experts, per_expert)]
        ours = [r for r in same if "impl" not in r and "t_us" in r]
        ref = next((r for r in same if r.get("impl") == "scaled_mm_rowwise" and "t_us" in r), None)
        blockwise = next((r for r in same if r.get("impl") == "scaled_mm_blockwise_per_expert" and "t_us" in r), None)
        sm90 = min(
            (r for r in same if r.get("impl") == "sm90_ws" and "t_us" in r), key=lambda r: r["t_us"], default=None
        )
        if not ours:
            continue
        best = min(ours, key=lambda r: r["t_us"])
        best_t = min(best["t_us"], sm90["t_us"]) if sm90 else best["t_us"]
        name = f"{best['block_m']}x{best['block_n']} w{best['num_warps']} s{best['num_stages']}" + (
            " tma" if best["tma"] else ""
        )
        ref_t = ref["t_us"] if ref else None
        table.add_row(
            gemm,
            str(experts),
            str(per_expert),
            name,
            f"{best['t_us']:.1f}",
            f"{best['tflops']:.0f}",
            f"{sm90['t_us']:.1f} ({sm90['tflops']:.0f}) {sm90['consumers']}x64 s{sm90['stages']} u{sm90['k_unroll']}"
            if sm90
            else "-",
            f"{ref_t:.1f}" if ref_t else "-",
            f"{ref_t / best_t:.2f}" if ref_t else "-",
            f"{blockwise['t_us']:.1f}" if blockwise else "-",
            str(sum("error" in r for r in same)),
        )
    Console(width=160).print(table)
    for r in rows:
        if r["gemm"] in ("silu_mul_quantize", "quantize_rows") and "t_us" in r:
            print(f"{r['impl']:24s} L={r['experts']:3d} rows/expert={r['rows_per_expert']:5d} {r['t_us']:8.1f} us")


def layer_rows(
    num_experts: int, tokens_list: list[int], device: torch.device, quick: bool, hidden: int, inter: int
) -> list[dict]:
    """The layer (EP1, low_latency, DeepSeek-V3's routing at ``hidden`` x ``inter``) per tokens x
    experts x dispatch dtype, graph-replayed; the FP8 row's ``rel_err_vs_bf16`` against the bf16
    layer holding its weights dequantised."""
    cfg = (
        get_preset("deepseek-v3").with_num_experts(num_experts).replace(hidden_size=hidden, moe_intermediate_size=inter)
    )
    out = []
    for tokens in tokens_list:
        x = torch.randn(tokens, cfg.hidden_size, device=device).to(
            torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        base = None
        reference = None  # the bf16 layer, which takes the FP8 layer's weights dequantised at the end
        for experts, dispatch in (("bf16", "bf16"), ("bf16", "fp8"), ("fp8", "fp8")):
            layer = MoELayer(
                cfg,
                dispatcher="low_latency",
                dispatcher_options={"max_tokens_per_rank": tokens, "fp8": dispatch == "fp8"},
                device=device,
                expert_dtype="fp8" if experts == "fp8" else None,
            )
            with torch.no_grad():
                t_us = time_fn(
                    partial(layer, x),
                    device,
                    3 if quick else 20,
                    5 if quick else 200,
                    graph=device.type == "cuda",
                )
            base = base or t_us
            row = {
                "bench": "fp8_layer",
                "experts_dtype": experts,
                "dispatch_dtype": dispatch,
                "experts": num_experts,
                "tokens": tokens,
                "rows_per_expert": tokens * cfg.num_experts_per_tok / num_experts,
                "graph": device.type == "cuda",
                "t_layer_us": t_us,
                "speedup_vs_bf16": base / t_us,
            }
            if reference is None:
                reference = layer
            elif experts == "fp8":
                reference.load_weights(layer_weights(layer))
                with torch.no_grad():
                    y, y_ref = layer(x).float(), reference(x).float()
                row["rel_err_vs_bf16"] = ((y - y_ref).norm() / y_ref.norm()).item()
            out.append(row)
            print(
                f"layer L={num_experts} tokens={tokens:4d} experts {experts} dispatch {dispatch}: {t_us:8.1f} us "
                f"({base / t_us:.2f}x)",
                flush=True,
            )
            del layer
    return out


def main(args: argparse.Namespace) -> int:
    """``moe-sbo bench fp8-experts``: the MLP rows per experts and rows per expert (and the sweep's),
    then the layer rows."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    results = ResultFile(args.out / "fp8_experts.json", result_meta(device.type, 1))
    timer = KernelTimer(device, args.quick)
    # Each GEMM alone is the GPU's time: replayed from a graph (a launch's host cost would show below
    # ~50 µs), as the layer runs it.
    gemm_timer = KernelTimer(device, args.quick, graph=True)
    results.meta["timer"] = timer.name
    results.meta["sweep_timer"] = gemm_timer.name
    for num_experts in args.experts:
        fp8, dense = make_experts(num_experts, args.hidden_size, args.intermediate_size, device, dtype)
        for rows_per_expert in [*args.decode_rows, *args.prefill_rows]:
            if num_experts * rows_per_expert > args.max_rows:
                continue
            new = [] if args.sweep_only else bench_case(fp8, dense, rows_per_expert, timer, device, dtype)
            if args.sweep or args.sweep_only:
                configs = list(fp8_gemm.GEMM_CONFIGS) if args.sweep_chosen else SWEEP_CONFIGS
                new += sweep_case(fp8, rows_per_expert, gemm_timer, device, dtype, configs)
                print(f"sweep L={num_experts} rows/expert={rows_per_expert}: {len(new)} rows", flush=True)
            results.rows.extend(new)
            results.save()
            for row in new:
                if row["bench"] == "fp8_experts":
                    extra = (
                        f" speedup {row['speedup_vs_bf16']:.2f} err {row['rel_err_vs_bf16']:.2e}"
                        if "speedup_vs_bf16" in row
                        else ""
                    )
                    print(
                        f"L={num_experts:3d} rows/expert={rows_per_expert:5d} {row['weight_dtype']:5s} "
                        f"{row['t_us']:9.1f} us (eager {row['t_eager_us']:9.1f}) {row['tflops']:7.1f} TFLOP/s "
                        f"{row['weight_gbps']:7.0f} GB/s{extra}",
                        flush=True,
                    )
        del fp8, dense
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.sweep or args.sweep_only:
        print_sweep([row for row in results.rows if row["bench"] == "fp8_gemm_config"])
    if args.layer_tokens and not args.sweep_only:
        results.rows.extend(
            layer_rows(
                args.layer_experts, args.layer_tokens, device, args.quick, args.hidden_size, args.intermediate_size
            )
        )
        results.save()
    return 0

"""Would a grouped GEMM that reads its rows through the receiver's index beat gather + ``torch._grouped_mm``?

``low_latency``'s dispatch ends with a copy: every (token, local expert) pair's row is copied out of
the receive buffer into expert-major order (``ll_kernels.gather_rows``), because ``torch._grouped_mm``
needs each expert's rows contiguous. At EP2 and 4096 tokens per rank that copy is most of the gap
between the dispatch phase and the raw wire (docs/BENCHMARKS.md). The copy disappears if the
routed experts' first GEMM (gate_up) reads its A rows through the layout's index instead. This probe
asks whether a Triton grouped GEMM doing that is fast enough to pay: per row count R it times, on
one GPU, at DeepSeek-V3 dims (H = 7168, 2I = 4096, 32 local experts, bf16):

- ``gather``: ``ll_kernels.gather_rows`` from a real packed receive buffer (what dispatch does now);
- ``grouped_mm``: ``torch._grouped_mm`` on the gathered rows (what the experts do now);
- ``triton_contiguous``: ``grouped_gemm_kernels.grouped_gemm`` on the gathered rows (the kernel's own rate);
- ``triton_gather``: the same kernel reading the receive buffer's rows through the index (no copy),

each config of a small sweep, and reports ``gather + grouped_mm`` against the best ``triton_gather``.
The routing: each of S = P * T received tokens picks 8 distinct experts of 64 (P = 2), the pairs on
this rank's 32 experts laid out expert-major, so R ~ 4 * S.

Usage (GPU): ``python benchmarks/probe_gather_gemm.py --out DIR``; rows (``bench="gather_gemm"``) in
``DIR/gather_gemm.json``. CPU smoke (Triton interpreter, tiny shapes, checks the outputs against
the torch reference, times nothing meaningful): ``TRITON_INTERPRET=1 python
benchmarks/probe_gather_gemm.py --device cpu --quick``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench_gemv import config_name, pick_configs
from moe_sbo.dispatch import ll_kernels
from moe_sbo.dispatch.layout import ExpertLayout
from moe_sbo.dispatch.ll_wire import RowFormat
from moe_sbo.experts.tiled_gemm import GemmConfig, grouped_gemm
from moe_sbo.measure.results import ResultFile, result_meta
from moe_sbo.measure.timing import KernelTimer


def received_batch(tokens: int, ranks: int, experts: int, top_k: int, hidden: int, dtype, device, seed: int):
    """A packed receive buffer of S = ranks * tokens rows and this rank's expert-major layout over it."""
    gen = torch.Generator().manual_seed(seed)
    local = experts // ranks
    num_slots = ranks * tokens
    ids_SK = torch.rand(num_slots, experts, generator=gen).argsort(dim=1)[:, :top_k]
    fmt = RowFormat.make(hidden, top_k, dtype, False)
    recv_SB = torch.zeros(num_slots, fmt.row_bytes, dtype=torch.uint8)
    recv_SB[:, : hidden * dtype.itemsize] = torch.randn(num_slots, hidden, generator=gen).to(dtype).view(torch.uint8)
    slot_P, k_P = (ids_SK < local).nonzero(as_tuple=True)  # pairs on this rank (rank 0: experts 0..local-1)
    expert_P = ids_SK[slot_P, k_P]
    order = torch.sort(expert_P * num_slots + slot_P).indices
    row_R = slot_P[order]
    counts_L = torch.bincount(expert_P, minlength=local)
    layout = ll_kernels.KernelLayout(
        ExpertLayout(
            row_R=row_R.to(device),
            weight_R=torch.ones(len(row_R), device=device),
            num_rows_per_expert_L=counts_L.to(device),
        ),
        pair_row_SK=torch.zeros(1, dtype=torch.int64, device=device),
        num_real_1=torch.tensor([len(row_R)], dtype=torch.int32, device=device),
    )
    offsets_L = counts_L.cumsum(0).to(torch.int32).to(device)
    return recv_SB.to(device), fmt, layout, offsets_L


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--configs", nargs="+", help="only the tile configs whose names contain one of these")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        # float32: the interpreter's bf16 products are wrong (numpy has no bf16); the kernel is dtype-generic
        hidden, n_out, experts, top_k, tokens_list, dtype = 128, 64, 8, 2, [16], torch.float32
        configs: tuple[GemmConfig, ...] = (
            GemmConfig(16, 32, 2, 1, 1, block_k=32),
            GemmConfig(16, 32, 2, 1, 1, block_k=32, tma=True),
        )
    else:
        hidden, n_out, experts, top_k, tokens_list, dtype = 7168, 4096, 64, 8, args.tokens, torch.bfloat16
        configs = tuple(pick_configs(args.configs))
    timer = KernelTimer(device, quick=args.quick)
    results = ResultFile(args.out / "gather_gemm.json" if args.out else None, result_meta(device.type, 1))
    results.meta["timer"] = timer.name
    gen = torch.Generator().manual_seed(1)
    w_LNK = (torch.randn(experts // 2, n_out, hidden, generator=gen) / hidden**0.5).to(dtype).to(device)
    for tokens in tokens_list:
        recv_SB, fmt, layout, offsets_L = received_batch(tokens, 2, experts, top_k, hidden, dtype, device, seed=tokens)
        num_rows = layout.layout.row_R.shape[0]
        x_SH = recv_SB.view(dtype)[:, :hidden]  # strided view: rows are fmt.row_bytes apart
        if num_rows == 0:
            continue
        x_RH = ll_kernels.gather_rows(recv_SB, layout, fmt)[0]
        reference = torch.cat(
            [
                x_RH[s:e].float() @ w_LNK[i].float().T
                for i, (s, e) in enumerate(zip([0, *offsets_L[:-1].tolist()], offsets_L.tolist()))
            ]
        )
        flops = 2 * num_rows * n_out * hidden
        row = {
            "bench": "gather_gemm",
            "tokens_per_rank": tokens,
            "ranks": 2,
            "rows": num_rows,
            "hidden": hidden,
            "n": n_out,
        }
        row["gather_us"] = timer(lambda: ll_kernels.gather_rows(recv_SB, layout, fmt))
        if device.type == "cuda":
            row["grouped_mm_us"] = timer(lambda: torch._grouped_mm(x_RH, w_LNK.transpose(-2, -1), offs=offsets_L))
        best: dict[str, tuple[float, GemmConfig]] = {}
        for config in configs:
            for name, a, index in (("triton_contiguous", x_RH, None), ("triton_gather", x_SH, layout.layout.row_R)):
                try:
                    out = grouped_gemm(a, w_LNK, offsets_L, rows_R=index, config=config)
                    err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                    if err > 2e-2:
                        raise AssertionError(f"{name} {config}: relative error {err:.3g}")
                    t = timer(
                        lambda a=a, index=index, config=config: grouped_gemm(
                            a, w_LNK, offsets_L, rows_R=index, config=config
                        )
                    )
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped, named
                    print(f"tokens {tokens} {name} {config_name(config)}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                row[f"{name}_us_{config_name(config)}"] = t
                if name not in best or t < best[name][0]:
                    best[name] = (t, config)
        for name, (t, config) in best.items():
            row[f"{name}_us"] = t
            row[f"{name}_config"] = config_name(config)
        if "grouped_mm_us" in row:
            row["grouped_mm_tflops"] = flops / row["grouped_mm_us"] / 1e6
            row["copy_plus_grouped_mm_us"] = row["gather_us"] + row["grouped_mm_us"]
            if "triton_gather_us" in row:
                row["triton_gather_tflops"] = flops / row["triton_gather_us"] / 1e6
                row["ratio_gather_gemm_vs_copy_plus_grouped_mm"] = (
                    row["triton_gather_us"] / row["copy_plus_grouped_mm_us"]
                )
        results.rows.append(row)
        results.save()
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if "_us_" not in k})


if __name__ == "__main__":
    main()

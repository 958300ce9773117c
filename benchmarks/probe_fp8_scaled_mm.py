"""Probe: the FP8 grouped GEMM by ``torch._scaled_mm``'s block-wise recipe (cuBLAS, sm90), one call per
expert with counts read on the host, against ``fp8_gemm.grouped_gemm`` (Triton) and bf16
``torch._grouped_mm``, at DeepSeek-V3 dims. Prints µs and TFLOP/s per case and the error vs the
torch reference. Usage (GPU): ``python benchmarks/probe_fp8_scaled_mm.py``."""

from __future__ import annotations

import torch
from triton.testing import do_bench

from moe_sbo.experts import fp8_gemm
from moe_sbo.experts.fp8_torch import grouped_linear_fp8
from moe_sbo.quant.fp8 import quantize_fp8, quantize_fp8_blocks


def scaled_mm_grouped(q, s, wq, ws, counts, out_dtype):
    out = torch.empty(q.shape[0], wq.shape[1], dtype=out_dtype, device=q.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            a_scale = s[start : start + c].t().contiguous().t()  # outer-dim-major (stride (1, M))
            out[start : start + c] = torch._scaled_mm(
                q[start : start + c], wq[e].t(), scale_a=a_scale, scale_b=ws[e].t(), out_dtype=out_dtype
            )
        start += c
    return out


def alignment():
    """Which row counts cuBLAS's block-wise FP8 GEMM takes, with the 1x128 scales laid out two ways."""
    k, n = 2048, 1024
    w = torch.randn(n, k, device="cuda") * k**-0.5
    wq, ws = quantize_fp8_blocks(w)
    for m in [7, 16, 128, 130, 132, 136, 144]:
        q, s = quantize_fp8(torch.randn(m, k, device="cuda"))
        padded = torch.zeros(k // 128, -(-m // 4) * 4, device="cuda")
        padded[:, :m] = s.t()
        for name, scales in (("contiguous-t", s.t().contiguous().t()), ("padded-ld", padded[:, :m].t())):
            try:
                torch._scaled_mm(q, wq.t(), scale_a=scales, scale_b=ws.t(), out_dtype=torch.bfloat16)
                print(f"M={m:4d} {name}: ok", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"M={m:4d} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)


def main():
    alignment()
    torch.manual_seed(0)
    for num_experts, n, k in [(8, 4096, 7168), (8, 7168, 2048)]:
        w = torch.randn(num_experts, n, k, device="cuda") * k**-0.5
        wq, ws = quantize_fp8_blocks(w)
        w16 = w.bfloat16()
        for rows in [128, 256, 512, 2048, 4096]:
            counts = [rows] * num_experts
            x = torch.randn(rows * num_experts, k, device="cuda")
            q, s = quantize_fp8(x)
            offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
            ref = grouped_linear_fp8(q, s, wq, ws, offs, torch.float32)
            flops = 2 * rows * num_experts * n * k
            res = {}
            try:
                got = scaled_mm_grouped(q, s, wq, ws, counts, torch.bfloat16)
                err = ((got.float() - ref).norm() / ref.norm()).item()
                t = do_bench(lambda: scaled_mm_grouped(q, s, wq, ws, counts, torch.bfloat16), return_mode="median")
                res["scaled_mm"] = (t * 1e3, err)
            except Exception as exc:  # noqa: BLE001
                res["scaled_mm"] = (float("nan"), repr(exc)[:300])
            t = do_bench(lambda: fp8_gemm.grouped_gemm(q, s, wq, ws, offs, torch.bfloat16), return_mode="median")
            res["triton"] = (t * 1e3, 0.0)
            x16 = x.bfloat16()
            t = do_bench(lambda: torch._grouped_mm(x16, w16.transpose(-2, -1), offs=offs), return_mode="median")
            res["bf16"] = (t * 1e3, 0.0)
            for name, (us, err) in res.items():
                print(
                    f"L={num_experts} N={n} K={k} rows/expert={rows:5d} {name:9s} {us:8.1f} us "
                    f"{flops / us / 1e6:7.1f} TFLOP/s err={err}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

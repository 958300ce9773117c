"""GPU check of fp8_ws (warp-specialised block-scaled FP8 grouped GEMM) on an H200: correctness
against a float32 torch reference, then timing from CUDA graphs against torch._scaled_mm row-wise
(the GPU's FP8 rate), for DeepSeek-V3 expert shapes. Needs only torch, triton and fp8_ws.py next to
this file. Writes $OUT/ws_check.json (OUT defaults to ./out).

    python check_ws.py            # everything (a few minutes)
    python check_ws.py --quick    # tiny case + one shape, default config only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
import triton.language as tl  # noqa: E402

import fp8_ws3 as fp8_ws  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from moe_sbo.experts import fp8_gemm as triton_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}  # name: (N, K)
COUNTS = {
    "8x2048": [2048] * 8,
    "8x4096": [4096] * 8,
    "uneven": [0, 1, 130, 2000, 4096, 77, 3000, 512],
}
# (block_n, stages, persistent, loader_regs, consumer_regs); "triton": the Triton kernel of moe_sbo
CONFIGS = [
    (128, 4, True, 40, 232, 2),
    (128, 4, True, 24, 160, 3),
    (128, 5, True, 24, 160, 3),
    (128, 4, False, 24, 160, 3),
    (128, 4, True, 24, 168, 3),
    "triton",
]
REL_TOL = 1e-3


def cfg_name(c):
    if c == "triton":
        return "triton"
    bn, st, p, lr, cr, cons = c
    return f"c{cons}_bn{bn}_s{st}{'_persistent' if p else ''}_r{lr}-{cr}"


def make_problem(counts, n, k, seed=0, device="cuda"):
    """Random e4m3 operands and positive scales (no quantisation needed for a GEMM check)."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = sum(counts)
    num_rows = rows + 5  # a few padding rows past offsets[-1]: left unwritten by contract
    L = len(counts)
    q = (torch.randn(num_rows, k, device=device, generator=g) * 2).to(FP8)
    scales = torch.rand(num_rows, k // 128, device=device, generator=g) * 0.02 + 0.005
    w = (torch.randn(L, n, k, device=device, generator=g) * 2).to(FP8)
    w_scale = torch.rand(L, n // 128, k // 128, device=device, generator=g) * 0.02 + 0.005
    offsets = torch.tensor(counts, device=device, dtype=torch.int64).cumsum(0).to(torch.int32)
    return q, scales, w, w_scale, offsets


def reference(q, scales, w, w_scale, offsets_list):
    """float32: dequantise and matmul per expert. Returns [rows_real, N]."""
    torch.backends.cuda.matmul.allow_tf32 = False
    k = q.shape[1]
    outs = []
    start = 0
    for l, end in enumerate(offsets_list):
        if end > start:
            a = q[start:end].float() * scales[start:end].repeat_interleave(128, dim=1)
            b = w[l].float() * w_scale[l].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:, :k]
            outs.append(a @ b.t())
        start = end
    return torch.cat(outs) if outs else torch.empty(0, w.shape[1], device=q.device)


def rel_err(out, ref):
    out = out.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item(), ((out - ref).abs().max() / ref.abs().max()).item()


def kernel_info():
    kern = fp8_ws.LAST_KERNEL
    if kern is None:
        return {}
    info = {}
    for attr in ("n_regs", "n_spills", "n_max_threads"):
        try:
            info[attr] = getattr(kern, attr)
        except Exception:  # noqa: BLE001
            pass
    try:
        info["shared"] = kern.metadata.shared
        info["num_warps"] = kern.metadata.num_warps
    except Exception:  # noqa: BLE001
        pass
    return info


def run_gemm(c, q, scales, w, w_scale, offsets, out_dtype):
    if c == "triton":
        return triton_fp8.grouped_gemm(q, scales, w, w_scale, offsets, out_dtype)
    bn, st, p, lr, cr, cons = c
    return fp8_ws.grouped_gemm(
        q,
        scales,
        w,
        w_scale,
        offsets,
        out_dtype,
        block_n=bn,
        stages=st,
        loader_regs=lr,
        consumer_regs=cr,
        persistent=p,
        consumers=cons,
    )


def check_case(name, counts, n, k, configs, results, time_it=True, rep=50):
    torch.cuda.synchronize()
    print(f"\n== {name}: N={n} K={k} counts={counts}", flush=True)
    q, scales, w, w_scale, offsets = make_problem(counts, n, k)
    offsets_list = offsets.tolist()
    rows = offsets_list[-1]
    ref = reference(q, scales, w, w_scale, offsets_list)
    flops = 2.0 * rows * n * k
    case = {"name": name, "N": n, "K": k, "counts": counts, "rows": rows, "configs": {}}
    for c in configs:
        entry = {}
        try:
            if c != "triton" and not fp8_ws.supported(q, w, c[0]):
                entry["skipped"] = "not supported (N % block_n or device)"
                case["configs"][cfg_name(c)] = entry
                continue
            out32 = run_gemm(c, q, scales, w, w_scale, offsets, torch.float32)
            torch.cuda.synchronize()
            entry["kernel"] = kernel_info() if c != "triton" else {}
            entry["rel_err_f32"], entry["max_err_f32"] = rel_err(out32[:rows], ref)
            entry["ok"] = entry["rel_err_f32"] < REL_TOL and bool(torch.isfinite(out32[:rows]).all())
            out16 = run_gemm(c, q, scales, w, w_scale, offsets, torch.bfloat16)
            torch.cuda.synchronize()
            entry["rel_err_bf16"], _ = rel_err(out16[:rows], ref)
            if time_it and rows:
                ms = triton.testing.do_bench_cudagraph(
                    lambda: run_gemm(c, q, scales, w, w_scale, offsets, torch.bfloat16), rep=rep
                )
                entry["ms"] = ms
                entry["tflops"] = flops / ms / 1e9
            print(
                f"  {cfg_name(c):24s} ok={entry['ok']} rel_f32={entry['rel_err_f32']:.2e} "
                f"rel_bf16={entry['rel_err_bf16']:.2e} "
                + (f"{entry['ms']:.3f} ms {entry['tflops']:.0f} TFLOP/s " if "ms" in entry else "")
                + f"{entry['kernel']}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - one failing config must not stop the run
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"  {cfg_name(c):24s} FAILED {entry['error'][:300]}", flush=True)
        case["configs"][cfg_name(c)] = entry
    if time_it and rows:
        case["scaled_mm"] = time_scaled_mm(rows, n, k, rep)
        case["plain_triton"] = time_plain_triton(rows, n, k, rep)
    results["cases"].append(case)
    return case


def time_scaled_mm(rows, n, k, rep):
    """torch._scaled_mm row-wise on one dense [rows, K] x [K, N]: the same FLOPs at the GPU's FP8 rate."""
    res = {}
    try:
        a = (torch.randn(rows, k, device="cuda") * 2).to(FP8)
        bt = (torch.randn(n, k, device="cuda") * 2).to(FP8)
        sa = torch.rand(rows, 1, device="cuda") + 0.5
        sb = torch.rand(1, n, device="cuda") + 0.5
        flops = 2.0 * rows * n * k
        for fast in (True, False):
            fn = lambda: torch._scaled_mm(
                a,
                bt.t(),
                scale_a=sa,
                scale_b=sb,
                out_dtype=torch.bfloat16,  # noqa: E731
                use_fast_accum=fast,
            )
            fn()
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
            res[f"fast_accum={fast}"] = {"ms": ms, "tflops": flops / ms / 1e9}
        print(
            "  torch._scaled_mm rowwise: "
            + ", ".join(f"{k_}: {v['ms']:.3f} ms {v['tflops']:.0f} TFLOP/s" for k_, v in res.items()),
            flush=True,
        )
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"  torch._scaled_mm FAILED {res['error'][:300]}", flush=True)
    return res


@triton.jit
def _plain_fp8_kernel(
    a_desc,
    b_desc,
    c_ptr,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
):
    """A plain FP8 GEMM (no block scales, the accumulator carried through tl.dot): the rate Triton's own
    pipelining reaches for a tile shape, to compare the block-scaled kernels against."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP * num_n
    first_m = (pid // width) * GROUP
    group_size = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([pid_m * BM, k])
        b = b_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=(rows < M)[:, None])


PLAIN_CONFIGS = [(128, 128, 128, 8, 4)]


def time_plain_triton(rows, n, k, rep):
    from triton.tools.tensor_descriptor import TensorDescriptor

    res = {}
    a = (torch.randn(rows, k, device="cuda") * 2).to(FP8)
    b = (torch.randn(n, k, device="cuda") * 2).to(FP8)
    c = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * rows * n * k
    for bm, bn, bk, warps, stages in PLAIN_CONFIGS:
        name = f"plain_{bm}x{bn}x{bk}_w{warps}_s{stages}"
        try:
            grid = (triton.cdiv(rows, bm) * triton.cdiv(n, bn),)
            fn = lambda: _plain_fp8_kernel[grid](  # noqa: E731
                TensorDescriptor.from_tensor(a, [bm, bk]),
                TensorDescriptor.from_tensor(b, [bn, bk]),
                c,
                rows,
                n,
                K=k,
                BM=bm,
                BN=bn,
                BK=bk,
                GROUP=8,
                num_warps=warps,
                num_stages=stages,
            )
            fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep)
            res[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    print("  plain Triton FP8: " + ", ".join(f"{k_}: {v.get('tflops', 0):.0f}" for k_, v in res.items()), flush=True)
    return res


def check_graph_replay(results):
    """Capture at one routing, replay after changing the device offsets (same R): no host sync means
    the replay must follow the new counts."""
    n, k = 256, 512
    counts_a, counts_b = [100, 0, 300, 112], [5, 250, 0, 257]
    entry = {}
    try:
        q, scales, w, w_scale, offsets = make_problem(counts_a, n, k, seed=1)
        static = {}
        run_gemm(CONFIGS[2], q, scales, w, w_scale, offsets, torch.float32)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static["out"] = run_gemm(CONFIGS[2], q, scales, w, w_scale, offsets, torch.float32)
        offsets.copy_(torch.tensor(counts_b, device="cuda").cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        rows = sum(counts_b)
        ref = reference(q, scales, w, w_scale, offsets.tolist())
        entry["rel_err_f32"], entry["max_err_f32"] = rel_err(static["out"][:rows], ref)
        entry["ok"] = entry["rel_err_f32"] < REL_TOL
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        entry["traceback"] = traceback.format_exc()[-4000:]
    print(f"\n== graph replay with new counts: {entry}", flush=True)
    results["graph_replay"] = entry


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rep", type=int, default=50, help="ms of replays per timing")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    results = {
        "device": torch.cuda.get_device_name(),
        "capability": torch.cuda.get_device_capability(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cases": [],
    }
    path = os.path.join(out_dir, "ws_check.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    # Tiny first: cheap to diagnose. 2 experts, K=256, N=256, one partial tile each.
    check_case("tiny", [100, 60], 256, 256, CONFIGS if not args.quick else CONFIGS[:1], results, time_it=False)
    check_case("tiny_k128", [1, 130], 256, 128, CONFIGS[:3], results, time_it=False)
    save()
    check_graph_replay(results)
    save()
    configs = CONFIGS if not args.quick else CONFIGS[:1]
    shapes = SHAPES if not args.quick else {"gate_up": SHAPES["gate_up"]}
    counts = COUNTS if not args.quick else {"8x2048": COUNTS["8x2048"]}
    for sname, (n, k) in shapes.items():
        for cname, cnt in counts.items():
            check_case(f"{sname}/{cname}", cnt, n, k, configs, results, rep=args.rep)
            torch.cuda.empty_cache()  # the case's operands are gone with its frame
            save()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    # Summary: best config per case vs scaled_mm.
    print("\n== summary (TFLOP/s): case, best WS config, scaled_mm fast-accum")
    for case in results["cases"]:
        timed = {k_: v for k_, v in case["configs"].items() if "tflops" in v and v.get("ok")}
        if not timed:
            continue
        best = max(timed, key=lambda k_: timed[k_]["tflops"])
        smm = case.get("scaled_mm", {}).get("fast_accum=True", {}).get("tflops")
        print(f"  {case['name']:20s} {best:24s} {timed[best]['tflops']:7.0f}   scaled_mm {smm and round(smm)}")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

"""Probe (temporary): the FP8 expert MLP with programmatic dependent launch off / on / on + weight
prefetch into L2, same run; the HBM read ceiling beside it."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_fp8_experts import graph_time, make_experts  # noqa: E402

from moe_sbo import dependent_launch  # noqa: E402
from moe_sbo.config import get_preset  # noqa: E402
from moe_sbo.experts import fp8_gemm  # noqa: E402
from moe_sbo.layer import MoELayer  # noqa: E402
from moe_sbo.measure.timing import KernelTimer  # noqa: E402

device = torch.device("cuda")
dtype = torch.bfloat16
timer = KernelTimer(device, False)
replay = KernelTimer(device, False, graph=True)
real_supported = dependent_launch.supported
VARIANTS = {"off": (False, 0), "pdl": (True, 0), "pdl_pf2": (True, 2), "pdl_pf4": (True, 4), "pdl_pf8": (True, 8)}


def use(variant):
    pdl, pf = VARIANTS[variant]
    dependent_launch.supported = (lambda d: real_supported(d)) if pdl else (lambda d: False)
    fp8_gemm.PREFETCH_K_STEPS = pf


rows_out = []
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(x_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


# The GPU's own read ceiling in this run: a read-only Triton kernel and amax over 2 GiB of bf16, and a copy.
big = torch.randn(2**30, device=device, dtype=dtype)
partial = torch.empty(132 * 16, device=device)
for programs in (132 * 4, 132 * 8, 132 * 16):
    t = timer(lambda p=programs: _read_kernel[(p,)](big, partial, big.numel(), BLOCK=4096, num_warps=8))
    rows_out.append({"probe": f"read_ceiling_triton_{programs}", "gbps": big.numel() * 2 / t / 1e3, "t_us": t})
t = timer(lambda: big.amax())
rows_out.append({"probe": "read_ceiling_amax", "gbps": big.numel() * 2 / t / 1e3, "t_us": t})
dst = torch.empty_like(big)
t = timer(lambda: dst.copy_(big))
rows_out.append({"probe": "copy", "gbps": 2 * big.numel() * 2 / t / 1e3, "t_us": t})
del big, dst
print(rows_out, flush=True)

H, I = 7168, 2048
for L in (8, 32):
    fp8, _ = make_experts(L, H, I, device, dtype)
    fp8.requires_grad_(False)
    for rpe in (16, 32, 64, 128, 256):
        counts = torch.full((L,), rpe, dtype=torch.int64, device=device)
        x = torch.randn(L * rpe, H, device=device).to(dtype)
        ref = None
        for v in VARIANTS:
            use(v)
            with torch.no_grad():
                y = fp8(x, counts)
                torch.cuda.synchronize()
                same = None if ref is None else bool(torch.equal(y, ref))
                ref = y if ref is None else ref
                t_graph = graph_time(lambda: fp8(x, counts), timer, device)
                t_replay = replay(lambda: fp8(x, counts))
                t_eager = timer(lambda: fp8(x, counts))
            wbytes = L * 3 * H * I
            row = {"probe": "mlp", "experts": L, "rows_per_expert": rpe, "variant": v, "t_us": t_graph,
                   "t_replay_us": t_replay, "t_eager_us": t_eager, "weight_gbps": wbytes / t_graph / 1e3,
                   "equal_to_off": same}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    del fp8
    torch.cuda.empty_cache()

cfg = get_preset("deepseek-v3").with_num_experts(32)
for tokens in (32, 128):
    x = torch.randn(tokens, cfg.hidden_size, device=device).to(dtype)
    layer = MoELayer(cfg, dispatcher="low_latency", dispatcher_options={"max_tokens_per_rank": tokens, "fp8": True},
                     device=device, expert_dtype="fp8")
    for v in VARIANTS:
        use(v)
        with torch.no_grad():
            t = graph_time(lambda: layer(x), timer, device)
        row = {"probe": "layer", "tokens": tokens, "variant": v, "t_us": t}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    del layer
out = os.environ.get("OUT", "out")
os.makedirs(out, exist_ok=True)
json.dump(rows_out, open(os.path.join(out, "probe_pdl.json"), "w"), indent=1)

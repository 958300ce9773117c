"""``moe-sbo bench low-latency``'s options (runner: ``moe_sbo.bench.low_latency``)."""

from __future__ import annotations

import argparse

from ...config import PRESETS
from .common import add_ep_sweep_args

# experts.select.DENSE_KERNELS, named here without importing torch (a test holds them equal).
EXPERT_KERNELS = ("auto", "torch", "triton", "gemv", "tiled", "grouped_mm", "expert_loop")
FP8_CHOICES = ("both", "off", "on")  # the runner's FP8_CHOICES

DESCRIPTION = """\
Time the low_latency dispatcher at decode sizes for each EP size: dispatch, combine and the layer
replayed from CUDA graphs and run eagerly, per dispatch dtype and kernel path, beside raw
all_to_all_single on the same fixed blocks and the allgather/alltoall dispatchers. Rows go to
OUT/low_latency.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    add_ep_sweep_args(p, "low_latency.json", iters=50)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 64, 128, 256], help="tokens per rank")
    p.add_argument(
        "--capacity", type=int, default=None, help="max_tokens_per_rank for every row (default: each row's token count)"
    )
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--experts-per-gpu", type=int, default=8, help="routed experts per GPU (E = this x EP)")
    p.add_argument("--hidden-size", type=int, default=None, help="override the preset's H (smoke runs)")
    p.add_argument("--fp8", default="both", choices=FP8_CHOICES, help="low_latency dispatch in fp8")
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["triton", "torch"],
        choices=["triton", "torch"],
        help="low_latency kernel paths (triton: fused kernels, CUDA or TRITON_INTERPRET=1; torch: the reference chain)",
    )
    p.add_argument(
        "--transports",
        nargs="+",
        default=["nccl", "symm_mem"],
        choices=["nccl", "symm_mem"],
        help="low_latency transports (symm_mem: fused kernels on CUDA; skipped otherwise)",
    )
    p.add_argument(
        "--index-graphs",
        nargs="+",
        default=["on"],
        choices=["on", "off", "fixed_rows", "index_rows"],
        help="low_latency's index_graphs option (fixed_rows: on, with fixed_expert_rows; index_rows: on, with "
        "index_rows, the experts reading the received rows in place), each setting its own "
        "eager rows (replayed rows once per path, and for index_rows)",
    )
    p.add_argument(
        "--expert-kernels",
        nargs="+",
        default=["auto"],
        choices=list(EXPERT_KERNELS),
        help="the routed experts' kernels (RoutedExperts.kernels), each its own rows; bf16 experts",
    )
    p.add_argument("--baselines", nargs="*", default=["allgather", "alltoall"], choices=["allgather", "alltoall"])

"""``moe-sbo bench prefill``'s options (runner: ``moe_sbo.bench.prefill``)."""

from __future__ import annotations

import argparse

from ...config import PRESETS
from .common import add_ep_sweep_args

DEFAULT_TOKENS = [512, 1024, 2048, 4096, 8192, 16384]


DESCRIPTION = """\
Time low_latency dispatch and combine at prefill sizes for each EP size, per transport and kernel
plan, eager and replayed, against the wire (raw all_to_all_single of the same bytes) and the compute
floor (router + routed + shared experts, each timed alone). Rows go to OUT/prefill.json."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    add_ep_sweep_args(p, "prefill.json", iters=20)
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS, help="tokens per rank")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--experts-per-gpu", type=int, default=32, help="routed experts per GPU (E = this x EP)")
    p.add_argument("--hidden-size", type=int, default=None, help="override the preset's H (smoke runs)")
    p.add_argument(
        "--transports",
        nargs="+",
        default=["symm_mem", "copy_engine", "nccl"],
        choices=["nccl", "symm_mem", "copy_engine"],
        help="low_latency transports (CUDA, EP > 1 for symm_mem and copy_engine; skipped otherwise)",
    )
    p.add_argument(
        "--one-pass-max",
        type=int,
        default=4096,
        help="also run the one-pass (decode) kernels up to this many tokens, for comparison",
    )
    p.add_argument(
        "--no-direct-launches",
        dest="direct_launches",
        action="store_false",
        help="skip the eager rows with index_graphs=False (the kernels launched on every forward)",
    )
    p.add_argument("--baselines", nargs="*", default=["alltoall"], choices=["allgather", "alltoall"])
    p.add_argument("--plot", default=None, help="PNG: GB/s against tokens per path")

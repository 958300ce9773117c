"""``moe-sbo bench deep-ep``'s options (runner: ``moe_sbo.bench.deep_ep``)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Time moe_sbo.deep_ep's low-latency dispatch + combine against moe-sbo's native low_latency
dispatcher on the same shapes, in one run: CUDA-graph replays (device time) and eager calls (host
time per pair). Rows go to OUT/deep_ep.json; targets: replay_ratio <= 1.10, host_delta_us <= 20."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for deep_ep.json")
    parser.add_argument("--ranks", type=int, default=None, help="EP size (default: the GPUs, at least 2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run, eager")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts-per-gpu", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)

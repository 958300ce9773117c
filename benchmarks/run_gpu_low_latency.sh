#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_low_latency.sh
# Prints the GPUs and versions, runs the low_latency tests (CPU gloo ones and the GPU-marked NCCL /
# CUDA-graph ones), then the low-latency benchmark, which writes "${OUT:-out}/low_latency.json" and
# "${OUT:-out}/bench_low_latency.log". Extra benchmark flags go in BENCH_ARGS (e.g. BENCH_ARGS="--ranks 4 1").
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
"$PYTHON" -m pytest -q tests/dispatch/test_gpu_low_latency.py tests/dispatch/test_low_latency.py 2>&1 | tee "$OUT_DIR/tests_low_latency.log" | tail -30 || true
# shellcheck disable=SC2086  # BENCH_ARGS is meant to split into flags
"$PYTHON" -m moe_sbo bench low-latency --out "$OUT_DIR" ${BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench_low_latency.log"

#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_foundation.sh
# Prints the GPUs and versions, runs the GPU-marked tests (NCCL), then the foundation benchmark, which
# writes "${OUT:-out}/foundation.json". Extra benchmark flags go in BENCH_ARGS (e.g. BENCH_ARGS="--ranks 4 1").
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
gpu_tests || true
# shellcheck disable=SC2086  # BENCH_ARGS is meant to split into flags
"$PYTHON" -m moe_sbo bench foundation --out "$OUT_DIR" ${BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench_foundation.log"

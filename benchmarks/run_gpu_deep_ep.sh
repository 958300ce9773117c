#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_deep_ep.sh
# Runs the gpu-marked tests of moe_sbo.deep_ep (DeepEP's ported tests on ranks sharing the GPU where
# there is one, CUDA-graph capture of the low-latency path, DeepEP's README examples), then
# moe-sbo bench deep-ep: the compatible API against moe-sbo's native low_latency dispatcher at 128 tokens,
# replayed and eager, into "${OUT:-out}/deep_ep.json" and "${OUT:-out}/bench_deep_ep.log". About two
# minutes on one H100. Extra benchmark flags go in BENCH_ARGS (e.g. BENCH_ARGS="--ranks 4").
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
gpu_tests tests/deep_ep/test_gpu_deep_ep.py || echo "deep_ep GPU tests failed: see $OUT_DIR/tests_gpu_$TAG.log"
# shellcheck disable=SC2086  # BENCH_ARGS is meant to split into flags
"$PYTHON" -m moe_sbo bench deep-ep --out "$OUT_DIR" ${BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/bench_deep_ep.log"

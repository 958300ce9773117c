#!/usr/bin/env bash
# One GPU is enough, from the repo root:  bash benchmarks/run_gpu_gather_gemm.sh
# 1. The GPU tests of low_latency's kernels and graphs that run on one GPU (EP1; the symmetric-memory
#    and copy-engine cases need two GPUs and skip), and of the gather-sum kernel.
# 2. probe_gather_gemm.py: a grouped GEMM reading its rows through the receiver's index against
#    gather_rows + torch._grouped_mm, DeepSeek-V3 dims, 256-8192 tokens per rank of an EP2 batch
#    (file gather_gemm_<tag>.json).
# Expected wall time: about 5 minutes on one H200.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
start=$SECONDS
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_low_latency.py tests/test_gpu.py -k "${TESTS_K:-low_latency or gather}" \
  2>&1 | tee "$OUT_DIR/tests_gpu_gather_gemm_$TAG.log" | tail -5
echo "== tests: $((SECONDS - start)) s"
start=$SECONDS
mkdir -p "$OUT_DIR/gather_gemm"
"$PYTHON" benchmarks/probe_gather_gemm.py --out "$OUT_DIR/gather_gemm" ${PROBE_ARGS:-} 2>&1 | tee "$OUT_DIR/gather_gemm_$TAG.log" | tail -12
mv "$OUT_DIR/gather_gemm/gather_gemm.json" "$OUT_DIR/gather_gemm_$TAG.json" 2>/dev/null
echo "== probe: $((SECONDS - start)) s"

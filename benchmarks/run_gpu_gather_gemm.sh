#!/usr/bin/env bash
# The dense routed experts' kernels on one GPU, from the repo root:  bash benchmarks/run_gpu_gather_gemm.sh
# 1. Tests on CUDA: the experts' kernels (tests/test_experts.py, tests/test_fp8.py, both also run on CPU
#    under Triton's interpreter), the FP8 GPU tests, and the gather-sum kernel.
# 2. bench_gemv.py: the routed MLP through the grouped GEMV, the tiled grouped GEMM and
#    torch._grouped_mm, 8/16/32 experts, 8 to 32768 rows, beside the read and compute floors
#    (file gemv_<tag>.json): the data behind experts.GEMV_MAX_ROWS and TILED_MAX_ROWS_PER_EXPERT.
# 3. probe_gather_gemm.py: the tiled GEMM reading its rows through the receiver's index against
#    gather_rows + torch._grouped_mm, and its tile configs, 64-8192 tokens per rank of an EP2 batch
#    (file gather_gemm_<tag>.json).
# PARTS (default "tests gemv probe") picks the parts. Expected wall time: about 8 minutes on one H200.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests gemv probe}"
if [[ " $PARTS " == *" tests "* ]]; then
  start=$SECONDS
  { "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_experts.py tests/test_fp8.py
    "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_experts.py tests/test_gpu_fp8.py tests/test_gpu.py
  } 2>&1 | tee "$OUT_DIR/tests_gpu_experts_$TAG.log" | grep -E "passed|failed|error" | tail -4
  echo "== tests: $((SECONDS - start)) s"
fi
if [[ " $PARTS " == *" gemv "* ]]; then
  start=$SECONDS
  mkdir -p "$OUT_DIR/gemv"
  "$PYTHON" benchmarks/bench_gemv.py --out "$OUT_DIR/gemv" ${GEMV_ARGS:-} 2>&1 | tee "$OUT_DIR/gemv_$TAG.log" | tail -3
  mv "$OUT_DIR/gemv/gemv.json" "$OUT_DIR/gemv_$TAG.json" 2>/dev/null
  echo "== gemv: $((SECONDS - start)) s"
fi
if [[ " $PARTS " == *" probe "* ]]; then
  start=$SECONDS
  mkdir -p "$OUT_DIR/gather_gemm"
  "$PYTHON" benchmarks/probe_gather_gemm.py --out "$OUT_DIR/gather_gemm" ${PROBE_ARGS:-} 2>&1 | tee "$OUT_DIR/gather_gemm_$TAG.log" | tail -3
  mv "$OUT_DIR/gather_gemm/gather_gemm.json" "$OUT_DIR/gather_gemm_$TAG.json" 2>/dev/null
  echo "== probe: $((SECONDS - start)) s"
fi

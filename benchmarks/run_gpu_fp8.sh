#!/usr/bin/env bash
# The one command for FP8 experts on a GPU machine, from the repo root:  bash benchmarks/run_gpu_fp8.sh
# PARTS picks sections (default: tests bench): "tests" runs the FP8 GPU tests, "bench" the FP8 vs
# bf16 routed-expert benchmark on one GPU ("${OUT:-out}/fp8_experts.json"), "sweep" each GEMM alone per
# tile config beside cuBLAS's row-wise FP8 rate on the same shape ("${OUT:-out}/fp8_sweep/fp8_experts.json";
# the data behind fp8_gemm's configs). Extra flags: BENCH_ARGS, SWEEP_ARGS.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests bench}"
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    tests) "$PYTHON" -m pytest -q -s tests/experts/test_gpu_fp8.py 2>&1 | tee "$OUT_DIR/tests_gpu_fp8_$TAG.log" | tail -30 ;;
    bench)
      # shellcheck disable=SC2086  # BENCH_ARGS is meant to split into flags
      CUDA_VISIBLE_DEVICES=0 "$PYTHON" -m moe_sbo bench fp8-experts --out "$OUT_DIR" ${BENCH_ARGS:-} \
        2>&1 | tee "$OUT_DIR/bench_fp8_experts_$TAG.log" | tail -60 ;;
    sweep)
      # shellcheck disable=SC2086  # SWEEP_ARGS is meant to split into flags
      CUDA_VISIBLE_DEVICES=0 "$PYTHON" -m moe_sbo bench fp8-experts --out "$OUT_DIR/fp8_sweep" --sweep-only \
        ${SWEEP_ARGS:---experts 8 --decode-rows 16 128 --prefill-rows 512 2048 4096} \
        2>&1 | tee "$OUT_DIR/sweep_fp8_$TAG.log" | tail -60 ;;
    *) echo "unknown part $part (tests bench sweep)"; exit 2 ;;
  esac
  echo "== $part: $((SECONDS - start)) s"
done

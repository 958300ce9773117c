#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_generate.sh
# PARTS picks sections (default: tests gemv bench): "tests" runs the whole-model and experts GPU tests
# (bf16 against transformers, CUDA-graph decode against the same steps eager, a rank with no prompts
# included; the decode-size expert kernel against torch._grouped_mm); "gemv" times that kernel
# against torch._grouped_mm at decode sizes ("${OUT:-out}/gemv.json");
# "bench" the generation benchmark (transformers on one GPU against moe-sbo at EP2 and EP1, each
# decode loop), writing "${OUT:-out}/generate.json". Extra benchmark flags go in BENCH_ARGS; the
# random checkpoint is written under CHECKPOINT_DIR (default /tmp).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests gemv bench}"
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    tests) "$PYTHON" -m pytest -q tests/hf/test_gpu_hf_model.py tests/experts/test_experts.py 2>&1 \
      | tee "$OUT_DIR/tests_gpu_hf_model_$TAG.log" | tail -25 ;;
    gemv) "$PYTHON" -m moe_sbo bench dense-experts --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/bench_gemv_$TAG.log" | tail -10 ;;
    bench)
      # shellcheck disable=SC2086  # BENCH_ARGS is meant to split into flags
      "$PYTHON" -m moe_sbo bench generate --out "$OUT_DIR" --checkpoint-dir "${CHECKPOINT_DIR:-/tmp}" \
        ${BENCH_ARGS:-} 2>&1 | grep -v -e "Loading weights" -e "Writing model" | tee "$OUT_DIR/bench_generate_$TAG.log" | tail -20 ;;
    *) echo "unknown part $part (tests gemv bench)"; exit 2 ;;
  esac
  echo "== $part: $((SECONDS - start)) s"
done

#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_prefill.sh
# PARTS picks sections (default: tests bench decode): "tests" runs the low_latency GPU tests (every
# path, the two-pass kernels and the index graphs included) and the overlap GPU tests, "bench" the
# prefill benchmark over every visible GPU, writing "${OUT:-out}/prefill.json", its plot and logs,
# "decode" the 128-token low_latency rows with index_graphs on and off ("${OUT:-out}/low_latency.json"),
# "router" the fused routing kernel's GPU tests, then torch against Triton selection, host and graph
# time per token count ("${OUT:-out}/router.json"; not in the default PARTS).
# Extra prefill benchmark flags go in BENCH_ARGS.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests bench decode}"
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    tests) "$PYTHON" -m pytest -q tests/dispatch/test_gpu_low_latency.py tests/overlap/test_gpu_overlap.py 2>&1 \
      | tee "$OUT_DIR/tests_gpu_low_latency_$TAG.log" | tail -25 ;;
    bench)
      # shellcheck disable=SC2086  # BENCH_ARGS is meant to split into flags
      "$PYTHON" -m moe_sbo bench prefill --out "$OUT_DIR" --plot "$OUT_DIR/prefill_$TAG.png" ${BENCH_ARGS:-} \
        2>&1 | tee "$OUT_DIR/bench_prefill_$TAG.log" | tail -60 ;;
    decode)
      "$PYTHON" -m moe_sbo bench low-latency --out "$OUT_DIR" --tokens 128 --fp8 off --kernels triton \
        --transports symm_mem nccl --index-graphs on off --baselines 2>&1 | tee "$OUT_DIR/bench_decode_$TAG.log" | tail -20 ;;
    router)
      "$PYTHON" -m pytest -q -rfxX tests/routing/test_routing_kernels.py -m gpu 2>&1 \
        | tee "$OUT_DIR/tests_router_$TAG.log" | tail -15
      "$PYTHON" -m moe_sbo bench router --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/bench_router_$TAG.log" | tail -25 ;;
    *) echo "unknown part $part (tests bench decode router)"; exit 2 ;;
  esac
  echo "== $part: $((SECONDS - start)) s"
done

#!/usr/bin/env bash
# The dense routed experts' kernels on one GPU, from the repo root:  bash benchmarks/run_gpu_dense_experts.sh
# 1. tests: GPU tests of the experts' kernels (tests/test_experts.py on CUDA, the FP8 GPU tests, which
#    share the grouped GEMM's tile schedule), tests/test_gpu.py and the one-GPU low_latency tests.
# 2. gemv: bench_gemv.py, the routed MLP through the grouped GEMV, the tiled grouped GEMM and
#    torch._grouped_mm, 8/16/32 experts, 8 to 32768 rows, beside the read and compute floors
#    (file gemv_<tag>.json): the data behind experts.GEMV_MAX_ROWS_PER_EXPERT and TILED_MAX_ROWS_PER_EXPERT.
# 3. layer: bench_low_latency.py at EP1, the low_latency MoE layer (eager and CUDA-graph replays) with
#    the experts' kernels left to "auto", forced to the GEMV and to torch._grouped_mm, 8 and 32 experts
#    per GPU (files low_latency_experts{8,32}_<tag>.json).
# 4. sweep: bench_gemv.py --sweep, each GEMM of the MLP through the tiled GEMM under each tile config,
#    8 and 32 experts, 16-512 rows per expert (file dense_gemm_config_<tag>.json): the data behind
#    grouped_gemm_kernels.dense_config.
# 5. probe: probe_gather_gemm.py, the tiled GEMM reading its rows through the receiver's index against
#    gather_rows + torch._grouped_mm, and its tile configs (file gather_gemm_<tag>.json).
# PARTS (default "tests gemv layer") picks the parts. Expected wall time: about 8 minutes on one H200.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests gemv layer}"
if [[ " $PARTS " == *" tests "* ]]; then
  start=$SECONDS
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_experts.py tests/test_gpu_fp8.py tests/test_gpu.py \
    tests/test_gpu_low_latency.py -k "${TESTS_K:-not nothing}" 2>&1 | tee "$OUT_DIR/tests_gpu_experts_$TAG.log" | tail -3
  echo "== tests: $((SECONDS - start)) s"
fi
if [[ " $PARTS " == *" gemv "* ]]; then
  start=$SECONDS
  mkdir -p "$OUT_DIR/gemv"
  "$PYTHON" benchmarks/bench_gemv.py --out "$OUT_DIR/gemv" ${GEMV_ARGS:-} 2>&1 | tee "$OUT_DIR/gemv_$TAG.log" | tail -3
  mv "$OUT_DIR/gemv/gemv.json" "$OUT_DIR/gemv_$TAG.json" 2>/dev/null
  echo "== gemv: $((SECONDS - start)) s"
fi
if [[ " $PARTS " == *" layer "* ]]; then
  for e in 8 32; do
    start=$SECONDS
    if [ "$e" = 8 ]; then tokens="8 16 32 64 128"; else tokens="32 128 256 512"; fi
    mkdir -p "$OUT_DIR/layer$e"
    "$PYTHON" benchmarks/bench_low_latency.py --out "$OUT_DIR/layer$e" --ranks 1 --experts-per-gpu "$e" --tokens $tokens \
      --fp8 off --kernels triton --transports nccl --baselines --expert-kernels auto gemv torch \
      2>&1 | tee "$OUT_DIR/low_latency_experts${e}_$TAG.log" | tail -20
    mv "$OUT_DIR/layer$e/low_latency.json" "$OUT_DIR/low_latency_experts${e}_$TAG.json" 2>/dev/null
    echo "== layer $e experts: $((SECONDS - start)) s"
  done
fi
if [[ " $PARTS " == *" sweep "* ]]; then
  start=$SECONDS
  mkdir -p "$OUT_DIR/sweep"
  "$PYTHON" benchmarks/bench_gemv.py --sweep --experts 8 32 --out "$OUT_DIR/sweep" 2>&1 | tee "$OUT_DIR/dense_gemm_config_$TAG.log" | tail -30
  mv "$OUT_DIR/sweep/dense_gemm_config.json" "$OUT_DIR/dense_gemm_config_$TAG.json" 2>/dev/null
  echo "== sweep: $((SECONDS - start)) s"
fi
if [[ " $PARTS " == *" probe "* ]]; then
  start=$SECONDS
  mkdir -p "$OUT_DIR/gather_gemm"
  "$PYTHON" benchmarks/probe_gather_gemm.py --out "$OUT_DIR/gather_gemm" ${PROBE_ARGS:-} 2>&1 | tee "$OUT_DIR/gather_gemm_$TAG.log" | tail -3
  mv "$OUT_DIR/gather_gemm/gather_gemm.json" "$OUT_DIR/gather_gemm_$TAG.json" 2>/dev/null
  echo "== probe: $((SECONDS - start)) s"
fi

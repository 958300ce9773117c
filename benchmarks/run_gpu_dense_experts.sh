#!/usr/bin/env bash
# The dense routed experts' kernels on one GPU, from the repo root:  bash benchmarks/run_gpu_dense_experts.sh
# 1. tests: GPU tests of the experts' kernels (tests/experts/test_experts.py on CUDA, the FP8 GPU tests, which
#    share the grouped GEMM's tile schedule), tests/test_gpu.py and the one-GPU low_latency tests.
# 2. gemv: moe-sbo bench dense-experts, the routed MLP through the grouped GEMV, the tiled grouped GEMM and
#    torch._grouped_mm, 8/16/32 experts, 8 to 32768 rows, beside the read and compute floors
#    (file gemv_<tag>.json): the data behind experts.conditions.GEMV_MAX_ROWS_PER_EXPERT and TILED_MAX_ROWS_PER_EXPERT.
# 3. layer: moe-sbo bench low-latency at EP1, the low_latency MoE layer (eager and CUDA-graph replays) with
#    the experts' kernels left to "auto", forced to the GEMV and to torch._grouped_mm, 8 and 32 experts
#    per GPU (files low_latency_experts{8,32}_<tag>.json).
# 4. sweep: moe-sbo bench dense-experts --sweep, each GEMM of the MLP through the tiled GEMM under each tile config,
#    8 and 32 experts, 16-512 rows per expert (file dense_gemm_config_<tag>.json): the data behind
#    tiled_gemm.dense_config.
# 5. index: moe-sbo bench low-latency at EP1 with 32 experts per GPU, 256-4096 tokens, the received rows copied
#    into expert order (index graphs "on") against left in place for the tiled GEMM to read through the
#    layout's index ("index_rows"), eager and replayed (file low_latency_index_rows_<tag>.json).
# 6. mid: the tiled GEMM from 129 to 512 rows per expert in layers: moe-sbo bench low-latency at EP1 with the
#    experts' kernels left to "auto" and forced to torch._grouped_mm, 32 experts per GPU at 512-4096
#    tokens and 8 at 256-1024 (files low_latency_mid{32,8}_<tag>.json), then moe-sbo bench tbo at
#    4096 prefill tokens, 32 and 8 experts (file tbo_mid_<tag>.json: each micro-batch's 512 rows per
#    expert on the tiled GEMM).
# 7. draw: moe-sbo bench dense-experts over 8 and 32 experts at 64-1024 rows per expert, the rows drawn at random and
#    R / L on every expert (--draw equal), in one run (files gemv_{random,equal}{8,32}_<tag>.json).
# 8. graph: the same kernels timed two ways in one run, 8 and 32 experts at 16-512 rows per expert, both
#    draws: each call launched from the host (triton's do_bench, as every gemv file before) and
#    replayed from a CUDA graph (--graph: the GPU's time alone, as a replayed layer runs them)
#    (files gemv_{eager,graph}_{random,equal}{8,32}_<tag>.json).
# PARTS (default "tests gemv layer") picks the parts; TEST_FILES, GEMV_ARGS and SWEEP_ARGS
# narrow them (e.g. SWEEP_ARGS="--configs 128x256x64_g8_w8_s3 --rows-per-expert 128 1024": the sweep's
# tile configs with descriptor loads and persistent grids cost a compile each). Expected wall time:
# about 8 minutes on one H200 for the default parts.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests gemv layer}"
if [[ " $PARTS " == *" tests "* ]]; then
  start=$SECONDS
  # shellcheck disable=SC2086  # TEST_FILES is a list
  "$PYTHON" -m pytest -q -p no:cacheprovider ${TEST_FILES:-tests/experts/test_experts.py tests/experts/test_gpu_fp8.py tests/test_gpu.py \
    tests/dispatch/test_gpu_low_latency.py} -k "${TESTS_K:-not nothing}" 2>&1 | tee "$OUT_DIR/tests_gpu_experts_$TAG.log" | tail -3
  echo "== tests: $((SECONDS - start)) s"
fi
# run_script NAME FILE MODE ARGS...: moe-sbo bench MODE writes OUT_DIR/NAME/FILE.json, kept as FILE_<tag>.json.
run_script() {
  local name=$1 file=$2 mode=$3
  shift 3
  local start=$SECONDS
  mkdir -p "$OUT_DIR/$name"
  "$PYTHON" -m moe_sbo bench "$mode" --out "$OUT_DIR/$name" "$@" 2>&1 | tee "$OUT_DIR/${file}_$TAG.log" | tail -20
  local written=("$OUT_DIR/$name"/*.json)
  if [ -f "${written[0]}" ]; then mv "${written[0]}" "$OUT_DIR/${file}_$TAG.json"; else echo "bench $mode wrote no result file"; fi
  echo "== $name: $((SECONDS - start)) s"
}
if [[ " $PARTS " == *" gemv "* ]]; then
  run_script gemv gemv dense-experts ${GEMV_ARGS:-}
fi
if [[ " $PARTS " == *" layer "* ]]; then
  run_script layer8 low_latency_experts8 low-latency --ranks 1 --experts-per-gpu 8 --tokens 8 16 32 64 128 \
    --fp8 off --kernels triton --transports nccl --baselines --expert-kernels auto gemv torch
  run_script layer32 low_latency_experts32 low-latency --ranks 1 --experts-per-gpu 32 --tokens 32 128 256 512 \
    --fp8 off --kernels triton --transports nccl --baselines --expert-kernels auto gemv torch
fi
if [[ " $PARTS " == *" sweep "* ]]; then
  # shellcheck disable=SC2086  # SWEEP_ARGS is a list
  run_script sweep dense_gemm_config dense-experts --sweep --experts 8 32 ${SWEEP_ARGS:-}
fi
if [[ " $PARTS " == *" index "* ]]; then
  run_script index low_latency_index_rows low-latency --ranks 1 --experts-per-gpu 32 --tokens 256 1024 4096 \
    --fp8 off --kernels triton --transports nccl --baselines --index-graphs on index_rows ${INDEX_ARGS:-}
fi
if [[ " $PARTS " == *" mid "* ]]; then
  run_script mid32 low_latency_mid32 low-latency --ranks 1 --experts-per-gpu 32 --tokens 512 1024 2048 4096 \
    --fp8 off --kernels triton --transports nccl --baselines --expert-kernels auto torch
  run_script mid8 low_latency_mid8 low-latency --ranks 1 --experts-per-gpu 8 --tokens 256 512 1024 \
    --fp8 off --kernels triton --transports nccl --baselines --expert-kernels auto torch
  start=$SECONDS
  "$PYTHON" -m moe_sbo.cli bench tbo --device cuda --experts 32 8 --dispatcher low_latency --overlap none \
    --prefill-tokens 4096 --decode-seqs 128 --warmup 3 --iters 10 --out "$OUT_DIR/tbo_mid_$TAG.json" \
    2>&1 | tee "$OUT_DIR/tbo_mid_$TAG.log" | tail -20
  echo "== tbo: $((SECONDS - start)) s"
fi
if [[ " $PARTS " == *" draw "* ]]; then
  for draw in random equal; do
    for experts in 8 32; do
      rows=$(for per in 64 128 256 512 1024; do echo $((per * experts)); done)
      # shellcheck disable=SC2086  # rows is a list
      run_script "draw_${draw}_$experts" "gemv_${draw}${experts}" dense-experts --draw "$draw" --experts "$experts" \
        --rows $rows
    done
  done
fi
if [[ " $PARTS " == *" graph "* ]]; then
  for draw in random equal; do
    for experts in 8 32; do
      rows=$(for per in 16 32 64 128 256 512; do echo $((per * experts)); done)
      for timer in eager graph; do
        # shellcheck disable=SC2086  # rows is a list
        run_script "${timer}_${draw}_$experts" "gemv_${timer}_${draw}${experts}" dense-experts --draw "$draw" \
          --experts "$experts" --rows $rows $([ "$timer" = graph ] && echo --graph)
      done
    done
  done
fi

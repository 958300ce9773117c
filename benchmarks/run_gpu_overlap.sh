#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_overlap.sh
# Runs every GPU-marked test, the SBO sweep (moe-sbo bench sbo) and the
# decoder-layer TBO sweep (moe-sbo bench tbo) over every visible GPU, writing JSON, timelines and
# logs under "${OUT:-out}". With one GPU the EP dispatchers move nothing off the GPU: those rows show
# each mode's overhead and CUDA-graph capture, not overlap. PARTS picks sections (default: all);
# TRACE=1 also keeps the Chrome traces of the SBO timeline.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests sbo tbo}"
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    tests) gpu_tests ;;
    sbo)
      if [ "$GPUS" -ge 2 ]; then DISP="all"; EXPERTS="256 32"; TOKENS="128 512 2048 4096 8192";
      else DISP="local low_latency"; EXPERTS="256 32"; TOKENS="128 512 4096"; fi
      # shellcheck disable=SC2086
      "$PYTHON" -m moe_sbo.cli bench sbo --dispatcher $DISP --experts $EXPERTS --tokens $TOKENS \
        --out "$OUT_DIR/sbo_$TAG.json" --timeline "$OUT_DIR/sbo_timeline_$TAG.png" --timeline-tokens 4096 \
        ${TRACE:+--trace "$OUT_DIR/sbo_trace_$TAG"} 2>&1 | tee "$OUT_DIR/sbo_$TAG.log" | tail -60
      if [ "$GPUS" -ge 2 ]; then
        # low_latency's default transport there is symmetric memory, whose dispatch transfer is the
        # packing kernel on the compute stream; the same decode sweep over NCCL shows what SBO gains with each.
        # shellcheck disable=SC2086
        "$PYTHON" -m moe_sbo.cli bench sbo --dispatcher low_latency --transport nccl --experts $EXPERTS --tokens 128 512 \
          --out "$OUT_DIR/sbo_${TAG}_ll_nccl.json" 2>&1 | tail -30
      fi ;;
    tbo)
      if [ "$GPUS" -ge 2 ]; then DISP="alltoall low_latency"; else DISP="low_latency"; fi
      # shellcheck disable=SC2086
      "$PYTHON" -m moe_sbo.cli bench tbo --dispatcher $DISP --experts 32 --overlap none combine_sm split \
        --prefill-tokens 4096 8192 --decode-seqs 32 64 128 256 --kv-len 2048 --delay 0 1 2 \
        --out "$OUT_DIR/tbo_$TAG.json" --timeline "$OUT_DIR/tbo_timeline_$TAG.png" \
        2>&1 | tee "$OUT_DIR/tbo_$TAG.log" | tail -50 ;;
    *) echo "unknown part $part (tests sbo tbo)"; exit 2 ;;
  esac
  echo "== $part: $((SECONDS - start)) s"
done

#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_eplb.sh
# Expert load balancing and node-aware dispatch on the visible GPUs (ranks share them where there are
# fewer GPUs than ranks: docs/ONE_GPU.md), writing JSON and logs under "${OUT:-out}". PARTS picks
# sections (default: all); LIMIT_S bounds each part (default 600):
#   tests      the GPU tests of both: every dispatcher with replicas vs the plain layer (bf16, and FP8 at
#              DeepSeek-V3's dims), a CUDA graph captured before a rebalance, node_aware at EP4/EP8 as
#              2-4 nodes under every SBO mode
#   overhead   the load statistics' cost: DeepSeek-V3's expert dims, low_latency, 128 tokens per rank,
#              replayed from a CUDA graph with and without eplb (bench eplb's eplb_overhead; target
#              <= 1 %): 32 experts on 2 ranks (16 a rank; ranks share a GPU where there is one), then
#              16 experts on one rank (no second rank's kernels beside it on the GPU)
#   rebalance  DeepSeek-V3's FP8 experts at EP8 (32 + 1 slots a rank), Zipf(1) routing: balance before
#              and after, moved bytes and the rebalance's time (on one GPU a functional figure)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests overhead rebalance}"
LIMIT_S="${LIMIT_S:-600}"
failed=""
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    tests)
      timeout "$LIMIT_S" "$PYTHON" -m pytest -q -rs --durations=15 -m gpu tests/eplb/test_gpu_eplb.py \
        tests/dispatch/test_gpu_node_aware.py 2>&1 | tee "$OUT_DIR/tests_gpu_eplb_$TAG.log" | tail -40 || failed+=" tests" ;;
    overhead)
      timeout "$LIMIT_S" "$PYTHON" -m moe_sbo bench eplb --ranks 2 --dispatcher low_latency --preset deepseek-v3 \
        --experts 32 --tokens 128 --redundant 0 --out "$OUT_DIR/eplb_overhead_$TAG.json" 2>&1 | tail -15 \
        || failed+=" overhead"
      timeout "$LIMIT_S" "$PYTHON" -m moe_sbo bench eplb --ranks 1 --dispatcher low_latency --preset deepseek-v3 \
        --experts 16 --tokens 128 --redundant 0 --out "$OUT_DIR/eplb_overhead_ep1_$TAG.json" 2>&1 | tail -15 \
        || failed+=" overhead-ep1" ;;
    rebalance)
      timeout "$LIMIT_S" "$PYTHON" -m moe_sbo bench eplb --ranks 8 --dispatcher low_latency --preset deepseek-v3 \
        --expert-dtype fp8 --tokens 128 --redundant 0 1 --no-graph --out "$OUT_DIR/eplb_rebalance_fp8_$TAG.json" \
        2>&1 | tail -15 || failed+=" rebalance" ;;
    *) echo "unknown part $part (tests overhead rebalance)"; exit 2 ;;
  esac
  echo "== $part: $((SECONDS - start)) s"
done
if [ -n "$failed" ]; then echo "failed:$failed"; exit 1; fi

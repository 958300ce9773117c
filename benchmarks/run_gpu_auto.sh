#!/usr/bin/env bash
# The automatic choices on 2x H200, from the repo root:  bash benchmarks/run_gpu_auto.sh
# 1. GPU tests: SBO auto choosing its mode for CUDA graphs from replays; TBO's GEMM SM budget.
# 2. SBO at decode size (128 tokens/rank, low_latency over NCCL, 8 and 32 routed experts per GPU), every
#    overlap mode eager and as CUDA-graph replays, on both wires; the graph rows of auto use
#    AutoOverlap.choose_for_graphs (files sbo_decode_<wire>_<tag>.json).
# 3. TBO on the emulated inter-node wire with its default GEMM budget (--tbo-gemm-sm-budget auto: all
#    SMs but NCCL's), prefill 4096 and 16384 tokens/rank and decode 128 sequences, at 32 and 8 routed
#    experts per GPU (tbo_default_budget_emulated-internode_<tag>.json).
# Expected wall time: about 4 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ "$GPUS" -lt 2 ]; then echo "run_gpu_auto.sh needs >= 2 GPUs, found $GPUS"; exit 2; fi
start=$SECONDS
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/overlap/test_gpu_overlap.py tests/overlap/test_tbo.py -k "auto_chooses or budget" \
  2>&1 | tee "$OUT_DIR/tests_gpu_auto_$TAG.log" | tail -5
echo "== tests: $((SECONDS - start)) s"
for wire in nvlink emulated-internode; do
  start=$SECONDS
  "$PYTHON" -m moe_sbo.cli bench sbo --wire "$wire" --ranks 2 --dispatcher low_latency --transport nccl --experts 16 64 \
    --tokens 128 --graph-max-tokens 512 --out "$OUT_DIR/sbo_decode_${wire}_$TAG.json" \
    2>&1 | tee "$OUT_DIR/sbo_decode_${wire}_$TAG.log" | tail -28
  echo "== sbo $wire: $((SECONDS - start)) s"
done
start=$SECONDS
"$PYTHON" -m moe_sbo.cli bench tbo --wire emulated-internode --ranks 2 --dispatcher low_latency --transport nccl \
  --experts 64 16 --overlap none combine_sm --delay 0 --auto-tbo --prefill-tokens 4096 16384 --decode-seqs 128 \
  --kv-len 2048 --out "$OUT_DIR/tbo_default_budget_emulated-internode_$TAG.json" \
  2>&1 | tee "$OUT_DIR/tbo_default_budget_emulated-internode_$TAG.log" | tail -30
echo "== tbo: $((SECONDS - start)) s"

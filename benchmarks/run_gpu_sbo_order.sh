#!/usr/bin/env bash
# Whether the order of the modes biases SBO's decode rows, on 2x H200, from the repo root:
#   bash benchmarks/run_gpu_sbo_order.sh
# The 128-token decode rows of run_gpu_auto.sh (low_latency over NCCL, 8 routed experts per GPU) with
# the modes timed in reverse order (auto first, none last), on both wires, then once more in the usual
# order over NVLink: files sbo_decode_reversed_<wire>_<tag>.json and sbo_decode_repeat_nvlink_<tag>.json.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ "$GPUS" -lt 2 ]; then echo "run_gpu_sbo_order.sh needs >= 2 GPUs, found $GPUS"; exit 2; fi
COMMON=(--ranks 2 --dispatcher low_latency --transport nccl --experts 16 --tokens 128 --graph-max-tokens 512)
for wire in nvlink emulated-internode; do
  "$PYTHON" -m moe_sbo.cli bench sbo --wire "$wire" "${COMMON[@]}" --overlap auto split combine_sm combine dispatch none \
    --out "$OUT_DIR/sbo_decode_reversed_${wire}_$TAG.json" 2>&1 | grep -E "^ +8 " | tee "$OUT_DIR/sbo_decode_reversed_${wire}_$TAG.log"
done
"$PYTHON" -m moe_sbo.cli bench sbo --wire nvlink "${COMMON[@]}" --out "$OUT_DIR/sbo_decode_repeat_nvlink_$TAG.json" \
  2>&1 | grep -E "^ +8 " | tee "$OUT_DIR/sbo_decode_repeat_nvlink_$TAG.log"

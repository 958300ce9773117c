#!/usr/bin/env bash
# The one command for 2x H200, from the repo root:  bash benchmarks/run_gpu_wire.sh
# SBO and TBO at EP2 on both wires (docs/BENCHMARKS.md): nvlink and
# emulated-internode (NCCL with NCCL_P2P_DISABLE=1, traffic through host memory). Per wire:
# - SBO: moe-sbo bench sbo, every overlap mode (auto included), low_latency over NCCL (the emulated wire
#   cannot carry symm_mem or copy_engine), 32 routed experts per GPU, prefill 1024 4096 16384 and
#   decode 16 128 512 tokens/rank (decode sizes also as CUDA-graph replays); every row carries
#   t_floor_us (router + routed + shared experts, each alone) and t_wire_us (raw all_to_all_single
#   of the same bytes), the meta the wire and its measured all-to-all bandwidth;
# - TBO: moe-sbo bench tbo, overlap none and combine_sm, without and with TBO (delay 0) and as AutoTbo
#   chooses (--auto-tbo), prefill 1024 4096 16384 tokens/rank and decode 16 128 512 sequences (kv 2048,
#   graphs), at 32 and at 8 routed experts per GPU (TBO_EXPERTS, total over both GPUs: "64 16"; 8 per
#   GPU is DeepSeek-V3 at EP32, where each micro-batch's expert GEMMs are 4x taller).
# Writes sbo_wire_<wire>_<tag>.json, tbo_wire_<wire>_<tag>.json and their logs under "${OUT:-out}".
# WIRES picks the wires (default: both); PARTS picks "sbo" and/or "tbo" (default both). The TBO run's GEMMs
# plan for all SMs but the transfer's (--tbo-gemm-sm-budget auto, the default); TBO_SM_BUDGETS (e.g.
# "all 128") adds a TBO run per budget (files tbo_wire_<wire>_<tag>_sms<N>.json).
# Wall time on 2x H200: about 4 minutes per wire (WIRES=nvlink, then WIRES=emulated-internode splits it).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ "$GPUS" -lt 2 ]; then echo "run_gpu_wire.sh needs >= 2 GPUs, found $GPUS"; exit 2; fi
WIRES="${WIRES:-nvlink emulated-internode}"
PARTS="${PARTS:-sbo tbo}"
COMMON=(--ranks 2 --dispatcher low_latency --transport nccl)
for wire in $WIRES; do
  start=$SECONDS
  if [[ " $PARTS " == *" sbo "* ]]; then
    "$PYTHON" -m moe_sbo.cli bench sbo --wire "$wire" "${COMMON[@]}" --experts 64 --tokens 16 128 512 1024 4096 16384 \
      --graph-max-tokens 512 --out "$OUT_DIR/sbo_wire_${wire}_$TAG.json" \
      2>&1 | tee "$OUT_DIR/sbo_wire_${wire}_$TAG.log" | tail -45
  fi
  if [[ " $PARTS " == *" tbo "* ]]; then
    for budget in "" ${TBO_SM_BUDGETS:-}; do
      suffix=${budget:+_sms$budget}
      # shellcheck disable=SC2086  # TBO_EXPERTS is meant to split into values
      "$PYTHON" -m moe_sbo.cli bench tbo --wire "$wire" "${COMMON[@]}" --experts ${TBO_EXPERTS:-64 16} \
        --overlap none combine_sm --delay 0 --auto-tbo \
        --prefill-tokens 1024 4096 16384 --decode-seqs 16 128 512 --kv-len 2048 ${budget:+--tbo-gemm-sm-budget $budget} \
        --out "$OUT_DIR/tbo_wire_${wire}_$TAG$suffix.json" 2>&1 | tee "$OUT_DIR/tbo_wire_${wire}_$TAG$suffix.log" | tail -30
    done
  fi
  echo "== $wire: $((SECONDS - start)) s"
done

#!/usr/bin/env bash
# low_latency's eager phases against the same phases replayed, on every visible GPU (one rank each),
# from the repo root:  bash benchmarks/run_gpu_host.sh
# Per round (ROUNDS, default 2, since host time drifts over minutes on one machine), in "${OUT:-out}":
# low_latency_host_${TAG}_N.json (moe-sbo bench low-latency: the eager layer's phases from hook events with
# the ranks lined up, per index_graphs setting, beside the same phases replayed from CUDA graphs and
# raw NCCL on the same bytes).
# TOKENS (default 128) and TRANSPORT (default symm_mem from two GPUs, nccl on one) pick the rows;
# SETTINGS (default "on fixed_rows off") the layer's index_graphs settings (moe-sbo bench low-latency
# --index-graphs; "on index_rows": the experts reading the received rows in place, replayed too).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOKENS="${TOKENS:-128}"
if [ "$GPUS" -ge 2 ]; then TRANSPORT="${TRANSPORT:-symm_mem}"; else TRANSPORT="${TRANSPORT:-nccl}"; fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  start=$SECONDS
  # shellcheck disable=SC2086  # TOKENS and SETTINGS are meant to split
  "$PYTHON" -m moe_sbo bench low-latency --out "$OUT_DIR/ll_$round" --tokens $TOKENS --fp8 off --kernels triton \
    --transports "$TRANSPORT" --index-graphs ${SETTINGS:-on fixed_rows off} --baselines 2>&1 | tail -8
  cp "$OUT_DIR/ll_$round/low_latency.json" "$OUT_DIR/low_latency_host_${TAG}_$round.json"
  echo "== round $round: $((SECONDS - start)) s"
done

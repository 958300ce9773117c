#!/usr/bin/env bash
# low_latency's eager host time at decode size, on every visible GPU (one rank each), from the repo
# root:  bash benchmarks/run_gpu_host.sh
# Per round (ROUNDS, default 2, since host time drifts over minutes on one machine), in "${OUT:-out}":
# host_breakdown_${TAG}_N.txt and host_breakdown_fixed_rows_${TAG}_N.txt (host µs of each step
# inside the four dispatcher calls, without and with fixed_expert_rows) and
# low_latency_host_${TAG}_N.json (the eager layer's phases with index graphs on, with
# fixed_expert_rows and off, against the same phases replayed from CUDA graphs). Once:
# host_profile_$TAG.txt (cProfile with fixed_expert_rows) and host_pieces_$TAG.txt (each building
# block's host time alone, the staging's one word copy beside its converting copies among them).
# TOKENS (default 128) and TRANSPORT (default symm_mem from two GPUs, nccl on one) pick the rows;
# SETTINGS (default "on fixed_rows off") the layer's index_graphs settings (bench_low_latency.py
# --index-graphs; "on index_rows": the experts reading the received rows in place, replayed too).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOKENS="${TOKENS:-128}"
if [ "$GPUS" -ge 2 ]; then TRANSPORT="${TRANSPORT:-symm_mem}"; else TRANSPORT="${TRANSPORT:-nccl}"; fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  start=$SECONDS
  for fixed in "" "--fixed-expert-rows"; do
    name="host_breakdown${fixed:+_fixed_rows}_${TAG}_$round.txt"
    # shellcheck disable=SC2086  # TOKENS and fixed are meant to split
    "$PYTHON" benchmarks/probe_host_time.py --breakdown --tokens $TOKENS --transport "$TRANSPORT" --iters 50 \
      $fixed --out "$OUT_DIR/$name" | tail -20
  done
  # shellcheck disable=SC2086
  "$PYTHON" benchmarks/bench_low_latency.py --out "$OUT_DIR/ll_$round" --tokens $TOKENS --fp8 off --kernels triton \
    --transports "$TRANSPORT" --index-graphs ${SETTINGS:-on fixed_rows off} --baselines 2>&1 | tail -8
  cp "$OUT_DIR/ll_$round/low_latency.json" "$OUT_DIR/low_latency_host_${TAG}_$round.json"
  echo "== round $round: $((SECONDS - start)) s"
done
# shellcheck disable=SC2086
"$PYTHON" benchmarks/probe_host_time.py --tokens $TOKENS --transport "$TRANSPORT" --iters 50 --top 25 \
  --fixed-expert-rows --out "$OUT_DIR/host_profile_$TAG.txt" > /dev/null
# shellcheck disable=SC2086
"$PYTHON" benchmarks/probe_host_time.py --pieces --tokens $TOKENS 4096 --transport "$TRANSPORT" --iters 200 \
  --out "$OUT_DIR/host_pieces_$TAG.txt" | grep -i "stage\|copies\|replay\|check"

#!/usr/bin/env bash
# low_latency's eager host time at decode size, on every visible GPU (one rank each), from the repo
# root:  bash benchmarks/run_gpu_host.sh
# Writes "${OUT:-out}/host_breakdown_$TAG.txt" (host µs of each step inside the four dispatcher calls),
# "host_profile_$TAG.txt" (cProfile, top functions by own time) and "low_latency_host_$TAG.json" (the
# eager layer's phases against the same phases replayed from CUDA graphs). TOKENS (default 128) and
# TRANSPORT (default symm_mem from two GPUs, nccl on one) pick the rows. BASE=DIR runs the same probes
# on another tree's src/ and benchmarks/ too (files tagged "_base"), for a before/after in one run.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOKENS="${TOKENS:-128}"
if [ "$GPUS" -ge 2 ]; then TRANSPORT="${TRANSPORT:-symm_mem}"; else TRANSPORT="${TRANSPORT:-nccl}"; fi
run_tree() {  # $1: tree root, $2: file suffix
  local root="$1" suffix="$2" start=$SECONDS
  # shellcheck disable=SC2086  # TOKENS is meant to split
  PYTHONPATH="$root/src" "$PYTHON" "$root/benchmarks/probe_host_time.py" --breakdown --tokens $TOKENS \
    --transport "$TRANSPORT" --iters 50 --out "$OUT_DIR/host_breakdown_$TAG$suffix.txt" | tail -30
  # shellcheck disable=SC2086
  PYTHONPATH="$root/src" "$PYTHON" "$root/benchmarks/bench_low_latency.py" --out "$OUT_DIR/ll$suffix" \
    --tokens $TOKENS --fp8 off --kernels triton --transports "$TRANSPORT" --index-graphs on --baselines \
    2>&1 | tail -12
  cp "$OUT_DIR/ll$suffix/low_latency.json" "$OUT_DIR/low_latency_host_$TAG$suffix.json"
  echo "== $root: $((SECONDS - start)) s"
}
run_tree "$PWD" ""
# shellcheck disable=SC2086
"$PYTHON" benchmarks/probe_host_time.py --tokens $TOKENS --transport "$TRANSPORT" --iters 50 --top 25 \
  --out "$OUT_DIR/host_profile_$TAG.txt" > /dev/null
if [ -n "${BASE:-}" ]; then run_tree "$BASE" "_base"; fi

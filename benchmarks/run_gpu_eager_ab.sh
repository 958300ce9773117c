#!/usr/bin/env bash
# low_latency's eager phases at decode size: this tree against another, in the same run. From the
# repo root, with BASELINE a directory holding the project's src/ and benchmarks/ at another commit:
#   git archive REV src benchmarks | tar -x -C build/baseline   (once, on the developer's machine)
#   BASELINE=build/baseline bash benchmarks/run_gpu_eager_ab.sh
# ROUNDS (default 2) rounds, each running the baseline then this tree, so the host's drift over
# minutes falls on both. In "${OUT:-out}": low_latency_eager_{base,head}_${TAG}_N.json per round
# (bench_low_latency.py: the eager layer's phases from hook events, ranks lined up, beside the same
# phases replayed from CUDA graphs) and host_breakdown_{base,head}_${TAG}.txt (host µs of each step
# inside the four dispatcher calls, one listing per round).
# TOKENS (default 128), TRANSPORT (default symm_mem: one GPU writes its own symmetric buffer) and
# SETTINGS (default "on fixed_rows index_rows": bench_low_latency.py --index-graphs) pick the rows.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
BASELINE="$(cd "${BASELINE:?set BASELINE to a directory holding src/ and benchmarks/ of another commit}" && pwd)"
TOKENS="${TOKENS:-128}"
TRANSPORT="${TRANSPORT:-symm_mem}"
scratch=$(mktemp -d)  # each run's own output folder: only the files above are kept
trap 'rm -rf "$scratch"' EXIT
for round in $(seq 1 "${ROUNDS:-2}"); do
  start=$SECONDS
  for tree in base head; do
    if [ "$tree" = base ]; then root="$BASELINE"; else root="$PWD"; fi
    # shellcheck disable=SC2086  # TOKENS and SETTINGS are meant to split
    PYTHONPATH="$root/src" "$PYTHON" "$root/benchmarks/probe_host_time.py" --breakdown --tokens $TOKENS \
      --transport "$TRANSPORT" --iters 50 --out "$scratch/breakdown.txt" > /dev/null
    { echo "== round $round"; cat "$scratch/breakdown.txt"; echo; } >> "$OUT_DIR/host_breakdown_${tree}_${TAG}.txt"
    # shellcheck disable=SC2086
    PYTHONPATH="$root/src" "$PYTHON" "$root/benchmarks/bench_low_latency.py" --out "$scratch/ll" \
      --tokens $TOKENS --fp8 off --kernels triton --transports "$TRANSPORT" \
      --index-graphs ${SETTINGS:-on fixed_rows index_rows} --baselines 2>&1 | tail -6
    cp "$scratch/ll/low_latency.json" "$OUT_DIR/low_latency_eager_${tree}_${TAG}_$round.json"
  done
  echo "== round $round: $((SECONDS - start)) s"
done

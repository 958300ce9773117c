#!/usr/bin/env bash
# The one command for the GPU machine (2 GPUs, or 1 that both ranks share), from the repo root:
#   bash benchmarks/run_gpu_faults.sh
# Dead and stalled peers: one rank killed (SIGKILL) or stalled at dispatch launch, in flight or combine,
# for every EP dispatcher and low_latency transport (benchmarks/fault_gpu.py); every survivor must name
# its error within the wait bound, end by itself, and the GPUs must serve the next job. Writes JSON and
# logs under "${OUT:-out}". PARTS picks sections (default: all):
#   kill    the 15 SIGKILL cases     (~4.5 min)
#   stall   the 15 stall cases       (~4.5 min)
#   tests   the GPU-marked fault tests, tests/launch/test_gpu_faults.py (~2.5 min)
# kill and stall together write fault_$TAG.json; one of them alone fault_${TAG}_<part>.json. CASES narrows
# the matrix by glob patterns over dispatcher/transport/fault_at/fault, e.g.
#   CASES="low_latency/symm_mem/* */pre_combine/*" PARTS=kill bash benchmarks/run_gpu_faults.sh
# BOUND_S: the jobs' wait bound (MOE_SBO_TIMEOUT_S, default 8). The times above are estimates (~18 s a
# case: ~9 s to start a job, the bound, ~1 s; plus ~30 s of check jobs); each row records its own time.
# All parts take ~12 min: where one command may run 10 min, run PARTS="kill tests", then PARTS=stall.
# Every part runs; the exit status is 1 when any part failed (a case off target, or a test).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-kill stall tests}"
CASES="${CASES:-}"
BOUND_S="${BOUND_S:-8}"
faults=""
for part in $PARTS; do
  case "$part" in
    kill|stall) faults+=" $part" ;;
    tests) ;;
    *) echo "unknown part $part (kill stall tests)"; exit 2 ;;
  esac
done
failed=""
if [ -n "$faults" ]; then
  start=$SECONDS
  name="fault_$TAG"
  if [ "$(echo $faults)" != "kill stall" ]; then name+="_$(echo $faults | tr ' ' '_')"; fi
  set -f  # CASES holds glob patterns for the harness, not for the shell
  cases=(); if [ -n "$CASES" ]; then cases=(--cases $CASES); fi
  "$PYTHON" benchmarks/fault_gpu.py --out "$OUT_DIR/$name.json" --bound-s "$BOUND_S" --faults $faults "${cases[@]}" \
    2>&1 | tee "$OUT_DIR/$name.log" | grep -v Warning || failed+=" faults"
  set +f
  echo "== faults ($faults ): $((SECONDS - start)) s"
fi
for part in $PARTS; do
  if [ "$part" = tests ]; then
    start=$SECONDS
    "$PYTHON" -m pytest -q -m gpu tests/launch/test_gpu_faults.py 2>&1 | tee "$OUT_DIR/tests_gpu_faults_$TAG.log" | tail -25 \
      || failed+=" tests"
    echo "== tests: $((SECONDS - start)) s"
  fi
done
if [ -n "$failed" ]; then echo "failed:$failed"; exit 1; fi

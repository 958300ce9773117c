#!/usr/bin/env bash
# The one command for the GPU machine, from the repo root:  bash benchmarks/run_gpu_reliability.sh
# Issue 8's GPU runs over every visible GPU, writing JSON and logs under "${OUT:-out}". PARTS picks
# sections (default: all):
#   tests   every GPU-marked test
#   growth  eager host-memory growth of the low_latency soak at EP 1 and EP n with each kernel path
#           over NCCL (rows under growth/, packed into growth.tgz)
#   soak    every EP dispatcher x every overlap mode, 10,000 eager forwards and 10,000 CUDA-graph replays
#           where capturable, low_latency on its default path (symmetric memory from 2 GPUs); --check:
#           a case that is not flat fails the part (~9 min)
#   soak-transports  the same for low_latency on its other transports, nccl and copy_engine (~9 min;
#           a part of its own so that each stays within a 10-minute command)
#   soak-rest  the cases a cut run left: low_latency on symmetric memory (every mode, eager and graph),
#           alltoall auto, low_latency on copy_engine auto (~6 min)
#   soak-rss   where eager NCCL host RSS goes: allgather and alltoall, none and dispatch, 10,000 eager
#           forwards each, with the heap (mallinfo2) and per-mapping (smaps) fields and --trim, after
#           warm-ups of 100 and of 3,000 forwards (~5 min)
# Every part runs; the exit status is 1 when any part failed (the tests or a soak case).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PARTS="${PARTS:-tests growth soak}"
failed=""
for part in $PARTS; do
  start=$SECONDS
  case "$part" in
    tests) gpu_tests || failed+=" tests" ;;
    growth)
      mkdir -p "$OUT_DIR/growth"
      for ranks in 1 "$GPUS"; do
        for kernels in torch triton; do
          "$PYTHON" benchmarks/soak.py --device cuda --ranks "$ranks" --dispatchers low_latency --overlaps none \
            --kernels "$kernels" --transport nccl --forwards 5000 --settle 2000 --graph-replays 0 \
            --out "$OUT_DIR/growth/soak_${TAG}_ep${ranks}_${kernels}.json" 2>&1 | tail -3 || failed+=" growth"
        done
      done
      tar czf "$OUT_DIR/growth.tgz" -C "$OUT_DIR" growth && rm -r "$OUT_DIR/growth" ;;
    soak)
      "$PYTHON" benchmarks/soak.py --device cuda --dispatchers allgather alltoall low_latency --overlaps all \
        --forwards 10000 --check --out "$OUT_DIR/soak_$TAG.json" 2>&1 | tee "$OUT_DIR/soak_$TAG.log" | tail -40 \
        || failed+=" soak" ;;
    soak-transports)
      for transport in nccl copy_engine; do
        "$PYTHON" benchmarks/soak.py --device cuda --dispatchers low_latency --transport "$transport" --overlaps all \
          --forwards 10000 --check --out "$OUT_DIR/soak_${TAG}_low_latency_${transport}.json" 2>&1 \
          | tee "$OUT_DIR/soak_${TAG}_low_latency_${transport}.log" | tail -20 || failed+=" soak-$transport"
      done ;;
    soak-rest)
      for cut in "low_latency symm_mem all" "alltoall auto auto" "low_latency copy_engine auto"; do
        read -r dispatcher transport overlaps <<<"$cut"
        "$PYTHON" benchmarks/soak.py --device cuda --dispatchers "$dispatcher" --transport "$transport" \
          --overlaps "$overlaps" --forwards 10000 --check --out "$OUT_DIR/soak_${TAG}_${dispatcher}_${transport}_$overlaps.json" \
          2>&1 | tail -14 || failed+=" soak-rest"
      done ;;
    soak-rss)
      # Twice: with the usual 100-forward warm-up (the first forwards' steps, with where they land),
      # then with 3,000 (whether the RSS is flat once the C heap's pages have all been touched).
      for warmup in 100 3000; do
        "$PYTHON" benchmarks/soak.py --device cuda --dispatchers allgather alltoall --overlaps none dispatch \
          --forwards 10000 --warmup "$warmup" --graph-replays 0 --trim --out "$OUT_DIR/soak_${TAG}_rss_warmup$warmup.json" \
          2>&1 | tail -6 || failed+=" soak-rss"
      done ;;
    *) echo "unknown part $part (tests growth soak soak-transports soak-rest soak-rss)"; exit 2 ;;
  esac
  echo "== $part: $((SECONDS - start)) s"
done
if [ -n "$failed" ]; then echo "failed:$failed"; exit 1; fi

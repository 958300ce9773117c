#!/usr/bin/env bash
# Every `moe-sbo bench` mode once on the GPU machine, at small sizes (a smoke run: each mode starts,
# runs its CUDA paths and writes its result file; the numbers are not measurements). From the repo
# root:  bash benchmarks/run_gpu_modes.sh   (about 3 minutes on one GPU; ranks share it where there
# is one). Writes "${OUT:-out}/modes/<mode>.*" and a summary line per mode; exits 1 if any failed.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
DIR="$OUT_DIR/modes"
mkdir -p "$DIR"
failed=()
run() {  # run MODE ARGS...: one mode, its log kept, its status counted
  local mode=$1
  shift
  local start=$SECONDS
  if "$PYTHON" -m moe_sbo bench "$mode" "$@" >"$DIR/$mode.log" 2>&1; then
    echo "ok      $mode ($((SECONDS - start)) s)"
  else
    echo "FAILED  $mode ($((SECONDS - start)) s): $(tail -1 "$DIR/$mode.log")"
    failed+=("$mode")
  fi
}
run sbo --dispatcher local low_latency --experts 32 --tokens 128 --iters 3 --out "$DIR/sbo.json"
run tbo --dispatcher low_latency --experts 32 --overlap none split --prefill-tokens 1024 --decode-seqs 32 \
  --kv-len 256 --iters 3 --out "$DIR/tbo.json"
run eplb --ranks 2 --dispatcher low_latency --tokens 128 --redundant 0 1 --iters 3 --out "$DIR/eplb.json"
run foundation --out "$DIR/foundation" --quick --ranks 1 2 --tokens 128
run low-latency --out "$DIR/low_latency" --quick --ranks 1 2 --tokens 128
run prefill --out "$DIR/prefill" --quick --ranks 1 --tokens 1024
run dense-experts --out "$DIR/dense_experts" --experts 8 --rows-per-expert 16 256
run fp8-experts --out "$DIR/fp8_experts" --quick --experts 8 --decode-rows 16 --prefill-rows 512 \
  --layer-experts 8 --layer-tokens 256
run router --out "$DIR/router" --presets deepseek-v3 --tokens 128 --host-calls 20
run generate --out "$DIR/generate" --tiny --decode static --ranks 1 --layers 2 --experts 16 --vocab 500 \
  --batch 2 --prompt-len 8 --new-tokens 4 --repeats 1 --compare-tokens 4
run deep-ep --out "$DIR/deep_ep" --ranks 2 --warmup 2 --iters 10
run load-memory --ranks 2 --experts 16 --layers 2 --out "$DIR/load_memory.json"
echo "modes: $((12 - ${#failed[@]})) ok, ${#failed[@]} failed${failed[*]:+: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]

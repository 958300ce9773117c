# Sourced by the run_gpu_*.sh scripts: the environment every GPU run shares, and the versions it ran on.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast (NVLS) and symmetric-memory multicast stay off (not every machine supports them).
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
# The project's interpreter: PYTHON if set, else the repository's .venv, else the machine's python3.
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$PWD/.venv/bin/python" ]; then PYTHON="$PWD/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
# GPUs visible to this run, and the tag its result files carry: the GPU's own model and the count
# ("NVIDIA H200" x 2 -> h200x2, "NVIDIA A100-SXM4-80GB" x 8 -> a100-sxm4-80gbx8).
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
TAG=$("$PYTHON" -c 'import re, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
slug = re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")
print(f"{slug}x{torch.cuda.device_count()}")')
nvidia-smi -L
# The GPU-marked tests (arguments: pytest's, paths included; default every test under tests/): the log,
# skip reasons and slowest tests kept as tests_gpu_$TAG.log; the status is pytest's. Two test processes
# (GPU_TEST_WORKERS), each taking whole files, so a file's pool of ranks is started once: most tests
# wait on their ranks, not on the GPU.
gpu_tests() {
  "$PYTHON" -m pytest -q -rs --durations=15 -m gpu -n "${GPU_TEST_WORKERS:-2}" --dist loadfile "${@:-tests}" 2>&1 |
    tee "$OUT_DIR/tests_gpu_$TAG.log" | tail -60
}
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
# Ranks that share a GPU (more ranks than GPUs: every multi-rank test on a one-GPU machine) time-slice
# their CUDA contexts unless a CUDA MPS daemon serves them: device-side waits then take milliseconds, not
# microseconds. MPS=1 starts one for this run, MPS=0 never; by default (auto) on a machine with one GPU.
# It is stopped, and its folders removed, when the script exits.
if [ "${MPS:-auto}" = 1 ] || { [ "${MPS:-auto}" = auto ] && [ "$GPUS" -lt 2 ]; }; then
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/moe-sbo-mps-pipe.XXXXXX)
    CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/moe-sbo-mps-log.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d
    trap 'echo quit | nvidia-cuda-mps-control; sleep 1; rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"' EXIT
    echo "CUDA MPS: daemon started for this run"
  else
    echo "CUDA MPS: nvidia-cuda-mps-control not found; ranks sharing a GPU will time-slice"
  fi
fi

# Sourced by the run_gpu_*.sh scripts: the environment every GPU run shares, and the versions it ran on.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast (NVLS) and symmetric-memory multicast stay off on the lent machines.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
# GPUs visible to this run, and the tag its result files carry (h200x1, h200x2, ...).
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TAG="h200x${GPUS}"
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'

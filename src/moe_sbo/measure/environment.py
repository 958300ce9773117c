"""The environment a run ran in: moe-sbo, Python, torch, Triton, CUDA, NCCL and the GPU, for
``moe-sbo --version`` and the ``meta`` of every result file.

The hard part is speed: ``--version`` must answer at once, and importing torch takes seconds, so
nothing here imports it. Versions come from the installed packages' metadata (torch's CUDA from its
``+cuXYZ`` tag, NCCL from the ``nvidia-nccl-*`` wheel torch ships with), the GPU from ``nvidia-smi``.
Result files take the rest from the torch they ran with (``results.result_meta``).
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess

from .. import __version__

NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
CUDA_PACKAGES = ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu11")


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def torch_cuda(torch_version: str | None) -> str | None:
    """The CUDA torch was built for, from its tag (``2.5.1+cu124`` -> 12.4; ``+cpu`` -> None), or
    from the CUDA runtime wheel installed beside an untagged torch."""
    if torch_version is None:
        return None
    tag = re.search(r"\+cu(\d+)(\d)$", torch_version)
    if tag:
        return f"{tag.group(1)}.{tag.group(2)}"
    if "+" in torch_version:  # +cpu, +rocm...: no CUDA
        return None
    return package_version(*CUDA_PACKAGES)


def gpu_names(timeout_s: float = 2.0) -> list[str]:
    """The names of the visible NVIDIA GPUs (``nvidia-smi``), none where it is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def environment(gpus: bool = True) -> dict[str, str | int | None]:
    """moe-sbo, Python, torch, Triton, CUDA, NCCL versions and (``gpus``) the visible GPUs, without
    importing torch (None: not installed, or no GPU)."""
    torch_version = package_version("torch")
    names = gpu_names() if gpus else []
    return {
        "moe_sbo": __version__,
        "python": platform.python_version(),
        "torch": torch_version,
        "triton": package_version("triton", "pytorch-triton"),
        "cuda": torch_cuda(torch_version),
        "nccl": package_version(*NCCL_PACKAGES),
        "gpu": names[0] if names else None,
        "gpu_count": len(names),
    }


def version_report() -> str:
    """``moe-sbo --version``: the version line first (what scripts read), then the environment."""
    env = environment()

    def shown(key: str) -> str:
        return str(env[key]) if env[key] is not None else "none"

    gpu = f"{env['gpu_count']}x {env['gpu']}" if env["gpu"] else "none visible"
    return (
        f"moe-sbo {env['moe_sbo']}\n"
        f"Python {env['python']}, torch {shown('torch')}, Triton {shown('triton')}\n"
        f"CUDA {shown('cuda')}, NCCL {shown('nccl')}, GPU {gpu}"
    )

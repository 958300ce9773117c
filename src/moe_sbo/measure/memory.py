"""The memory check of every command that builds a model (``demo``, ``bench``, ``check``,
``generate``): an estimate of what one rank needs against what it has, before any rank starts, so a
DeepSeek-sized layer on a laptop's CPU ranks is refused with the fix instead of dying in the
allocator (or being killed half way through a sweep).

The estimate is deliberately rough and says so: the weights are exact (this rank's routed experts,
the shared experts and the router), the activations a generous multiple of the largest tensors a
forward holds. What is available: on CPU ``MemAvailable`` of ``/proc/meminfo`` shared by the ranks
(psutil is not a dependency); on CUDA the least free memory of the ranks' GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import MoEConfig
from ..decoder.attention import AttentionConfig
from ..launch.group import ranks_per_gpu

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs: ``weights_B`` (exact), ``activations_B`` (rough)."""

    weights_B: int
    activations_B: int
    local_experts: int
    dtype: str
    layers: int = 1
    reference_experts: int = 0  # of a reference layer beside them (every expert), or 0
    layers_are: str = "layers"  # what the ``layers`` are, as the estimate's description says it

    @property
    def total_B(self) -> int:
        return self.weights_B + self.activations_B

    def describe(self, sep: str = ", ") -> str:
        """What the estimate counts; ``sep`` between the weights and the activations."""
        held = f"{self.layers} {self.layers_are} x " if self.layers > 1 else ""
        reference = f" + {self.reference_experts} in the reference" if self.reference_experts else ""
        return (
            f"weights {size(self.weights_B)} ({held}{self.local_experts} local experts{reference}, shared "
            f"experts, router; {self.dtype}){sep}activations ~{size(self.activations_B)} (rough)"
        )


def size(nbytes: float) -> str:
    """Bytes as a short human number: 12.3 GB, 45.6 MB, 7.8 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def estimate_rank_bytes(
    cfg: MoEConfig,
    ranks: int,
    dtype: str,
    tokens: int,
    attention: AttentionConfig | None = None,
    kv_tokens: int = 0,
    *,
    layers: int = 1,
    reference: bool = False,
    redundant: int = 0,
    layers_are: str = "layers",
) -> MemoryEstimate:
    """Per-rank bytes of one layer of ``cfg`` on ``ranks`` ranks at ``tokens`` tokens per rank.

    ``attention`` (``bench tbo``): the decoder layer's attention weights and a KV cache of
    ``kv_tokens``. ``layers``: such layers a rank holds at once (``check``: one per dispatcher;
    ``generate``: every MoE layer of the model, whose other weights are not counted). ``reference``:
    one more layer with every routed expert (``demo``'s reference on each rank; ``check``'s, built
    in the launching process, counted on each rank's share). ``redundant``: extra expert slots per
    rank (expert load balancing's replicas). ``layers_are``: what the description calls the layers
    (``check``'s are copies of one layer, not the model's layers).
    """
    b = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    h, i, j, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.num_experts_per_tok
    local = cfg.experts_per_rank(ranks) + redundant
    rest = 3 * h * j * b + cfg.num_experts * h * 4  # shared experts; the router is float32
    weights = layers * (local * 3 * h * i * b + rest) + reference * (cfg.num_experts * 3 * h * i * b + rest)
    # Rough: every rank's tokens may land here (allgather; low_latency sizes its double buffers for
    # that, in and out), and T x K expert rows pass through a [2I] intermediate.
    activations = 8 * ranks * tokens * h * b + 2 * tokens * k * (2 * i + 2 * h) * b
    if attention is not None:
        n, a, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
        weights += (2 * n + 2 * a) * d * h * b  # q, k, v, o projections
        activations += 2 * kv_tokens * a * d * b + 4 * tokens * n * d * b  # KV cache, q and scores
    return MemoryEstimate(weights, activations, local, dtype, layers, reference * cfg.num_experts, layers_are)


def available_bytes(device: str, ranks: int) -> tuple[int, str] | None:
    """Bytes one rank may use and where the number comes from, or None when it cannot be known."""
    if device == "cuda":
        # Ranks go round-robin over the GPUs (launch.group), so the fullest GPU holds `sharing` of them.
        gpus = torch.cuda.device_count()
        sharing = ranks_per_gpu(ranks, gpus)
        # mem_get_info makes a CUDA context in this (launching) process: a few hundred MB per GPU.
        free = min(torch.cuda.mem_get_info(gpu)[0] for gpu in range(min(ranks, gpus)))
        if sharing == 1:
            return free, "free on the emptiest of the ranks' GPUs"
        return free // sharing, f"free on the emptiest of the ranks' GPUs / {sharing} ranks sharing it"
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // ranks, f"MemAvailable / {ranks} ranks"
    except OSError:
        pass
    return None  # not Linux: no MemAvailable to read


def memory_fix(device: str, smaller: str) -> str:
    """The end of a refusal: how to need less (``smaller``: the command's own options), or have more."""
    return f"use {smaller}, or " + ("a GPU" if device == "cpu" else "more GPUs (--ranks)")


def check_memory(estimate: MemoryEstimate, device: str, ranks: int, fix: str | None = None) -> str:
    """The lines to print before any rank starts; raises ``ValueError`` when ``estimate`` exceeds
    what is available, ending with ``fix`` (default: ``bench``'s options)."""
    available = available_bytes(device, ranks)
    line = f"memory per rank, estimated: {size(estimate.total_B)}"
    counted = "\n  " + estimate.describe(sep=",\n  ")  # printed lines fit 100 columns
    if available is None:
        return f"{line}; available memory unknown, not checked{counted}"
    free, source = available
    if estimate.total_B > free:
        fix = fix or (
            "use --preset tiny or fewer --experts, or a GPU"
            if device == "cpu"
            else "use fewer --experts or --tokens, a smaller --preset, or more GPUs (--ranks)"
        )
        raise ValueError(
            f"the memory per rank must be <= the {size(free)} available ({source}), got an estimated "
            f"{size(estimate.total_B)}: {estimate.describe()}; {fix}"
        )
    return f"{line} of {size(free)} available ({source}){counted}"

"""The bench modes' per-device defaults and wires, torch-free: the parsers show them in ``--help``
(``cli.parsers``), the runners fill them in for options left out (``sweep.resolve_defaults``)."""

from __future__ import annotations

from typing import Any

# Defaults per device, (GPU, CPU), for options left out. The GPU ones measure; the CPU ones only show
# that the sweep works, in well under two minutes on two cores (a DeepSeek-sized layer would not even
# fit in a laptop's memory). Values given on the command line are kept as they are.
DEVICE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "preset": ("deepseek-v3", "tiny"),
    "tokens": ([128, 512, 2048, 4096, 8192], [16, 64]),
    "warmup": (5, 1),
    "iters": (20, 3),
    "prefill_tokens": ([4096, 8192], [128]),
    "decode_seqs": ([32, 64, 128, 256], [4, 16]),
    "kv_len": (2048, 64),
    "heads": (128, 4),
    "kv_heads": (8, 2),
    "head_dim": (128, 16),
}

# Links a sweep can run over (``--wire``); what emulated-internode changes: ``sweep.EMULATED_INTERNODE_ENV``.
WIRES = ("nvlink", "emulated-internode")
# What the ``wire`` of a result (meta and rows) can say: the link the run's transfers crossed, derived
# from the run (``sweep.resolve_wire``), not from --wire alone.
WIRE_LABELS = {
    "nvlink": "one GPU per rank, with peer access (NVLink, or PCIe peer-to-peer): NCCL's P2P transport",
    "emulated-internode": "one GPU per rank, NCCL_P2P_DISABLE=1: NCCL through host memory",
    "host-memory": "one GPU per rank, no peer access between them: NCCL through host memory",
    "shared-gpu": "CUDA ranks sharing GPUs: a functional run, not wire speed",
    "gloo-cpu": "CPU ranks: gloo through the host's memory and loopback",
    "none": "one rank: nothing crosses a link",
}

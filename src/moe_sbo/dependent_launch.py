"""Programmatic dependent launch (Hopper and newer): a kernel of a chain starts while the one before it
finishes, instead of after it.

A kernel launched this way (``launch_pdl=True``) may have its programs placed on the GPU as soon as
every program of the kernel before it has called ``griddepcontrol.launch_dependents``, so its launch,
its prologue and (``prefetch_rows_l2``) the first reads of data no earlier kernel writes, such as
weights, overlap that kernel's last programs. Before it reads or writes anything else it waits
(``griddepcontrol.wait``) until the kernel before it has finished and its writes are visible: a
buffer it writes may be memory the caching allocator just took back from that kernel's input.

``enter(PDL)`` is that protocol at the top of a kernel; ``supported(device)`` says where launches use
it (CUDA sm90+, not under Triton's CPU interpreter) and ``kernel_options(device)`` gives the launch
keywords. Where it is off, the same kernels compile
without the two instructions and launch as usual. The FP8 expert MLP's four launches use it
(``experts/fp8_gemm.py``, ``quant/kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import env
from .streams import compute_capability


def supported(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch: CUDA sm90+ (it needs
    Hopper's grid dependency control), not under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" and not env.triton_interpreting() and compute_capability(device) >= (9, 0)


def kernel_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel taking a ``PDL`` constexpr: ``PDL`` and Triton's
    ``launch_pdl`` where ``supported``, ``PDL=False`` elsewhere."""
    return {"PDL": True, "launch_pdl": True} if supported(device) else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr):
    """The top of a kernel of a dependent-launch chain: let the next kernel's programs be placed,
    then wait for the previous kernel's writes. Nothing when ``PDL`` is false."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_rows_l2(row_ptrs, num_bytes: tl.constexpr):
    """Ask L2 to fetch ``num_bytes`` (a multiple of 16) from each address of ``row_ptrs`` (one bulk
    prefetch per element; sm90+), without waiting for them: for data no earlier kernel of the
    chain writes, read before ``enter``'s wait."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; // $0",
        "=r,l,r",
        [row_ptrs, tl.full(row_ptrs.shape, num_bytes, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )

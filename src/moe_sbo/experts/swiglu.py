"""SwiGLU between an MLP's two GEMMs, ``silu(gate) * up``, as one Triton launch.

Legend: see ``moe_sbo/__init__.py``.

torch computes it as two launches (``F.silu(gate)``, then the product), each a pass over memory; one
fused pass reads the gate and up halves once and writes the result once (its gain on the routed MLP
is in docs/BENCHMARKS.md). The kernel computes in float32 and rounds once; torch rounds silu's output
and then the product, so the two differ by at most a unit in the last place of the output dtype.

Each program computes ``BLOCK_I`` outputs of one row; rows at or past ``offsets_L[-1]`` (padding
behind the experts' rows) are neither read nor written, so a CUDA graph captured at one R replays
for any routing. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (the tests hold it to float32);
off CUDA the MLPs keep torch's two launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernel_choice import HAS_TRITON, use_triton

if HAS_TRITON:  # else torch's two launches everywhere
    import triton
    import triton.language as tl

BLOCK_I = 1024  # outputs per program: enough work per launch slot


if HAS_TRITON:

    @triton.jit
    def _swiglu_kernel(
        gate_up_ptr,
        out_ptr,
        last_ptr,
        stride_r,
        stride_out_r,
        INTER: tl.constexpr,
        BLOCK: tl.constexpr,
        PADDED: tl.constexpr,
    ):
        r = tl.program_id(0)
        if (not PADDED) or r < tl.load(last_ptr):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < INTER
            row = gate_up_ptr + r.to(tl.int64) * stride_r
            gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
            act = gate * tl.sigmoid(gate) * up
            tl.store(out_ptr + r.to(tl.int64) * stride_out_r + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate_up_R2I: torch.Tensor, offsets_L: torch.Tensor | None = None, kernels: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up_R2I`` (``[R, 2I]``, the gate's columns first, each row contiguous)
    -> ``[R, I]`` in its dtype. ``kernels`` (``kernel_choice``'s vocabulary): ``"triton"`` runs the
    Triton kernel (on CUDA, or on CPU under ``TRITON_INTERPRET=1`` as the other Triton kernels' CPU
    tests do), ``"auto"`` runs it on CUDA where Triton imports unless autograd records the call (the
    kernel has no backward), ``"torch"`` runs torch's two launches. ``offsets_L``: int32 cumulative
    row counts on the device; the kernel leaves rows at or past ``offsets_L[-1]`` unwritten."""
    if gate_up_R2I.dim() != 2 or gate_up_R2I.shape[1] % 2 or gate_up_R2I.stride(1) != 1:
        raise ValueError(
            f"swiglu needs [R, 2I] rows contiguous along their features, got shape {tuple(gate_up_R2I.shape)} and "
            f"strides {gate_up_R2I.stride()}"
        )
    # The kernel has no backward: "auto" keeps torch's ops where autograd records.
    recording = kernels == "auto" and torch.is_grad_enabled() and gate_up_R2I.requires_grad
    if recording or not use_triton(kernels, gate_up_R2I.device):
        gate_RI, up_RI = gate_up_R2I.chunk(2, dim=-1)
        return F.silu(gate_RI) * up_RI
    num_rows, inter = gate_up_R2I.shape[0], gate_up_R2I.shape[1] // 2
    out_RI = gate_up_R2I.new_empty(num_rows, inter)
    if num_rows and inter:
        block = min(BLOCK_I, triton.next_power_of_2(inter))
        _swiglu_kernel[(num_rows, triton.cdiv(inter, block))](
            gate_up_R2I,
            out_RI,
            gate_up_R2I if offsets_L is None else offsets_L[-1:],
            gate_up_R2I.stride(0),
            out_RI.stride(0),
            INTER=inter,
            BLOCK=block,
            PADDED=offsets_L is not None,
        )
    return out_RI

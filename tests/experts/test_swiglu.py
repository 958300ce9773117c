"""``experts.swiglu``: SwiGLU as one Triton launch (on CPU in Triton's interpreter, on CUDA marked gpu)
against float32 torch, and torch's two launches where the kernel is not asked for."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from moe_sbo.experts.swiglu import swiglu

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _float32_swiglu(gate_up_R2I: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_R2I.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_kernel(device: str, dtype: torch.dtype, num_rows: int, inter: int, last: int) -> None:
    generator = torch.Generator(device=device).manual_seed(inter + num_rows)
    # Rows at or past ``last`` are padding (NaN here): the real rows must not see them.
    gate_up = torch.randn(num_rows, 2 * inter, generator=generator, device=device).mul(3).to(dtype)
    gate_up[last:] = float("nan")
    offsets = torch.tensor([last // 2, last], dtype=torch.int32, device=device)
    got = swiglu(gate_up, offsets, kernels="triton")
    assert got.shape == (num_rows, inter) and got.dtype == dtype
    # One rounding to the output dtype: within half a unit in its last place of float32's value (a
    # few units of float32's own on CUDA, whose exp the kernel takes approximately).
    rtol = max(torch.finfo(dtype).eps, 1e-5)
    torch.testing.assert_close(got[:last].float(), _float32_swiglu(gate_up[:last]), rtol=rtol, atol=1e-6)
    # torch's two launches round twice: within a unit in the last place of the kernel's.
    torch.testing.assert_close(
        swiglu(gate_up[:last], kernels="torch").float(), got[:last].float(), rtol=2 * rtol, atol=1e-6
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows, inter, last", [(5, 200, 3), (3, 24, 3), (4, 1100, 4), (2, 64, 0)])
def test_kernel_matches_float32_torch_beside_padding_rows(dtype, num_rows, inter, last):
    # I off the kernel's blocks (200, 24), across two blocks (1100 > 1024), no real rows at all.
    _check_kernel("cpu", dtype, num_rows, inter, last)


def test_torch_path_off_cuda_and_under_kernels_torch():
    gate_up = torch.randn(4, 48)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(swiglu(gate_up), F.silu(gate) * up)  # CPU: the kernel is not the default
    assert torch.equal(swiglu(gate_up, kernels="torch"), F.silu(gate) * up)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match=r"\[R, 2I\]"):
        swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(torch.randn(8, 4).t())


def test_kernel_without_cuda_or_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        swiglu(torch.randn(2, 8), kernels="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda_matches_float32_torch(dtype):
    # DeepSeek-V3's expert width, rows of a padded low_latency buffer.
    _check_kernel("cuda", dtype, 300, 2048, 257)


@pytest.mark.gpu
def test_autograd_keeps_torch_on_cuda():
    gate_up = torch.randn(4, 64, device="cuda", requires_grad=True)
    swiglu(gate_up).sum().backward()  # the kernel has no backward: torch's ops carry the gradient
    gate, up = gate_up.detach().chunk(2, dim=-1)
    expected = torch.cat([up * torch.sigmoid(gate) * (1 + gate * (1 - torch.sigmoid(gate))), F.silu(gate)], dim=-1)
    torch.testing.assert_close(gate_up.grad, expected)

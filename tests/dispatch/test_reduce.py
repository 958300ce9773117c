"""``reduce.gather_sum``: the fixed-order combine reduction every dispatcher uses.

Held to a float64 reference built with ``index_add_`` (a different algorithm), on both paths: the
torch chain over k, and the Triton kernel (under Triton's CPU interpreter here, on CUDA in the GPU
tests). Both must be deterministic: the same inputs give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from moe_sbo.dispatch.reduce import gather_sum
from moe_sbo.kernel_choice import HAS_TRITON, interpreting, use_triton

PATHS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs Triton"))]


def reference(src_XH, index_YK, weight_X):
    """float64 sum via index_add_ over the valid (y, k) pairs."""
    num_src = src_XH.shape[0]
    m_idx, k_idx = (index_YK < num_src).nonzero(as_tuple=True)
    rows = index_YK[m_idx, k_idx]
    values = src_XH.double()[rows]
    if weight_X is not None:
        values = values * weight_X.double()[rows, None]
    return torch.zeros(index_YK.shape[0], src_XH.shape[1], dtype=torch.float64).index_add_(0, m_idx, values)


def random_case(generator, num_rows, top_k, num_src, hidden, dtype, weighted=True):
    src = torch.randn(num_src, hidden, generator=generator).to(dtype)
    index = torch.randint(0, num_src + 1, (num_rows, top_k), generator=generator)  # num_src: no source
    weight = torch.rand(num_src, generator=generator) if weighted else None
    return src, index, weight


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 3, 5, 48), (16, 8, 40, 256), (5, 1, 9, 130), (3, 6, 2, 16)])
def test_gather_sum_equals_the_reference(kernels, dtype, shape):
    num_rows, top_k, num_src, hidden = shape
    generator = torch.Generator().manual_seed(sum(shape))
    for weighted in (True, False):
        src, index, weight = random_case(generator, num_rows, top_k, num_src, hidden, dtype, weighted)
        out = gather_sum(src, index, weight, out_dtype=torch.float32, kernels=kernels)
        assert out.dtype == torch.float32 and out.shape == (num_rows, hidden)
        torch.testing.assert_close(out.double(), reference(src, index, weight), rtol=1e-5, atol=1e-5)
        rounded = gather_sum(src, index, weight, out_dtype=dtype, kernels=kernels)
        assert rounded.dtype == dtype
        if kernels == "triton" and interpreting():
            # Triton's CPU interpreter converts float32 to bfloat16 by truncation, not to nearest.
            torch.testing.assert_close(rounded.float(), out.to(dtype).float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(rounded, out.to(dtype))  # one rounding, at the end
        again = gather_sum(src, index, weight, out_dtype=torch.float32, kernels=kernels)
        assert torch.equal(again, out)  # deterministic


@pytest.mark.parametrize("kernels", PATHS)
def test_gather_sum_edges(kernels):
    src = torch.randn(4, 32)
    # A row whose every choice is "no source" is zero, not garbage.
    out = gather_sum(src, torch.tensor([[4, 4], [0, 4]]), kernels=kernels)
    assert torch.equal(out[0], torch.zeros(32)) and torch.equal(out[1], src[0])
    assert gather_sum(src, torch.empty(0, 3, dtype=torch.int64), kernels=kernels).shape == (0, 32)
    assert torch.equal(gather_sum(src, torch.empty(3, 0, dtype=torch.int64), kernels=kernels), torch.zeros(3, 32))
    int32_index = torch.tensor([[1, 4], [3, 2]], dtype=torch.int32)  # any integer dtype
    torch.testing.assert_close(gather_sum(src, int32_index, kernels=kernels), torch.stack([src[1], src[3] + src[2]]))
    empty_src = torch.empty(0, 32)
    assert torch.equal(gather_sum(empty_src, torch.zeros(3, 2, dtype=torch.int64), kernels=kernels), torch.zeros(3, 32))


def test_paths_agree():
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    generator = torch.Generator().manual_seed(3)
    src, index, weight = random_case(generator, 12, 8, 30, 200, torch.bfloat16)
    torch.testing.assert_close(
        gather_sum(src, index, weight, kernels="triton"),
        gather_sum(src, index, weight, kernels="torch"),
        rtol=1e-6,
        atol=1e-6,
    )


def test_kernel_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert not use_triton("auto", cpu) and not use_triton("torch", cpu)
    with pytest.raises(ValueError, match="kernels must be"):
        gather_sum(torch.randn(2, 16), torch.zeros(1, 1, dtype=torch.int64), kernels="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gather_sum(torch.randn(2, 16), torch.zeros(1, 1, dtype=torch.int64), kernels="triton")

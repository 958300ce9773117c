"""Grouped GEMMs (``torch._grouped_mm``, ``gemv_kernels``' Triton kernel for few rows per expert) and the
per-expert fallback against a per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_sbo.experts import RoutedExperts, SharedExperts


def _reference(x_RH, counts, gate_up, down):
    out, start = [], 0
    for expert, n in enumerate(counts):
        for row in x_RH[start : start + n]:
            gate, up = (gate_up[expert] @ row).chunk(2)
            out.append(down[expert] @ (F.silu(gate) * up))
        start += n
    return torch.stack(out) if out else x_RH.new_zeros(0, down.shape[1])


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [9, 0, 0, 0], [0, 0, 0, 2]])
def test_routed_experts_match_per_token_reference(use_grouped_mm, counts):
    experts = RoutedExperts(4, 32, 16)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        experts.use_grouped_mm = use_grouped_mm
        x = torch.randn(sum(counts), 32)
        got = experts(x, torch.tensor(counts))
        expected = _reference(x, counts, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [40, 0, 0, 2], [0, 17, 0, 16]])
def test_gemv_kernel_matches_per_token_reference_and_skips_padding(counts):
    # Sizes off the kernel's blocks (H 40, I 24: N 48 and 40, K 40 and 24), an expert with more
    # rows than one tl.dot block (40 > 16), empty experts, and padding rows after the last offset,
    # which the kernel must leave as they are (NaN here).
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    torch.manual_seed(sum(counts))
    experts = RoutedExperts(4, 40, 24, device=device)
    experts.kernels = "triton"
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
        real = sum(counts)
        x = torch.cat([torch.randn(real, 40, device=device), torch.full((5, 40), float("nan"), device=device)])
        got = experts(x, torch.tensor(counts))
        expected = _reference(x[:real], counts, experts.gate_up_proj, experts.down_proj)
    assert experts.dense_path(x) == "gemv"
    # Outputs reach ~100 with unit weights; another float32 summation order moves them by ~1e-4.
    torch.testing.assert_close(got[:real], expected, rtol=1e-4, atol=1e-3)


def test_shared_experts_are_a_swiglu_mlp():
    shared = SharedExperts(32, 24)
    with torch.no_grad():
        shared.gate_up_proj.normal_()
        shared.down_proj.normal_()
        x = torch.randn(5, 32)
        gate, up = shared.gate_up_proj[:24], shared.gate_up_proj[24:]
        expected = (F.silu(x @ gate.T) * (x @ up.T)) @ shared.down_proj.T
        torch.testing.assert_close(shared(x), expected)


@pytest.mark.gpu
def test_grouped_mm_on_gpu_matches_fallback_in_bf16():
    experts = RoutedExperts(8, 256, 128, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=256**-0.5)
        experts.down_proj.normal_(std=128**-0.5)
        counts = torch.tensor([64, 0, 17, 128, 3, 0, 40, 1], device="cuda")
        x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
        gemv = experts(x, counts)  # "auto" at 253 rows: gemv_kernels
        experts.kernels = "torch"
        fast = experts(x, counts)
        experts.use_grouped_mm = False
        slow = experts(x, counts)
    for got in (gemv, fast):
        rel = ((got.float() - slow.float()).norm() / slow.float().norm()).item()
        assert rel < 1e-2  # bf16 GEMMs with different tilings

"""The routed experts' rule table (``experts.select``) and each route's ``supports`` reason, on faked
devices: every case is a ``Conditions`` (device type, CUDA capability, dtype, rows per expert,
capture, index; Triton, its interpreter and Gluon present or not), so nothing here needs a GPU."""

from __future__ import annotations

import pytest
import torch

from moe_sbo.experts import conditions
from moe_sbo.experts.conditions import Conditions, Rows
from moe_sbo.experts.routes import (
    EXPERT_LOOP,
    FP8_SM90,
    FP8_TORCH,
    FP8_TRITON,
    GEMV,
    GROUPED_MM,
    ROUTES,
    SCALED_MM,
    TILED,
)
from moe_sbo.experts.select import DENSE_KERNELS, FP8_KERNELS, choose

BF16, F32 = torch.bfloat16, torch.float32
H100, A100, L40, B200 = (9, 0), (8, 0), (8, 9), (10, 0)


def cuda(capability=H100, dtype=BF16, rows=1.0, fp8=False, **facts) -> Conditions:
    facts = {"triton": True, "gluon": True, "interpreting": False, **facts}
    return Conditions("cuda", capability, dtype, fp8, Rows.of(rows), **facts)


def cpu(dtype=F32, rows=1.0, fp8=False, **facts) -> Conditions:
    facts = {"triton": True, "gluon": True, "interpreting": False, **facts}
    return Conditions("cpu", None, dtype, fp8, Rows.of(rows), **facts)


def route(c: Conditions, kernels: str = "auto") -> str:
    return choose(c, kernels).name


def test_dense_auto_on_an_sm90_gpu_by_rows_per_expert():
    gemv_max, tiled_max = conditions.GEMV_MAX_ROWS_PER_EXPERT, conditions.TILED_MAX_ROWS_PER_EXPERT
    for rows, expected in ((1, "gemv"), (gemv_max, "gemv"), (gemv_max + 0.25, "tiled"), (tiled_max, "tiled")):
        assert route(cuda(rows=rows)) == expected, rows
    assert route(cuda(rows=tiled_max + 1)) == "grouped_mm"
    # Rows read through an index: the tiled GEMM at any size above the GEMV's (no copy first).
    assert route(cuda(rows=10_000, indexed=True)) == "tiled"
    assert route(cuda(rows=2, indexed=True)) == "gemv"
    # A CUDA graph capture does not change the dense rule.
    assert route(cuda(rows=100, capture=True)) == "tiled"


def test_dense_auto_keeps_the_tiled_gemm_to_bf16_on_sm90_and_newer():
    # Off those the tiled sizes run torch: _grouped_mm where it runs, else the per-expert loop.
    assert route(cuda(dtype=F32, rows=100)) == "expert_loop"
    assert route(cuda(capability=A100, rows=100)) == "expert_loop"
    assert route(cuda(capability=B200, rows=100)) == "tiled"
    assert route(cuda(capability=A100, rows=4)) == "gemv"  # the GEMV runs on any GPU


def test_dense_auto_off_cuda_or_without_triton_runs_torch():
    assert route(cpu(rows=1)) == "grouped_mm"
    assert route(cpu(rows=1, interpreting=True)) == "grouped_mm"  # the interpreter is for tests that ask
    assert route(cuda(rows=1, triton=False)) == "grouped_mm"
    assert route(cuda(dtype=F32, rows=1, triton=False)) == "expert_loop"


def test_dense_triton_torch_and_route_names():
    assert [route(cuda(rows=r), "triton") for r in (8, 9, 10_000)] == ["gemv", "tiled", "tiled"]
    assert route(cpu(rows=100, interpreting=True), "triton") == "tiled"
    torch_route = choose(cuda(rows=1), "torch")
    assert torch_route.name == "grouped_mm" and torch_route.swiglu == "torch"  # torch's SwiGLU too
    assert choose(cuda(rows=1), "grouped_mm").swiglu == "auto"
    assert choose(cuda(dtype=F32, rows=1), "torch").name == "expert_loop"
    for name in ("gemv", "tiled", "grouped_mm", "expert_loop"):
        assert route(cuda(rows=100), name) == name


@pytest.mark.parametrize("kernels", ["triton", "gemv", "tiled"])
def test_dense_triton_routes_are_refused_without_triton_or_off_cuda(kernels):
    with pytest.raises(ValueError, match="needs Triton"):
        choose(cuda(rows=1, triton=False), kernels)
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        choose(cpu(rows=1), kernels)


def test_fp8_auto_on_sm90_with_gluon_runs_the_sm90_kernel_at_prefill_sizes():
    sm90_min, captured_min = conditions.SM90_MIN_ROWS_PER_EXPERT, conditions.SM90_CAPTURED_MIN_ROWS_PER_EXPERT
    for rows, eager, captured in (
        (captured_min - 1, "fp8_triton", "fp8_triton"),
        (captured_min, "fp8_triton", "fp8_sm90"),
        (sm90_min, "fp8_triton", "fp8_sm90"),
        (sm90_min + 1, "fp8_sm90", "fp8_sm90"),
        (conditions.SCALED_MM_MIN_ROWS_PER_EXPERT, "fp8_sm90", "fp8_sm90"),
    ):
        assert route(cuda(rows=rows, fp8=True)) == eager, rows
        assert route(cuda(rows=rows, fp8=True, capture=True)) == captured, rows
    assert route(cuda(rows=4096, fp8=True), "triton") == "fp8_sm90"


def test_fp8_auto_runs_cublas_eagerly_at_prefill_sizes_only_where_the_sm90_kernel_does_not():
    scaled_min = conditions.SCALED_MM_MIN_ROWS_PER_EXPERT
    assert route(cuda(rows=scaled_min, fp8=True, gluon=False)) == "scaled_mm"
    assert route(cuda(rows=scaled_min - 1, fp8=True, gluon=False)) == "fp8_triton"
    assert route(cuda(rows=scaled_min, fp8=True, gluon=False, capture=True)) == "fp8_triton"
    assert route(cuda(rows=scaled_min, fp8=True, gluon=False), "triton") == "fp8_triton"
    # Neither the sm90 kernel nor cuBLAS's block-wise FP8 off sm90: the Triton kernel at every size.
    assert route(cuda(capability=B200, rows=scaled_min, fp8=True)) == "fp8_triton"
    assert route(cuda(capability=L40, rows=scaled_min, fp8=True)) == "fp8_triton"


def test_fp8_off_cuda_and_refusals():
    assert route(cpu(rows=4, fp8=True)) == "fp8_torch"
    assert route(cpu(rows=4, fp8=True, interpreting=True), "triton") == "fp8_triton"
    assert route(cuda(rows=4, fp8=True), "torch") == "fp8_torch"
    assert route(cuda(capability=A100, rows=4, fp8=True), "torch") == "fp8_torch"
    with pytest.raises(ValueError, match="needs FP8 tensor cores"):
        choose(cuda(capability=A100, rows=4, fp8=True), "auto")
    with pytest.raises(ValueError, match="needs Triton"):
        choose(cuda(rows=4, fp8=True, triton=False, gluon=False), "auto")
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        choose(cpu(rows=4, fp8=True), "triton")
    with pytest.raises(ValueError, match="needs an sm90 CUDA device"):
        choose(cpu(rows=4, fp8=True), "scaled_mm")
    with pytest.raises(ValueError, match="'gemv' route for FP8 experts, which is for dense"):
        choose(cuda(rows=4, fp8=True), "gemv")


def test_the_vocabulary():
    assert set(DENSE_KERNELS) | set(FP8_KERNELS) == {"auto", "torch", "triton", *ROUTES}
    assert {name for name in ROUTES if not ROUTES[name].fp8} == set(DENSE_KERNELS[3:])
    with pytest.raises(ValueError, match="kernels must be one of"):
        choose(cuda(), "cuda")


def test_the_choice_depends_on_the_rows_only_through_the_thresholds_they_pass():
    assert cuda(rows=9) == cuda(rows=100) and cuda(rows=9) != cuda(rows=8)
    assert Rows.of(2048) == Rows.of(1e6) and Rows.of(2047.5) != Rows.of(2048)


def test_each_route_says_why_it_cannot_run():
    reasons = {
        (GEMV, cpu(triton=False)): "needs Triton (pip install triton)",
        (GEMV, cpu()): "needs CUDA tensors, or TRITON_INTERPRET=1",
        (TILED, cuda(fp8=True)): "is for dense (not FP8) weights",
        (GROUPED_MM, cuda(dtype=F32)): "runs on CUDA for bf16 on sm90 or newer, got torch.float32 on sm90",
        (GROUPED_MM, cuda(capability=A100)): "runs on CUDA for bf16 on sm90 or newer, got torch.bfloat16 on sm80",
        (GROUPED_MM, cpu()._replace(device_type="mps")): "runs on CUDA and CPU tensors, got mps",
        (EXPERT_LOOP, cuda(capture=True)): "reads the counts on the host",
        (FP8_TRITON, cuda()): "is for FP8 weights",
        (FP8_TRITON, cuda(capability=A100, fp8=True)): "needs FP8 tensor cores (sm89 or newer), got sm80",
        (FP8_SM90, cuda(fp8=True, gluon=False)): "needs Triton's Gluon and an sm90 GPU",
        (FP8_SM90, cuda(capability=B200, fp8=True)): "needs Triton's Gluon and an sm90 GPU, got cuda (sm100",
        (SCALED_MM, cuda(capability=B200, fp8=True)): "needs an sm90 CUDA device",
        (SCALED_MM, cuda(fp8=True, capture=True)): "reads the counts on the host",
        (SCALED_MM, cuda(fp8=True, triton=False)): "needs Triton",
        (FP8_TORCH, cuda(fp8=True, capture=True)): "reads the counts on the host",
    }
    for (r, c), reason in reasons.items():
        got = r.supports(c)
        assert got is not None and got.startswith(reason), (r.name, got)
    runs = [
        (GEMV, cuda()),
        (GEMV, cpu(interpreting=True)),
        (TILED, cuda(capture=True)),
        (GROUPED_MM, cpu()),
        (GROUPED_MM, cuda(capture=True)),
        (EXPERT_LOOP, cuda(dtype=F32)),
        (FP8_TRITON, cuda(capability=L40, fp8=True, capture=True)),
        (FP8_SM90, cuda(fp8=True, capture=True)),
        (SCALED_MM, cuda(fp8=True)),
        (FP8_TORCH, cpu(fp8=True)),
    ]
    assert [r.supports(c) for r, c in runs] == [None] * len(runs)

"""``kernel_choice``: the one Triton gate and the ``kernels=`` vocabulary every component takes."""

from __future__ import annotations

import pytest
import torch

from moe_sbo import kernel_choice
from moe_sbo.kernel_choice import KERNEL_CHOICES, check_kernels, lanes, next_power_of_2, use_triton

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_vocabulary_and_a_components_own_backends():
    assert KERNEL_CHOICES == ("auto", "torch", "triton")
    check_kernels("tiled", backends=("gemv", "tiled"))
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'torch', 'triton', 'gemv'\), got 'cuda'"):
        check_kernels("cuda", backends=("gemv",))
    with pytest.raises(ValueError, match="router_kernels must be one of"):
        check_kernels("tiled", name="router_kernels")


def test_auto_runs_triton_on_cuda_where_it_imports_and_torch_elsewhere(monkeypatch):
    monkeypatch.setattr(kernel_choice, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter never makes "auto" take the kernels on CPU
    assert use_triton("auto", CUDA) and not use_triton("auto", CPU)
    assert not use_triton("torch", CUDA)
    monkeypatch.setattr(kernel_choice, "HAS_TRITON", False)
    assert not use_triton("auto", CUDA)


def test_triton_by_name_runs_where_triton_runs_and_is_refused_elsewhere(monkeypatch):
    monkeypatch.setattr(kernel_choice, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("triton", CPU) and use_triton("triton", CUDA)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="kernels='triton' needs Triton and CUDA tensors.*got cpu tensors; use"):
        use_triton("triton", CPU)
    monkeypatch.setattr(kernel_choice, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="Triton does not import here"):
        use_triton("triton", CUDA)


def test_lanes_are_powers_of_two_at_least_two():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024)] == [1, 1, 2, 4, 4, 8, 1024, 1024]
    assert [lanes(n) for n in (0, 1, 2, 3, 8, 9)] == [2, 2, 2, 4, 8, 16]

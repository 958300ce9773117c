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


def _components():
    """One call per component with a kernel choice, taking the ``kernels`` value to try."""
    from moe_sbo.config import get_preset
    from moe_sbo.dispatch.base import EPGroup, make_dispatcher
    from moe_sbo.dispatch.reduce import gather_sum
    from moe_sbo.eplb.placement import trivial_placement
    from moe_sbo.eplb.runtime import LoadWindow, ReplicaTable, route_to_slots
    from moe_sbo.experts.routed import RoutedExperts
    from moe_sbo.experts.swiglu import swiglu
    from moe_sbo.routing.router import Router

    def experts(kernels):
        routed = RoutedExperts(2, 8, 4)
        routed.kernels = kernels
        return routed.route(torch.zeros(4, 8))

    def eplb(kernels):
        window, table = LoadWindow(4, 2, CPU), ReplicaTable(trivial_placement(4, 1), 0, CPU)
        return route_to_slots(torch.zeros(3, 2, dtype=torch.int64), window, table, kernels=kernels)

    return {
        "Router": lambda k: Router(get_preset("tiny"), kernels=k),
        "RoutedExperts": experts,
        "swiglu": lambda k: swiglu(torch.zeros(2, 8), kernels=k),
        "gather_sum": lambda k: gather_sum(torch.zeros(2, 8), torch.zeros(1, 1, dtype=torch.int64), kernels=k),
        "route_to_slots": eplb,
        "low_latency": lambda k: make_dispatcher("low_latency", 4, EPGroup(), max_tokens_per_rank=4, kernels=k),
    }


COMPONENTS = ["Router", "RoutedExperts", "swiglu", "gather_sum", "route_to_slots", "low_latency"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_with_a_kernel_choice_takes_the_one_vocabulary(component):
    """``kernels=`` everywhere takes ``"auto"`` and ``"torch"`` and refuses a value outside the
    vocabulary with the same message."""
    components = _components()
    assert sorted(components) == sorted(COMPONENTS)
    call = components[component]
    call("auto")
    call("torch")
    with pytest.raises(ValueError, match="kernels must be one of .*got 'cuda'"):
        call("cuda")

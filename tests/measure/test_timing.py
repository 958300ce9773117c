"""``measure.timing.host_breakdown``: host time per call of the functions it wraps, for a class's
method (inherited or its own, classmethods too) and a module's function, and everything put back."""

from __future__ import annotations

import torch

from moe_sbo.config import get_preset
from moe_sbo.dispatch.base import Dispatcher
from moe_sbo.dispatch.low_latency import LowLatencyDispatcher, RowFormat, paths
from moe_sbo.layer import MoELayer
from moe_sbo.measure.timing import host_breakdown


def test_host_breakdown_times_each_call_and_restores_everything():
    layer = MoELayer(
        get_preset("tiny"),
        dispatcher="low_latency",
        dtype=torch.float32,
        dispatcher_options={"max_tokens_per_rank": 16, "kernels": "torch"},
    )
    x = torch.randn(16, layer.cfg.hidden_size)
    with torch.no_grad():
        want = layer(x)
        targets = [
            (LowLatencyDispatcher, "dispatch_launch"),  # inherited from Dispatcher
            (LowLatencyDispatcher, "_launch_dispatch"),
            (RowFormat, "make"),  # a classmethod
            (paths, "gather_sum"),  # a module's function
        ]
        with host_breakdown(targets) as spans:
            for _ in range(3):
                got = layer(x)
                RowFormat.make(layer.cfg.hidden_size, 2, torch.float32, False)  # a forward asks it once per shape only
    assert torch.equal(got, want)
    assert {k: len(v) for k, v in spans.items()} == {
        "LowLatencyDispatcher.dispatch_launch": 3,
        "LowLatencyDispatcher._launch_dispatch": 3,
        "RowFormat.make": 3,
        "paths.gather_sum": 3,
    }
    assert all(us > 0 for times in spans.values() for us in times)
    # nested: the launch includes what it calls
    assert sum(spans["LowLatencyDispatcher.dispatch_launch"]) >= sum(spans["LowLatencyDispatcher._launch_dispatch"])
    assert "dispatch_launch" not in vars(LowLatencyDispatcher)
    assert LowLatencyDispatcher.dispatch_launch is Dispatcher.dispatch_launch
    assert isinstance(vars(RowFormat)["make"], classmethod)
    assert paths.gather_sum.__module__ == "moe_sbo.dispatch.reduce"


def test_kernel_timer_replays_from_a_graph_only_on_cuda():
    """``KernelTimer(graph=True)`` times CUDA-graph replays on a GPU; on CPU it falls back to the host
    clock and says so."""
    from moe_sbo.measure.timing import KernelTimer

    timer = KernelTimer(torch.device("cpu"), quick=True, graph=True)
    assert not timer.graph and timer.name == "host clock (median)"
    assert timer(lambda: torch.ones(4).sum()) > 0

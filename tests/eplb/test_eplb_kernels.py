"""The fused EPLB kernels (``eplb.kernels``, in Triton's CPU interpreter) against the torch path: the same
physical slot ids and the same load window, forward after forward (several programs per launch, so the
last one's advance of the window is exercised)."""

from __future__ import annotations

import os

import pytest
import torch

from moe_sbo.eplb import global_placement, zipf_load
from moe_sbo.eplb.runtime import LoadWindow, ReplicaTable, route_to_slots

pytest.importorskip("moe_sbo.eplb.kernels", reason="needs Triton (pip install triton)")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rank", [0, 3])
def test_fused_routing_and_counting_equal_the_torch_path(dtype, rank):
    num_experts, ranks, k = 32, 4, 6
    placement = global_placement(zipf_load(num_experts, 1.2, seed=1), ranks, 2)
    windows = {path: LoadWindow(num_experts, 3, torch.device("cpu")) for path in ("torch", "triton")}
    tables = {path: ReplicaTable(placement, rank, torch.device("cpu")) for path in ("torch", "triton")}
    generator = torch.Generator().manual_seed(rank)
    for tokens in (300, 1, 0, 77, 513):  # more forwards than the window holds; an empty one
        ids = torch.rand(tokens, num_experts, generator=generator).argsort(dim=1)[:, :k].to(dtype)
        ids[::7, -1] = -1  # padding slots: kept, not counted
        got = {path: route_to_slots(ids, windows[path], tables[path], kernels=path) for path in ("torch", "triton")}
        assert got["triton"].dtype == dtype and torch.equal(got["triton"], got["torch"])
        assert torch.equal(windows["triton"].counts_RE, windows["torch"].counts_RE)
        assert torch.equal(windows["triton"].position, windows["torch"].position)
        assert windows["triton"].ticket.item() == 0  # put back by the last program, for the next forward
    assert windows["torch"].total().sum() == (77 * k - 11) + (513 * k - 74)  # the last 3 forwards' valid ids

"""DeepEP's README examples, as docs/DEEP_EP.md gives them (one changed import), run on gloo CPU ranks
and driven as a model would: normal mode's dispatch/combine forward and backward, low-latency mode's
dispatch and combine with receiving hooks. The code run is read from the doc, so the doc cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

DOC = Path(__file__).resolve().parents[2] / "docs" / "DEEP_EP.md"


def example(name: str) -> str:
    """The python block after ``<!-- deep_ep example: name -->`` in docs/DEEP_EP.md."""
    found = re.search(rf"<!-- deep_ep example: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/DEEP_EP.md has no '{name}' example block"
    return found.group(1)


def test_examples_differ_from_deep_ep_by_the_import_only():
    for name in ("normal", "low_latency"):
        imports = [line for line in example(name).splitlines() if "deep_ep" in line and "import" in line]
        assert imports and all(line.startswith("from moe_sbo.deep_ep import ") for line in imports)


def _routing(device, num_tokens: int, num_experts: int, top_k: int, seed: int):
    torch.manual_seed(seed + dist.get_rank())
    x = torch.randn(num_tokens, 256, dtype=torch.bfloat16, device=device)
    scores = torch.randn(num_tokens, num_experts, device=device)
    topk_idx = torch.topk(scores, top_k, dim=-1).indices
    topk_weights = torch.rand(num_tokens, top_k, device=device)
    return x, topk_idx, topk_weights


def normal_example_rank(device, code: str) -> bool:
    ns: dict = {"__name__": "deep_ep_readme_normal"}
    exec(compile(code, "docs/DEEP_EP.md:normal", "exec"), ns)
    group, num_experts = dist.group.WORLD, 4 * dist.get_world_size()
    x, topk_idx, topk_weights = _routing(device, 12, num_experts, 3, seed=7)
    ns["get_buffer"](group, ns["get_hidden_bytes"](x))
    recv_x, recv_idx, recv_w, per_expert, handle, event = ns["dispatch_forward"](x, topk_idx, topk_weights, num_experts)
    event.current_stream_wait()
    assert sum(per_expert) == int((recv_idx >= 0).sum())
    # "Experts": identity, weighted by this rank's choices; combine sums the ranks -> x * sum of weights.
    y = (recv_x.float() * recv_w.sum(dim=1, keepdim=True)).bfloat16()
    combined, event = ns["combine_forward"](y, handle, previous_event=event)
    event.current_stream_wait()
    torch.testing.assert_close(
        combined.float(), x.float() * topk_weights.sum(dim=1, keepdim=True), rtol=2e-2, atol=2e-2
    )
    # Backward: dispatch's is a combine (rows summed, weights gathered back), combine's a cached dispatch.
    grad_x, grad_weights, event = ns["dispatch_backward"](recv_x, recv_w, handle)
    reached = ns["_buffer"].get_dispatch_layout(topk_idx, num_experts)[3].sum(dim=1, keepdim=True)
    torch.testing.assert_close(grad_x.float(), x.float() * reached, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_weights, topk_weights)
    grad_recv_x, event = ns["combine_backward"](x, handle)
    assert torch.equal(grad_recv_x, recv_x)
    return True


def low_latency_example_rank(device, code: str) -> bool:
    ns: dict = {"__name__": "deep_ep_readme_low_latency"}
    exec(compile(code, "docs/DEEP_EP.md:low_latency", "exec"), ns)
    group, num_experts, capacity = dist.group.WORLD, 4 * dist.get_world_size(), 16
    x, topk_idx, topk_weights = _routing(device, 10, num_experts, 3, seed=11)
    topk_idx[0, 1] = -1
    ns["get_buffer"](group, capacity, x.shape[1], num_experts)
    (recv_fp8, recv_scales), recv_count, handle, event, hook = ns["low_latency_dispatch"](
        x, topk_idx, capacity, num_experts
    )
    hook()
    assert int(recv_count.sum()) >= 0
    # "Experts": identity on the dequantised rows (DeepEP's default is the fp8 wire).
    y = (recv_fp8.float() * recv_scales.repeat_interleave(128, dim=-1)).bfloat16()
    combined, event, hook = ns["low_latency_combine"](y, topk_idx, topk_weights, handle)
    hook()
    expected = x.float() * topk_weights.masked_fill(topk_idx < 0, 0).sum(dim=1, keepdim=True)
    torch.testing.assert_close(combined.float(), expected, rtol=8e-2, atol=8e-2)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_readme_examples_run_with_one_changed_import(world, request):
    ranks = request.getfixturevalue(f"ranks{world}")
    assert all(ranks.run(normal_example_rank, example("normal")))
    assert all(ranks.run(low_latency_example_rank, example("low_latency")))

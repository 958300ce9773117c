"""Single-batch overlap under SGLang 0.5.23 with moe-sbo's dispatcher, on gloo CPU ranks.

The shared experts are handed over as SGLang's DeepSeek model hands them (``DeepseekV2MoE.forward_deepep``
with SBO on): a ``register_deepep_dispatch_hook`` that computes them and removes its handles, a
``register_post_dispatch_hook`` that calls SGLang's own ``compute_overlap_args`` and
``set_overlap_args``, a ``register_post_combine_hook`` that clears them. Every moe-sbo SBO mode gives
the ``none`` mode's output bitwise, the shared work runs at the mode's event, SGLang's ``SboFlags``
answer as the plugin says, and SGLang's hooks fire in moe-sbo's event order on both paths (whole
``dispatch``/``combine`` and the two-batch-overlap halves), removable while they run.
"""

from __future__ import annotations

import pytest
import sglang_runtime
import torch
import torch.distributed as dist

sglang_runtime.cpu_torchvision()  # before anything imports sglang (which imports torchvision)
pytest.importorskip("sglang", reason="SGLang is installed by `make test-sglang` (.venv-sglang)")

from test_sglang_dispatcher import HIDDEN, TOKENS, TOP_K, expert_weights, experts_on, routing  # noqa: E402

# Where each mode runs the shared-expert work: the last moe-sbo event fired before it ran.
LAUNCHED_AT = {
    None: "dispatch_in_flight",  # no SBO mode: SGLang's meaning of the deepep dispatch hook
    "none": "post_combine",
    "dispatch": "dispatch_in_flight",
    "combine": "pre_combine",
    "combine_sm": "combine_in_flight",
}


def sbo_rank(device, mode: str, overlap: str | None, split: bool) -> dict:
    """One forward as SGLang's DeepSeek MoE runs it with SBO on -> routed + shared output and traces."""
    from sglang.srt.batch_overlap.single_batch_overlap import SboFlags, compute_overlap_args
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    sglang_runtime.ensure(mode)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = 4 * world
    w_gate_up, w_down = expert_weights(num_experts, HIDDEN)
    shared_gate_up, shared_down = w_gate_up[:1] * 0.5, w_down[:1] * 0.5  # a shared expert of its own
    x, ids, weights = routing(rank, num_experts, torch.float32)
    calls: list[str] = []
    with sglang_runtime.plugin_choice("moe_sbo", overlap, None):
        flags = [SboFlags.enable_dispatch_shared_one_stream_overlap(), SboFlags.fuse_shared_experts_inside_sbo()]
        flags.append(SboFlags.enable_combine_down_gemm_two_stream_overlap())
        d = sglang_runtime.create_dispatcher(num_experts, HIDDEN, TOP_K, torch.float32)
        inner = d._inners[0]
        shared_output = None
        launched_after: list[str] = []

        # -- as DeepseekV2MoE.forward_deepep registers them when SBO is on --
        def deepep_dispatch_hook(dispatcher):
            nonlocal shared_output
            launched_after.append(inner.last_event_order[-1])
            gate, up = (x @ shared_gate_up[0].T).chunk(2, dim=-1)
            shared_output = (torch.nn.functional.silu(gate) * up) @ shared_down[0].T
            for handle in deepep_dispatch_handles:
                handle.remove()

        def post_dispatch_hook(dispatcher, dispatch_output):
            combine_args, down_gemm_args, meta_args = compute_overlap_args(dispatch_output, None)
            calls.append(f"post_dispatch:{combine_args}:{down_gemm_args}:{meta_args}")
            dispatcher.set_overlap_args(combine_overlap_args=combine_args, meta_overlap_args=meta_args)
            post_dispatch_handle.remove()

        def post_combine_hook(dispatcher, hidden_states):
            dispatcher.clear_overlap_args()
            calls.append("post_combine")
            post_combine_handle.remove()

        def pre_dispatch_hook(dispatcher, hidden_states, topk_output):
            calls.append("pre_dispatch")
            pre_dispatch_handle.remove()  # itself, while the event runs (SGLang's own registry raises here)
            pre_combine_handle.remove()  # and another one

        def pre_combine_hook(dispatcher, combine_input):
            calls.append("pre_combine")

        deepep_dispatch_handles = d.register_deepep_dispatch_hook(deepep_dispatch_hook)
        post_dispatch_handle = d.register_post_dispatch_hook(post_dispatch_hook)
        post_combine_handle = d.register_post_combine_hook(post_combine_hook)
        pre_dispatch_handle = d.register_pre_dispatch_hook(pre_dispatch_hook)
        pre_combine_handle = d.register_pre_combine_hook(pre_combine_hook)

        topk = StandardTopKOutput(weights, ids, torch.zeros(TOKENS, num_experts))
        first = rank * (num_experts // world)
        if split:
            d.dispatch_a(hidden_states=x, topk_output=topk)
            out = d.dispatch_b()
            d.combine_a(combine_input=experts_on(out, w_gate_up, w_down, first))
            routed = d.combine_b()
        else:
            out = d.dispatch(hidden_states=x, topk_output=topk)
            routed = d.combine(combine_input=experts_on(out, w_gate_up, w_down, first))
        assert shared_output is not None, "the shared experts never ran"
        left = inner.hooks.count() + inner.shared_work.count()
    return {
        "y": routed + shared_output,
        "launched_after": launched_after,
        "events": list(inner.last_event_order),
        "calls": calls,
        "flags": flags,
        "hooks_left": left,
    }


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_sbo_modes_equal_none_bitwise(mode, ranks2):
    runs = {overlap: ranks2.run(sbo_rank, mode, overlap, overlap == "combine") for overlap in LAUNCHED_AT}
    for overlap, results in runs.items():
        for rank, r in enumerate(results):
            assert torch.equal(r["y"], runs["none"][rank]["y"]), (overlap, rank)
            assert r["launched_after"] == [LAUNCHED_AT[overlap]], overlap
            # SGLang's hooks at moe-sbo's events, in order; the in-flight ones fired inside the buffer.
            names = [e for e in r["events"] if not e.endswith("in_flight")]
            assert names == ["pre_dispatch", "post_dispatch", "pre_combine", "post_combine"], r["events"]
            assert r["events"].count("dispatch_in_flight") == r["events"].count("combine_in_flight") == 1
            # SGLang's own compute_overlap_args asks nothing of DeepEP's kernels; pre_combine was removed.
            assert r["calls"] == ["pre_dispatch", "post_dispatch:None:None:{}", "post_combine"], r["calls"]
            assert r["hooks_left"] == 0
            # SboFlags: the model hands its shared experts over, and asks for no down-GEMM signal.
            expected_flags = [True, True, False] if overlap is not None else [False, False, False]
            assert r["flags"] == expected_flags, overlap


def test_sbo_under_ep4_low_latency(ranks4):
    """EP4, low-latency mode, the dispatch-overlap mode through the two-batch-overlap halves."""
    none = ranks4.run(sbo_rank, "low_latency", "none", False)
    for rank, r in enumerate(ranks4.run(sbo_rank, "low_latency", "dispatch", True)):
        assert torch.equal(r["y"], none[rank]["y"]) and r["launched_after"] == ["dispatch_in_flight"]

"""The hook contract (``hooks.py``, ``dispatch/base.py``), with one regression test per defect of SGLang's mechanism."""

from __future__ import annotations

import pytest
import torch

from moe_sbo.config import get_preset
from moe_sbo.dispatch import Dispatcher
from moe_sbo.hooks import HOOK_EVENTS, HookRegistry
from moe_sbo.layer import MoELayer


def test_hooks_run_in_registration_order_and_chain_replacements():
    registry, calls = HookRegistry(), []
    registry.register("pre_combine", lambda d, v: calls.append(("a", v)) or v + 1)
    registry.register("pre_combine", lambda d, v: calls.append(("b", v)))  # None: keep the value
    registry.register("pre_combine", lambda d, v: calls.append(("c", v)) or v * 10)
    assert registry.run("pre_combine", None, 1) == 20
    assert calls == [("a", 1), ("b", 2), ("c", 2)]


@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_hook_may_remove_itself_anywhere_in_the_list(position):
    # SGLang: removing any but the last hook while hooks run raises "OrderedDict mutated during iteration".
    registry, calls, handles = HookRegistry(), [], []
    for n in range(3):

        def hook(d, v, n=n):
            calls.append(n)
            if n == position:
                handles[n].remove()

        handles.append(registry.register("post_dispatch", hook))
    registry.run("post_dispatch", None, None)
    assert calls == [0, 1, 2]
    calls.clear()
    registry.run("post_dispatch", None, None)
    assert calls == [n for n in range(3) if n != position]


def test_a_hook_may_remove_a_later_hook_which_then_does_not_run():
    registry, calls = HookRegistry(), []
    first = registry.register("pre_dispatch", lambda d, v: calls.append("first") or later.remove())
    later = registry.register("pre_dispatch", lambda d, v: calls.append("later"))
    registry.register("pre_dispatch", lambda d, v: calls.append("last") or first.remove())
    registry.run("pre_dispatch", None, None)
    assert calls == ["first", "last"]
    assert registry.count("pre_dispatch") == 1


def test_hook_added_while_running_fires_from_the_next_run():
    registry, calls = HookRegistry(), []
    registry.register(
        "pre_combine",
        lambda d, v: calls.append("adder") or registry.register("pre_combine", lambda d, v: calls.append("new")),
        once=True,
    )
    registry.run("pre_combine", None, None)
    assert calls == ["adder"]
    registry.run("pre_combine", None, None)
    assert calls == ["adder", "new"]


def test_once_hooks_fire_once_and_remove_is_idempotent():
    registry, calls = HookRegistry(), []
    handle = registry.register("post_combine", lambda d, v: calls.append(1), once=True)
    registry.run("post_combine", None, None)
    registry.run("post_combine", None, None)
    assert calls == [1] and not handle.active
    handle.remove()
    assert registry.count() == 0


def test_in_flight_hooks_cannot_replace_the_transfer():
    registry = HookRegistry()
    registry.register("dispatch_in_flight", lambda d, v: "oops")
    with pytest.raises(TypeError, match="dispatch_in_flight hook must return None"):
        registry.run("dispatch_in_flight", None, object())


def test_bad_registrations_are_named():
    registry = HookRegistry()
    with pytest.raises(ValueError, match="event must be one of"):
        registry.register("deepep_dispatch_hook", lambda d, v: None)
    with pytest.raises(TypeError, match="hook must be callable"):
        registry.register("pre_dispatch", 42)


def _layer(dispatcher="local"):
    return MoELayer(get_preset("tiny"), dispatcher=dispatcher, dtype=torch.float32, seed=3)


def test_all_six_events_fire_in_order_with_their_payloads():
    layer, seen = _layer(), []
    for event in HOOK_EVENTS:
        layer.dispatcher.hooks.register(event, lambda d, v, e=event: seen.append((e, type(v).__name__, d)))
    with torch.no_grad():
        layer(torch.randn(9, 64))
    assert [s[0] for s in seen] == list(HOOK_EVENTS)
    assert [s[1] for s in seen] == ["DispatchInput", "Pending", "DispatchOutput", "CombineInput", "Pending", "Tensor"]
    assert all(s[2] is layer.dispatcher for s in seen)


def test_scoped_hooks_are_gone_after_a_forward_that_raises():
    # SGLang: one-shot hooks leak into the next forward when the forward raises.
    layer = _layer()
    hooks = layer.dispatcher.hooks

    def boom(d, v):
        raise RuntimeError("expert failure")

    with pytest.raises(RuntimeError, match="expert failure"):
        with hooks.scope() as scope:
            scope.register("pre_combine", lambda d, v: None, once=True)
            scope.register("post_combine", lambda d, v: None)
            scope.register("post_dispatch", boom)
            with torch.no_grad():
                layer(torch.randn(5, 64))
    assert hooks.count() == 0
    with torch.no_grad():
        layer(torch.randn(5, 64))  # the next forward sees no leftover hook


def test_replacement_at_post_dispatch_reaches_the_experts():
    layer = _layer()
    x = torch.randn(6, 64)
    with torch.no_grad():
        plain = layer(x)
        layer.dispatcher.hooks.register(
            "post_dispatch", lambda d, out: type(out)(out.expert_x_RH * 0, out.num_rows_per_expert_L, out.handle)
        )
        zeroed = layer(x)
        shared_only = layer.shared_experts(x)
    torch.testing.assert_close(zeroed, shared_only)  # routed experts saw zeros: SiLU(0)*0 = 0
    assert not torch.allclose(plain, zeroed)


def test_nothing_is_monkey_patched_and_extra_arguments_pass_through():
    # SGLang's registration replaced the dispatcher's methods and dropped extra arguments.
    layer = _layer("local")
    dispatcher = layer.dispatcher
    before = {
        name: getattr(type(dispatcher), name)
        for name in ("dispatch", "dispatch_launch", "dispatch_wait", "combine", "combine_launch", "combine_wait")
    }
    for event in HOOK_EVENTS:
        dispatcher.hooks.register(event, lambda d, v: None)
    assert all(name not in vars(dispatcher) for name in before)  # no instance attribute shadows a method
    assert {name: getattr(type(dispatcher), name) for name in before} == before
    received = {}

    class Recording(type(dispatcher)):
        def _launch_dispatch(self, inp, **kwargs):
            received["x"] = inp.x_TH
            return super()._launch_dispatch(inp)

    assert issubclass(Recording, Dispatcher)
    x = torch.randn(4, 64)
    ids = torch.randint(0, 16, (4, 4))
    recording = Recording(16, dispatcher.ep)
    out = recording.dispatch(x, ids, torch.rand(4, 4))
    assert received["x"] is x and out.expert_x_RH.shape == (16, 64)


def _two_phase_rank(device, dispatcher_name):
    """Hooks fire identically on dispatch()/combine() and on separate launch/wait (the TBO path)."""
    layer = MoELayer(get_preset("tiny"), dispatcher=dispatcher_name, dtype=torch.float32, seed=5)
    seen = []
    for event in HOOK_EVENTS:
        layer.dispatcher.hooks.register(event, lambda d, v, e=event: seen.append(e))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    with torch.no_grad():
        topk = layer.router(x)
        d = layer.dispatcher
        # Two micro-batches, interleaved as TBO does: launch A, launch B, wait A, wait B.
        pa = d.dispatch_launch(x[:3], topk.topk_ids_TK[:3], topk.topk_weights_TK[:3])
        pb = d.dispatch_launch(x[3:], topk.topk_ids_TK[3:], topk.topk_weights_TK[3:])
        ra, rb = d.dispatch_wait(pa), d.dispatch_wait(pb)
        ca = d.combine_launch(layer.experts.forward_dispatched(ra), ra.handle)
        cb = d.combine_launch(layer.experts.forward_dispatched(rb), rb.handle)
        y = torch.cat([d.combine_wait(ca), d.combine_wait(cb)]) + layer.shared_experts(x)
        ref = layer(x)
    return seen, (y - ref).abs().max().item()


@pytest.mark.parametrize("dispatcher", ["local", "allgather", "alltoall"])
def test_hooks_fire_on_the_two_phase_path(ranks2, dispatcher):
    # SGLang: hooks did not fire on the two-phase path TBO uses, so SBO and TBO could not combine.
    for seen, err in ranks2.run(_two_phase_rank, dispatcher):
        two_batches = (
            ["pre_dispatch", "dispatch_in_flight"] * 2
            + ["post_dispatch"] * 2
            + ["pre_combine", "combine_in_flight"] * 2
            + ["post_combine"] * 2
        )
        assert seen[:12] == two_batches and seen[12:] == list(HOOK_EVENTS)
        assert err < 1e-5

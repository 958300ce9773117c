"""Property tests on gloo ranks: routing fuzz and hooks under fire.

Hypothesis draws each case in the test process; the session rank pool runs it on every rank
(``ranks.run``) and the test process checks the answers, so a failing case shrinks like any other.

Routing fuzz: random token counts (0 on some ranks), expert skews (one expert, one rank), top-k,
routing and group settings, EP sizes 1-4 (sub-groups of the 4-rank pool) and every overlap mode.
Every EP dispatcher must equal the single-rank reference (``local``), and every token must be
accounted for: rows per expert add up to the routed pairs, bytes sent equal bytes received, and each
scheme moves exactly the bytes its wire format says.

Hooks under fire: random sets of hooks (recording, raising, removing themselves or others,
registering more, replacing the payload with itself; one-shot or persistent) over one to three
forwards, with every dispatcher and overlap mode, alone or as the two micro-batches of two-batch
overlap. The hooks that ran must be exactly those a model of the registry predicts, in its order;
no hook may be left behind; and every forward that did not raise must equal the hook-free one bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moe_sbo.config import get_preset
from moe_sbo.dispatch import DISPATCHERS, DispatchInput
from moe_sbo.hooks import HOOK_EVENTS, IN_FLIGHT_EVENTS
from moe_sbo.layer import MoELayer
from moe_sbo.overlap import OVERLAP_MODES
from moe_sbo.overlap.stages import run_interleaved
from moe_sbo.overlap.tbo import dispatcher_for

EP_DISPATCHERS = sorted(set(DISPATCHERS) - {"local"})
FLOAT32_TOL = 1e-5  # relative to max |y|: EP dispatchers sum the K expert outputs in another order
ROUTINGS = {  # topk_method -> (scoring_func, norm_topk_prob, routed_scaling_factor), as the presets pair them
    "noaux_tc": ("sigmoid", True, 2.5),
    "group_limited_greedy": ("softmax", False, 16.0),
    "greedy": ("softmax", False, 1.0),
}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- routing fuzz --------------------------------------------------------------------------------------

_GROUPS: dict[int, tuple] = {}


def _ep_group(size: int) -> tuple:
    """(group, members) of this rank among consecutive blocks of ``size`` pool ranks.

    Made once per pool process: ``new_group`` must be called by every rank for every block, in the
    same order, which holds because every rank runs the same case.
    """
    if size not in _GROUPS:
        world = dist.get_world_size()
        for start in range(0, world, size):
            members = list(range(start, min(start + size, world)))
            group = dist.new_group(members)
            if dist.get_rank() in members:
                _GROUPS[size] = (group, members)
    return _GROUPS[size]


def _routing(cfg, x_TH: torch.Tensor, skew: str, target: int, num_ranks: int, generator) -> tuple:
    """(ids [T, K], weights [T, K]) for ``skew``: the router's, uniform, or biased to one expert / one rank."""
    num_tokens, k, num_experts = x_TH.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    if skew == "router":
        reference = MoELayer(cfg, dtype=torch.float32, seed=0)
        topk = reference.router(x_TH)
        return topk.topk_ids_TK, topk.topk_weights_TK
    # Distinct experts per token: the K lowest of random scores, with preferred experts made lowest.
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator)
    local = num_experts // num_ranks
    if skew == "one_expert":
        scores_TE[:, target % num_experts] = -1.0  # every token picks it (and K - 1 others)
    elif skew == "one_rank":
        first = (target % num_ranks) * local
        scores_TE[:, first : first + local] -= 2.0  # every choice on that rank while it has experts left
    ids_TK = scores_TE.argsort(dim=1)[:, :k]
    return ids_TK, torch.rand(num_tokens, k, generator=generator)


def _routing_case_rank(device, case):
    group, members = _ep_group(case["ep_size"])
    rank = dist.get_rank()
    method = case["topk_method"]
    scoring, norm, scaling = ROUTINGS[method]
    cfg = get_preset("tiny").replace(
        num_experts=case["num_experts"],
        num_experts_per_tok=case["top_k"],
        topk_method=method,
        scoring_func=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
        n_group=case["n_group"],
        topk_group=case["topk_group"],
    )
    generator = torch.Generator().manual_seed(case["seed"] * 8 + rank)
    num_tokens = case["tokens"][rank]
    x_TH = torch.randn(num_tokens, cfg.hidden_size, generator=generator)
    ids_TK, weights_TK = _routing(cfg, x_TH, case["skew"], case["target"], len(members), generator)

    def use_drawn_routing(dispatcher, inp):  # a pre_dispatch replacement: the layer routes as drawn
        return DispatchInput(inp.x_TH, ids_TK, weights_TK)

    rows: list[list[int]] = []
    options = {"max_tokens_per_rank": case["capacity"]} if case["dispatcher"] == "low_latency" else None
    outputs = []
    with torch.inference_mode():
        for name, layer_group in ((case["dispatcher"], group), ("local", None)):
            layer = MoELayer(
                cfg,
                dispatcher=name,
                group=layer_group,
                dtype=torch.float32,
                seed=case["seed"],
                overlap=case["overlap"],
                dispatcher_options=options if name != "local" else None,
            )
            layer.dispatcher.hooks.register("pre_dispatch", use_drawn_routing)
            if name != "local":
                layer.dispatcher.hooks.register(
                    "post_dispatch", lambda d, out: rows.append(out.num_rows_per_expert_L.tolist())
                )
            outputs.append(layer(x_TH))
            if name != "local":
                traffic = layer.last_traffic
    owner_TK = torch.div(ids_TK, cfg.num_experts // len(members), rounding_mode="floor")
    group_rank = members.index(rank)
    return {
        "members": members,
        "group_rank": group_rank,
        "tokens": num_tokens,
        # Largest error relative to the output's scale (routed_scaling_factor reaches 16 here).
        "err": ((outputs[0] - outputs[1]).abs().max() / outputs[1].abs().max().clamp_min(1.0)).item()
        if num_tokens
        else 0.0,
        "shape": tuple(outputs[0].shape),
        "hidden": cfg.hidden_size,
        "rows_per_expert": rows[0],
        "pairs_per_expert": torch.bincount(ids_TK.reshape(-1), minlength=cfg.num_experts).tolist(),
        "remote_rows": sum(len(set(row) - {group_rank}) for row in owner_TK.tolist()),
        "traffic": (
            traffic.dispatch_bytes_sent,
            traffic.dispatch_bytes_recv,
            traffic.combine_bytes_sent,
            traffic.combine_bytes_recv,
        ),
    }


@st.composite
def routing_cases(draw, dispatcher: str, ep_size: int):
    num_experts = draw(st.sampled_from([e for e in (12, 16, 24) if e % ep_size == 0]))
    method = draw(st.sampled_from(sorted(ROUTINGS)))
    n_group = (
        1
        if method == "greedy"
        else draw(st.sampled_from([g for g in (1, 2, 4) if num_experts % g == 0 and num_experts // g >= 2]))
    )
    topk_group = draw(st.integers(1, n_group))
    max_k = num_experts if method == "greedy" else topk_group * num_experts // n_group
    top_k = draw(st.integers(1, min(max_k, 6)))
    # Zero tokens on some ranks is drawn often on purpose: the case collectives most often get wrong.
    tokens = draw(st.lists(st.one_of(st.just(0), st.integers(0, 24)), min_size=4, max_size=4))
    return {
        "ep_size": ep_size,
        "num_experts": num_experts,
        "topk_method": method,
        "n_group": n_group,
        "topk_group": topk_group,
        "top_k": top_k,
        "tokens": tokens,
        "dispatcher": dispatcher,
        "skew": draw(st.sampled_from(["router", "uniform", "one_expert", "one_rank"])),
        "target": draw(st.integers(0, 23)),
        "overlap": draw(st.sampled_from(OVERLAP_MODES)),
        "capacity": max(tokens) + draw(st.integers(0, 3)) or 1,  # at or just above the largest T
        "seed": draw(st.integers(0, 10_000)),
    }


def _align16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def _check_group(case: dict, results: list[dict]) -> None:
    """Accounting for one EP group (its ranks' answers, in group-rank order)."""
    size, top_k = len(results), case["top_k"]
    hidden = results[0]["hidden"]
    x_bytes, meta_bytes = hidden * 4, 2 * top_k * 4  # float32 rows; ids and weights as int32/float32
    # Every (token, expert) pair the group routed reaches its expert: per-expert rows add up.
    rows = [n for r in results for n in r["rows_per_expert"]]
    pairs = [sum(col) for col in zip(*(r["pairs_per_expert"] for r in results))]
    assert rows == pairs, (rows, pairs)
    sent = [sum(r["traffic"][i] for r in results) for i in range(4)]
    assert sent[0] == sent[1] and sent[2] == sent[3], sent  # every byte sent is received in the group
    for r in results:
        d_sent, d_recv, c_sent, c_recv = r["traffic"]
        # node_aware on one node (the group's default) is its intra-node leg: alltoall's rows
        if case["dispatcher"] in ("alltoall", "node_aware"):  # once per (token, remote rank owning one of its experts)
            assert d_sent == r["remote_rows"] * (x_bytes + meta_bytes) and c_recv == r["remote_rows"] * x_bytes
        elif case["dispatcher"] == "allgather":  # (P - 1) chunks of the largest T, both ways
            padded = max(q["tokens"] for q in results)
            assert (d_sent, c_sent) == ((size - 1) * padded * (x_bytes + meta_bytes), (size - 1) * padded * x_bytes)
        else:  # low_latency: full fixed blocks whatever the routing
            capacity = case["capacity"]
            assert d_sent == (size - 1) * capacity * _align16(x_bytes + meta_bytes)
            assert c_sent == (size - 1) * capacity * x_bytes


@pytest.mark.parametrize("ep_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_every_dispatcher_equals_local_and_accounts_for_every_token(ranks4, dispatcher, ep_size, data):
    case = data.draw(routing_cases(dispatcher, ep_size), label="case")
    event(f"skew {case['skew']}")
    event("some rank has no tokens" if 0 in case["tokens"][: case["ep_size"]] else "every rank has tokens")
    results = ranks4.run(_routing_case_rank, case)
    for r in results:
        assert r["shape"] == (r["tokens"], r["hidden"])
        assert r["err"] < FLOAT32_TOL, (r["err"], case)
    groups: dict[tuple, list] = {}
    for r in results:
        groups.setdefault(tuple(r["members"]), []).append(r)
    for _members, group_results in groups.items():
        _check_group(case, sorted(group_results, key=lambda r: r["group_rank"]))


# ---- hooks under fire ----------------------------------------------------------------------------------

ACTIONS = ("record", "raise", "remove_self", "remove_other", "identity", "register_new")
# Which hook events each stage of ``MoELayer.stages`` fires (a stage ends where the forward yields).
STAGE_EVENTS = (HOOK_EVENTS[:2], HOOK_EVENTS[2:5], HOOK_EVENTS[5:])


@dataclass
class _ModelHook:
    """A hook as the model sees it: its spec (with its id) and whether it is still registered."""

    spec: dict
    active: bool = True


def _model_run(specs: list[dict], num_forwards: int, tbo: bool) -> tuple[list, list, list[int]]:
    """What the registry must do: (calls, per-forward error, hooks left per micro-batch).

    ``calls`` lists ``(micro_batch, forward, hook_id)`` in call order per micro-batch; a forward's
    error is ``None``, ``("RuntimeError", hook_id)`` or ``("TypeError", hook_id)`` (an in-flight hook
    that returned a value). Micro-batches run the stages of two-batch overlap with delay 0:
    A0 B0 A1 B1 A2 B2; the first error ends both.
    """
    batches = (0, 1) if tbo else (0,)
    hooks = {mb: [_ModelHook(dict(spec, id=i)) for i, spec in enumerate(specs)] for mb in batches}
    lists = {mb: {e: [h for h in hooks[mb] if h.spec["event"] == e] for e in HOOK_EVENTS} for mb in batches}
    calls, errors = [], []
    for forward_no in range(num_forwards):
        error = None
        schedule = [(mb, stage) for stage in range(3) for mb in batches]
        for mb, stage in schedule:
            for hook_event in STAGE_EVENTS[stage]:
                for hook in list(lists[mb][hook_event]):  # a snapshot, as the registry iterates
                    if not hook.active:
                        continue
                    spec = hook.spec
                    if spec["once"]:
                        hook.active = False
                    calls.append((mb, forward_no, spec["id"]))
                    action = spec["action"]
                    if action == "raise":
                        error = ("RuntimeError", spec["id"])
                    elif action == "identity" and hook_event in IN_FLIGHT_EVENTS:
                        error = ("TypeError", spec["id"])
                    elif action == "remove_self":
                        hook.active = False
                    elif action == "remove_other" and spec["target"] < len(hooks[mb]):  # may be a new one
                        hooks[mb][spec["target"]].active = False
                    elif action == "register_new":
                        new = _ModelHook(
                            {"id": len(hooks[mb]), "event": spec["new_event"], "once": False, "action": "record"}
                        )
                        hooks[mb].append(new)
                        lists[mb][new.spec["event"]] = [*lists[mb][new.spec["event"]], new]
                    if error:
                        break
                if error:
                    break
            if error:
                break
        errors.append(error)
    return calls, errors, [sum(h.active for h in hooks[mb]) for mb in batches]


class PlantedHookError(RuntimeError):
    """What a ``raise`` hook raises (its message ends with the hook's id)."""


def _make_hook(log: list, handles: list, mb: int, spec: dict, hook_id: int, registry, forward_index: list):
    """A hook acting out ``spec``; it logs ``(micro_batch, forward_index[0], hook_id)`` when called."""

    def hook(dispatcher, payload):
        log.append((mb, forward_index[0], hook_id))
        action = spec["action"]
        if action == "raise":
            raise PlantedHookError(f"hook {hook_id}")
        if action == "remove_self":
            handles[hook_id].remove()
        elif action == "remove_other" and spec["target"] < len(handles):
            handles[spec["target"]].remove()
        elif action == "register_new":
            new_id = len(handles)
            new_spec = {"action": "record", "event": spec["new_event"], "once": False}
            handles.append(
                registry.register(
                    spec["new_event"], _make_hook(log, handles, mb, new_spec, new_id, registry, forward_index)
                )
            )
        elif action == "identity":
            return payload  # a replacement equal to the payload (refused at in-flight events)
        return None

    return hook


_LAYERS: dict[tuple, MoELayer] = {}


def forward(layer: MoELayer, x_TH: torch.Tensor, tbo: bool) -> torch.Tensor:
    """``layer(x_TH)``, or its two halves as the micro-batches of two-batch overlap (delay 0)."""
    if not tbo:
        return layer(x_TH)
    half = x_TH.shape[0] // 2
    out_a, out_b = run_interleaved(
        layer.stages(x_TH[:half], dispatcher=dispatcher_for(layer, 0)),
        layer.stages(x_TH[half:], dispatcher=dispatcher_for(layer, 1)),
        delay=0,
    )
    return torch.cat([out_a, out_b])


def _hooks_case_rank(device, case):
    key = (case["dispatcher"], case["overlap"])
    if key not in _LAYERS:  # kept between examples: a hook leaked by one example fails the next
        options = {"max_tokens_per_rank": 16} if case["dispatcher"] == "low_latency" else None
        _LAYERS[key] = MoELayer(
            get_preset("tiny"),
            dispatcher=case["dispatcher"],
            overlap=case["overlap"],
            dtype=torch.float32,
            seed=4,
            dispatcher_options=options,
        )
    layer = _LAYERS[key]
    batches = (0, 1) if case["tbo"] else (0,)
    registries = [dispatcher_for(layer, mb).hooks for mb in batches]
    leftover_before = [r.count() for r in registries]
    rank = dist.get_rank()
    x_TH = torch.randn(case["tokens"][rank], 64, generator=torch.Generator().manual_seed(case["seed"] + rank))
    log, forward_index, all_handles, results = [], [0], [], []
    with torch.inference_mode():
        reference = forward(layer, x_TH, case["tbo"])
        for mb, registry in zip(batches, registries):
            handles: list = []
            for hook_id, spec in enumerate(case["hooks"]):
                fn = _make_hook(log, handles, mb, spec, hook_id, registry, forward_index)
                handles.append(registry.register(spec["event"], fn, once=spec["once"]))
            all_handles.append(handles)
        for n in range(case["forwards"]):
            forward_index[0] = n
            try:
                y = forward(layer, x_TH, case["tbo"])
                results.append(("ok", torch.equal(y, reference)))
            except PlantedHookError as err:
                results.append(("RuntimeError", int(str(err).split()[-1])))
            except TypeError as err:
                results.append(("TypeError", str(err)))
    left = [r.count() for r in registries]
    for handles in all_handles:
        for handle in handles:
            handle.remove()
    return {
        "log": log,
        "results": results,
        "leftover_before": leftover_before,
        "left": left,
        "after_removal": [r.count() for r in registries],
    }


hook_specs = st.fixed_dictionaries(
    {
        "event": st.sampled_from(HOOK_EVENTS),
        "once": st.booleans(),
        "action": st.sampled_from(ACTIONS),
        "target": st.integers(0, 7),
        "new_event": st.sampled_from(HOOK_EVENTS),
    }
)
hook_cases = st.fixed_dictionaries(
    {
        "overlap": st.sampled_from(OVERLAP_MODES),
        "hooks": st.lists(hook_specs, max_size=8),
        "forwards": st.integers(1, 3),
        "tokens": st.lists(st.integers(0, 12), min_size=2, max_size=2),
        "seed": st.integers(0, 10_000),
    }
)


@pytest.mark.parametrize("tbo", [False, True], ids=["one_batch", "two_batch"])
@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_hooks_under_fire_run_as_registered_leak_nothing_and_change_nothing(ranks2, dispatcher, tbo, data):
    case = dict(data.draw(hook_cases, label="case"), dispatcher=dispatcher, tbo=tbo)
    calls, errors, active_left = _model_run(case["hooks"], case["forwards"], case["tbo"])
    event(f"{sum(e is not None for e in errors)} of {case['forwards']} forwards raise")
    event(f"overlap {case['overlap']}")
    for r in ranks2.run(_hooks_case_rank, case):
        assert r["leftover_before"] == [0] * len(r["left"]), "a previous forward left hooks behind"
        for mb in range(len(r["left"])):  # the order within each micro-batch's dispatcher
            assert [c for c in r["log"] if c[0] == mb] == [c for c in calls if c[0] == mb]
        assert len(r["results"]) == case["forwards"]
        for got, expected in zip(r["results"], errors):
            if expected is None:
                assert got == ("ok", True), "a forward whose hooks returned None changed the output"
            elif expected[0] == "RuntimeError":
                assert got == expected
            else:
                assert got[0] == "TypeError" and "hook must return None" in got[1]
        # Only the test's own hooks that should still be registered are: the strategies' are gone.
        assert r["left"] == active_left and r["after_removal"] == [0] * len(r["left"])

"""Single-batch overlap: every mode gives ``none``'s output bitwise on CPU, runs the shared experts
where it says, and leaves no hook behind."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch import DISPATCHERS
from moe_sbo.hooks import HOOK_EVENTS
from moe_sbo.layer import MoELayer
from moe_sbo.overlap import FIXED_MODES, OVERLAP_MODES, AutoOverlap, choices_from_rows, make_overlap
from moe_sbo.overlap.auto import bucket_of
from moe_sbo.overlap.sbo import OverlapContext
from moe_sbo.streams import side_stream

EP_DISPATCHERS = sorted(set(DISPATCHERS) - {"local"})

# Where each mode must run the shared experts, as positions in the hook-event log of one forward.
EXPECTED_SHARED_POSITION = {
    "none": ["post_combine", "shared"],
    "dispatch": ["dispatch_in_flight", "shared", "post_dispatch"],
    "combine": ["pre_combine", "shared", "combine_in_flight"],
    "combine_sm": ["combine_in_flight", "shared", "post_combine"],
    "split": [
        "dispatch_in_flight",
        "shared.up",
        "post_dispatch",
        "pre_combine",
        "combine_in_flight",
        "shared.down",
        "post_combine",
    ],
}


def _event_log(layer: MoELayer) -> list[str]:
    """Record hook events and shared-expert calls, in order (test hooks run before the strategy's)."""
    log: list[str] = []
    for event in HOOK_EVENTS:
        layer.dispatcher.hooks.register(event, lambda d, p, event=event: log.append(event))
    shared = layer.shared_experts
    up, down = shared.up_and_activate, shared.down
    shared.up_and_activate = lambda x: (log.append("shared.up"), up(x))[1]
    shared.down = lambda h: (log.append("shared.down"), down(h))[1]
    return log


def _collapse(log: list[str]) -> list[str]:
    """``shared.up, shared.down`` back to back is one ``shared`` call."""
    out: list[str] = []
    for item in log:
        if item == "shared.down" and out and out[-1] == "shared.up":
            out[-1] = "shared"
        else:
            out.append(item)
    return out


def _modes_rank(device, dispatcher, preset, tokens_per_rank):
    cfg = get_preset(preset)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(tokens_per_rank[rank], cfg.hidden_size, generator=generator)
    results = {}
    with torch.no_grad():
        reference = MoELayer(cfg, dispatcher="local", dtype=torch.float32, seed=5)(x)
        for mode in FIXED_MODES:
            layer = MoELayer(cfg, dispatcher=dispatcher, dtype=torch.float32, seed=5, overlap=mode)
            hooks_before = layer.dispatcher.hooks.count()
            first, second = layer(x), layer(x)  # twice: once-hooks must come back for the next forward
            results[mode] = {
                "y": first,
                "repeat_equal": torch.equal(first, second),
                "leaked": layer.dispatcher.hooks.count() - hooks_before,
                "rel_err": ((first - reference).norm() / reference.norm().clamp_min(1e-30)).item(),
            }
    return results


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@pytest.mark.parametrize("preset, tokens", [("tiny", [9, 0, 17, 4]), ("tiny", [0, 0, 0, 0])])
def test_every_mode_equals_none_bitwise_on_cpu(ranks4, dispatcher, preset, tokens):
    for rank_results in ranks4.run(_modes_rank, dispatcher, preset, tokens):
        none_y = rank_results["none"]["y"]
        for mode, r in rank_results.items():
            assert torch.equal(r["y"], none_y), f"{mode} differs from none"
            assert r["repeat_equal"] and r["leaked"] == 0
            assert r["rel_err"] <= 1e-5


def test_every_mode_on_two_ranks_and_local(ranks2):
    for rank_results in ranks2.run(_modes_rank, "alltoall", "tiny", [5, 12]):
        assert all(torch.equal(r["y"], rank_results["none"]["y"]) for r in rank_results.values())
    x = torch.randn(11, 64)
    with torch.no_grad():
        outputs = [MoELayer(get_preset("tiny"), dtype=torch.float32, overlap=m)(x) for m in OVERLAP_MODES]
    assert all(torch.equal(y, outputs[0]) for y in outputs)


@pytest.mark.parametrize("mode", FIXED_MODES)
def test_shared_experts_run_where_the_mode_says(mode):
    layer = MoELayer(get_preset("tiny"), dtype=torch.float32, overlap=mode)
    log = _event_log(layer)
    with torch.no_grad():
        layer(torch.randn(6, 64))
    expected = EXPECTED_SHARED_POSITION[mode]
    flat = log if mode == "split" else _collapse(log)
    start = flat.index(expected[0]) if mode != "none" else flat.index("post_combine")
    assert flat[start : start + len(expected)] == expected, flat
    assert flat.count("shared") + flat.count("shared.up") == 1


def _raise(dispatcher, payload):
    raise RuntimeError("boom in post_dispatch")


@pytest.mark.parametrize("mode", OVERLAP_MODES)
def test_no_hook_survives_a_raising_forward(mode):
    layer = MoELayer(get_preset("tiny"), dtype=torch.float32, overlap=mode)
    handle = layer.dispatcher.hooks.register("post_dispatch", _raise)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        layer(torch.randn(5, 64))
    assert layer.dispatcher.hooks.count() == 1  # only the test's own hook
    handle.remove()
    with torch.no_grad():
        y = layer(torch.randn(5, 64))
    assert y.shape == (5, 64) and layer.dispatcher.hooks.count() == 0


def test_model_without_shared_experts():
    cfg = get_preset("tiny").replace(num_shared_experts=0)
    x = torch.randn(7, 64)
    with torch.no_grad():
        ys = [MoELayer(cfg, dtype=torch.float32, overlap=m)(x) for m in OVERLAP_MODES]
    assert all(torch.equal(y, ys[0]) for y in ys)


def test_unknown_mode_lists_the_modes():
    with pytest.raises(ValueError, match=r"overlap must be one of \('none', 'dispatch'.*'auto'\), got 'both'"):
        MoELayer(get_preset("tiny"), overlap="both")


def test_cpu_says_once_when_a_mode_is_sequential(caplog):
    from moe_sbo.overlap import sbo

    sbo._said.clear()
    with caplog.at_level(logging.WARNING, logger="moe_sbo.overlap"):
        make_overlap("combine", "cpu")
        make_overlap("combine", "cpu")
        make_overlap("combine_sm", "cpu", sm_budget=10)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("overlap combine on cpu" in m for m in messages) == 1
    assert sum("SM budget is ignored on CPU" in m for m in messages) == 1


def test_auto_times_every_candidate_then_keeps_the_fastest():
    layer = MoELayer(get_preset("tiny"), dtype=torch.float32, overlap="auto")
    auto = layer.overlap
    assert isinstance(auto, AutoOverlap)
    x = torch.randn(6, 64)
    with torch.no_grad():
        reference = MoELayer(get_preset("tiny"), dtype=torch.float32)(x)
        rounds = len(auto.candidates) * (auto.warmup + auto.trials) + 1
        for _ in range(rounds):
            assert torch.equal(layer(x), reference)
    bucket = bucket_of(6)
    assert set(auto.timings_us[bucket]) == set(FIXED_MODES)
    assert all(len(v) == auto.trials for v in auto.timings_us[bucket].values())
    chosen = auto.choices[bucket]
    medians = {m: sorted(v)[1] for m, v in auto.timings_us[bucket].items()}
    assert medians[chosen] == min(medians.values()) <= medians["none"]
    assert layer.dispatcher.hooks.count() == 0


def test_auto_decision_never_slower_than_none_with_given_timings():
    ctx = OverlapContext(torch.device("cpu"), side_stream(torch.device("cpu")), None)
    auto = AutoOverlap(ctx, candidates=("dispatch", "split"), trials=3)
    assert auto.candidates[0] == "none"  # none is always a candidate
    for mode, times in {"none": [10, 11, 12], "dispatch": [9, 30, 30], "split": [8, 11.5, 40]}.items():
        for t in times:
            auto._open[8] = (mode, 0.0, t * 1e-6)
            auto._close(8)
    assert auto.choices[8] == "none"  # medians: none 11, dispatch 30, split 11.5


def _slowest_rank_rank(device):
    from moe_sbo.dispatch import EPGroup
    from moe_sbo.overlap.auto import slowest_rank

    mine = [[10.0, 30.0, 20.0], [12.0, 15.0, 25.0]][dist.get_rank()]
    return slowest_rank(mine, EPGroup.from_torch(), device)


def test_auto_strategies_compare_each_candidate_on_its_slowest_rank(ranks2):
    from moe_sbo.dispatch import EPGroup
    from moe_sbo.overlap.auto import slowest_rank

    assert ranks2.run(_slowest_rank_rank) == [[12.0, 30.0, 25.0]] * 2
    assert slowest_rank([3.0, 1.0], EPGroup(), torch.device("cpu")) == [3.0, 1.0]  # one rank: as they are


def test_a_mode_chosen_for_graphs_is_kept_apart_from_the_eager_one(monkeypatch):
    """While ``choose_for_graphs`` times a candidate, every forward runs that candidate (its capture's
    warm-up ones too, which would otherwise explore); eager forwards keep the eager choice. There are
    no graphs on CPU, so it refuses there."""
    from moe_sbo.overlap import sbo

    ran = []
    monkeypatch.setattr(sbo, "ATTACH", {m: (lambda *a, m=m: ran.append(m)) for m in FIXED_MODES})
    layer = MoELayer(get_preset("tiny"), dtype=torch.float32, overlap="auto")
    auto = layer.overlap
    assert isinstance(auto, AutoOverlap)
    x = torch.randn(6, 64)
    auto.choices[bucket_of(6)], auto.graph_choices[bucket_of(6)] = "dispatch", "split"
    auto._forced = "combine_sm"
    auto.attach(None, layer.shared_experts, x)
    auto._forced = None
    auto.attach(None, layer.shared_experts, x)
    assert ran == ["combine_sm", "dispatch"]  # eager: the eager choice, not the graphs'
    assert auto.timings_us == {}  # nothing explored
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        auto.choose_for_graphs(lambda: layer(x), 6, layer.dispatcher.ep)


def test_choices_from_benchmark_rows():
    rows = [
        {"tokens_per_rank": 128, "overlap": "none", "t_layer_us": 100.0},
        {"tokens_per_rank": 128, "overlap": "dispatch", "t_layer_us": 90.0},
        {"tokens_per_rank": 4096, "overlap": "combine_sm", "t_layer_us": 700.0},
        {"tokens_per_rank": 4096, "overlap": "none", "t_layer_us": 900.0},
        {"tokens_per_rank": 4096, "overlap": "auto", "t_layer_us": 1.0},
    ]
    assert choices_from_rows(rows) == {128: "dispatch", 4096: "combine_sm"}
    rows.append({"tokens_per_rank": 128, "overlap": "split", "t_layer_us": 50.0, "dispatcher": "allgather"})
    assert choices_from_rows(rows)[128] == "split"
    assert choices_from_rows(rows, dispatcher="allgather") == {128: "split"}
    assert [bucket_of(n) for n in (0, 1, 2, 3, 128, 129)] == [1, 1, 2, 4, 128, 256]

"""The node-aware byte model: crossings per token flat vs node-aware under DeepSeek-V3's group limit,
checked against the router's own routing and the definition of each count."""

from __future__ import annotations

import json

import pytest

from moe_sbo.config import get_preset
from moe_sbo.planner.bytes import expected_fanout, simulate_fanout
from moe_sbo.planner.inputs import get_hardware
from moe_sbo.planner.links import datasheet_link
from moe_sbo.planner.nodes import compare, crossings

V3 = get_preset("deepseek-v3")


@pytest.mark.parametrize("ep", [16, 32, 64])
def test_node_limited_routing_crosses_to_at_most_four_nodes_up_to_eight_nodes(ep):
    """8 groups over 2, 4 or 8 nodes: each node holds whole groups, a token keeps 4 groups."""
    c = crossings(V3, ep)
    assert c.max_nodes == min(4, c.num_nodes) and c.expected_nodes <= c.max_nodes
    assert c.node_aware_internode < c.flat_internode


def test_sixteen_nodes_split_groups_so_a_token_may_reach_eight():
    assert crossings(V3, 128).max_nodes == 8


def test_two_nodes_of_eight_cross_about_three_times_less():
    c = crossings(V3, 16)
    # Flat: every rank of the other node hit crosses; node-aware: once if the other node is hit.
    assert c.flat_internode == pytest.approx(c.expected_ranks * 8 / 16)
    assert c.node_aware_internode == pytest.approx(c.expected_nodes / 2)
    assert 2.0 < c.internode_ratio < 3.5


@pytest.mark.parametrize("ep", [16, 32])
def test_flat_split_agrees_with_the_fanout_model(ep):
    c, f = crossings(V3, ep), expected_fanout(V3, ep, 8)
    assert c.flat_internode == pytest.approx(f.expected_internode_ranks)
    assert c.flat_intranode == pytest.approx(f.expected_intranode_ranks)


def test_expected_nodes_is_near_the_routers_own():
    """The uniform model against the project's router on i.i.d. logits (it keeps groups by their best
    experts, so it spreads a little more): within 10 % at 4 nodes."""
    c = crossings(V3, 32)
    assert simulate_fanout(V3, 4, num_tokens=4000) == pytest.approx(c.expected_nodes, rel=0.1)


def test_node_aware_is_faster_where_the_nic_is_the_bottleneck():
    link = datasheet_link(get_hardware("h800"))
    rows = compare(V3, (16, 32), 4096, link)
    for row in rows:
        assert row.node_aware_us < row.flat_us
        assert row.dispatch.node_aware_pipelined_us <= row.dispatch.node_aware_us


def test_ep_not_whole_nodes_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiple of 8"):
        crossings(V3, 12)


def test_plan_prints_flat_against_node_aware_and_writes_it(tmp_path, capsys):
    from moe_sbo.cli.plan import main as plan_main

    out = tmp_path / "plan.json"
    assert plan_main(["--node-aware-ep", "16", "32", "--batch", "4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Flat vs node-aware dispatch, deepseek-v3, 4096 tokens per GPU" in text
    assert "NVLink 160 GB/s, NIC 50 GB/s per GPU" in text  # the H800 pair, the inputs named
    rows = json.loads(out.read_text())["node_aware"]
    assert [r["crossings"]["ep"] for r in rows] == [16, 32]
    assert all(r["node_aware_us"] < r["flat_us"] for r in rows)


def test_plan_refuses_node_aware_sizes_that_are_not_whole_nodes(capsys):
    from moe_sbo.cli.plan import main as plan_main

    assert plan_main(["--node-aware-ep", "8", "12"]) == 2
    err = capsys.readouterr().err
    assert "--node-aware-ep must be EP sizes of two or more whole nodes of 8 GPUs (h800)" in err
    assert "got [8, 12]" in err


def test_node_verdicts_judge_the_faster_dispatch_by_the_plans_windows():
    """Each EP size: the faster of flat and node-aware, by how much, and whether its slower phase
    fits the serial window (TPOT/layers - T - t) / 2 of the batch and TBO's (T - t) / 2 of a
    micro-batch, recomputed here from the node table."""
    from moe_sbo import planner

    inp = planner.PlanInputs(model=V3, batch=128, tpot_ms=40)
    plan = planner.make_plan(inp)
    link = datasheet_link(get_hardware(inp.hw))
    verdicts = planner.node_verdicts(plan, link, (16, 32))
    serial_window = (40_000 / plan.bytes.layers - inp.attn_us - inp.moe_us) / 2
    tbo_window = (inp.attn_us - inp.moe_us) / 2
    for v, row, micro in zip(verdicts, compare(V3, (16, 32), 128, link), compare(V3, (16, 32), 64, link)):
        assert v.faster == "node-aware" and v.speedup == pytest.approx(row.flat_us / row.node_aware_us)
        slower = max(row.dispatch.node_aware_pipelined_us, row.combine.node_aware_pipelined_us)
        assert v.serial_fits == (slower <= serial_window)
        micro_slower = max(micro.dispatch.node_aware_pipelined_us, micro.combine.node_aware_pipelined_us)
        assert v.tbo_fits == (micro_slower <= tbo_window)
    line = planner.node_verdict_line(plan, verdicts)
    assert line.startswith("verdict across nodes: node-aware ") and "faster at every EP size" in line
    at_20_ms = planner.make_plan(planner.PlanInputs(model=V3, batch=128))  # compute alone exceeds 20 ms
    assert planner.node_verdict_line(at_20_ms, verdicts).endswith("; compute alone exceeds the TPOT")

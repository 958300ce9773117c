"""The planner's expert load balance (``planner.balance``): per EP size and redundant count, each
policy's max/mean rank load and the predicted gain, cells that cannot be placed left empty with the
reason, and sizes that cannot be refused with the fix."""

from __future__ import annotations

import pytest

from moe_sbo.config import get_preset
from moe_sbo.eplb import zipf_load
from moe_sbo.planner import load_balance, nodes_for


def test_deepseek_v3_zipf_load_per_ep_size():
    cfg = get_preset("deepseek-v3")
    balance = load_balance(cfg, zipf_load(256, 1.0, seed=0).tolist(), "zipf:1")
    assert [(r.ep, r.redundant_per_rank) for r in balance.rows] == [(ep, n) for ep in (8, 32, 64) for n in (0, 1, 2)]
    assert balance.expert_max_over_mean == pytest.approx(256 / sum(k**-1.0 for k in range(1, 257)))
    for row in balance.rows:
        assert row.num_nodes == nodes_for(row.ep) == max(1, row.ep // 8 if row.ep >= 16 else 1)
        assert row.global_ is not None and row.hierarchical is not None
        assert 1.0 <= row.global_ <= row.trivial + 1e-12 and row.hierarchical >= 1.0
        assert row.gain_global == pytest.approx(row.trivial / row.global_)
        assert row.gain_hierarchical == pytest.approx(row.trivial / row.hierarchical)
        if row.ep == 8:  # one node: hierarchical is global
            assert row.hierarchical == row.global_
    by = {(r.ep, r.redundant_per_rank): r for r in balance.rows}
    # Trivial is the layout without replicas: one value per EP size, growing with it (fewer experts a rank).
    assert len({r.trivial for r in balance.rows if r.ep == 32}) == 1
    assert by[8, 0].trivial < by[32, 0].trivial < by[64, 0].trivial
    # One replica per rank lets global split the hottest experts: near-perfect balance.
    assert by[64, 1].global_ < 1.01 < by[64, 0].global_


def test_an_even_load_is_balanced_everywhere():
    balance = load_balance(get_preset("deepseek-v3"), [3.0] * 256, "zipf:0")
    assert all(r.trivial == r.global_ == r.hierarchical == 1.0 for r in balance.rows)
    assert balance.notes == []


def test_cells_that_cannot_be_placed_are_empty_with_the_reason():
    """EP128 spans 16 nodes but DeepSeek-V3 has 8 expert groups; Qwen3 has none to put on 4 nodes."""
    v3 = load_balance(get_preset("deepseek-v3"), zipf_load(256, 1.0).tolist(), "zipf:1", ep_sizes=[128])
    assert all(r.hierarchical is None and r.gain_hierarchical is None and r.global_ for r in v3.rows)
    assert v3.notes == [
        "EP128 +0, EP128 +1, EP128 +2: num_groups=8 is not a multiple of num_nodes=16: hierarchical placement "
        "gives every node whole groups, the same number each; use global_placement (policy 'global'), or a "
        "num_nodes that divides num_groups"
    ]
    qwen = load_balance(get_preset("qwen3-30b-a3b"), zipf_load(128, 1.0).tolist(), "zipf:1", ep_sizes=[8, 32])
    assert [r.hierarchical is None for r in qwen.rows] == [False] * 3 + [True] * 3


@pytest.mark.parametrize(
    "ep_sizes, redundant, message",
    [
        ([6], (0,), "--eplb-ep must be EP sizes that divide the 256 routed experts of deepseek-v3, got [6]; choose"),
        ([8], (-1,), "--redundant must be counts >= 0"),
    ],
)
def test_bad_sizes_are_refused(ep_sizes, redundant, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_balance(get_preset("deepseek-v3"), [1.0] * 256, "x", ep_sizes, redundant)


def test_a_load_of_another_expert_count_is_refused():
    with pytest.raises(ValueError, match=r"one entry per expert of deepseek-v3 \(256\), got 16"):
        load_balance(get_preset("deepseek-v3"), [1.0] * 16, "tiny.json")

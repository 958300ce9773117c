"""``low_latency``'s packed per-expert rows (``dispatch/low_latency/packed.py``): the fused kernel
(Triton's interpreter on CPU) and the torch path against a layout built here from the ids, and a
combine read from the packed outputs against the dispatcher's own combine of the grouped ones; what
DeepEP's API needs besides: ``combine_wait(out=)`` and weights given after dispatch
(``set_combine_weights``).

One rank, no process group: slot s is token s, so expert l's packed rows are the tokens that chose
it, in token order. Tolerances: the rows move as bytes (exact); combine sums the same products in
float32 in the same order on both sides (exact).
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_sbo.dispatch import EPGroup
from moe_sbo.dispatch.low_latency import LowLatencyDispatcher
from moe_sbo.dispatch.low_latency.packed import combine_input, pack_rows, rows_per_source

NUM_EXPERTS, TOKENS, HIDDEN, TOP_K = 6, 9, 256, 3
PATHS = [
    pytest.param({"kernels": "torch"}, id="torch"),
    pytest.param(
        {"kernels": "triton", "index_graphs": False},
        id="fused",
        marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
    ),
    pytest.param(
        {"kernels": "triton", "index_graphs": False, "index_rows": True},
        id="fused-in-place",
        marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
    ),
]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    ids[4, 1] = -1  # "no expert"
    weights = torch.rand(TOKENS, TOP_K, generator=g)
    return x, ids, weights


@pytest.mark.parametrize("options", PATHS)
def test_packed_rows_and_their_combine(options):
    x, ids, weights = _inputs(0)
    rows_per_expert = TOKENS  # N = P * C at one rank
    d = LowLatencyDispatcher(NUM_EXPERTS, EPGroup(), max_tokens_per_rank=TOKENS, **options)
    with torch.inference_mode():
        out = d.dispatch(x, ids, weights)
        x_NH = torch.full((NUM_EXPERTS * rows_per_expert + 1, HIDDEN), float("nan"), dtype=torch.bfloat16)
        count_L = torch.zeros(NUM_EXPERTS, dtype=torch.int32)
        packed = pack_rows(out, rows_per_expert, x_NH, None, count_L)
        for expert in range(NUM_EXPERTS):
            tokens = (ids == expert).any(dim=1).nonzero().flatten()
            assert int(count_L[expert]) == tokens.numel()
            assert torch.equal(x_NH[expert * rows_per_expert :][: tokens.numel()], x[tokens])
        assert torch.equal(rows_per_source(packed, TOKENS, 1).flatten(), count_L.long())
        # "Experts": row j of expert l times (l + 1); padding rows stay NaN, so reading one shows.
        scale_N = torch.arange(NUM_EXPERTS).repeat_interleave(rows_per_expert).add(1).float()[:, None]
        y_NH = (x_NH[:-1].float() * scale_N).bfloat16()
        y_TH = d.combine(*combine_input(packed, y_NH))
        grouped_R = torch.searchsorted(
            out.num_rows_per_expert_L.cumsum(0), torch.arange(out.handle.layout.row_R.shape[0]), right=True
        )
        y_RH = (out.rows_RH().float() * (grouped_R.clamp(max=NUM_EXPERTS - 1) + 1)[:, None]).bfloat16()
        out_again = d.dispatch(x, ids, weights)
        expected = d.combine(y_RH, out_again.handle)
    assert torch.equal(y_TH, expected)


@pytest.mark.parametrize("options", PATHS)
def test_an_expert_named_twice_past_its_rows_raises(options):
    x, ids, weights = _inputs(1)
    ids[:, 0] = ids[:, 1] = 2  # every token names expert 2 twice: 2 T rows for T packed ones
    d = LowLatencyDispatcher(NUM_EXPERTS, EPGroup(), max_tokens_per_rank=TOKENS, **options)
    with torch.inference_mode():
        out = d.dispatch(x, ids, weights)
        x_NH = torch.zeros(NUM_EXPERTS * TOKENS + 1, HIDDEN, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="named one expert twice"):
            pack_rows(out, TOKENS, x_NH, None, torch.zeros(NUM_EXPERTS, dtype=torch.int32))


@pytest.mark.parametrize("options", PATHS)
def test_combine_wait_writes_into_out(options):
    """``combine_wait(pending, out=)`` gives the same bits as without, in the caller's tensor."""
    x, ids, weights = _inputs(2)
    d = LowLatencyDispatcher(NUM_EXPERTS, EPGroup(), max_tokens_per_rank=TOKENS, **options)
    with torch.inference_mode():
        out = d.dispatch(x, ids, weights)
        expected = d.combine(out.rows_RH(), out.handle)
        again = d.dispatch(x, ids, weights)
        y_TH = torch.full_like(x, float("nan"))
        assert d.combine_wait(d.combine_launch(again.rows_RH(), again.handle), out=y_TH) is y_TH
        assert torch.equal(y_TH, expected)
        with pytest.raises(ValueError, match="out must be a contiguous"):
            d.combine_wait(d.combine_launch(again.rows_RH(), again.handle), out=y_TH.float())


def test_combine_wait_copies_into_out_for_other_schemes():
    from moe_sbo.dispatch import make_dispatcher

    x, _, weights = _inputs(3)
    ids = torch.stack([torch.randperm(NUM_EXPERTS)[:TOP_K] for _ in range(TOKENS)])
    d = make_dispatcher("local", NUM_EXPERTS, EPGroup())
    with torch.inference_mode():
        out = d.dispatch(x, ids, weights)
        y_RH = out.rows_RH() * 2
        expected = d.combine(y_RH, out.handle)
        y_TH = torch.empty_like(x)
        assert torch.equal(d.combine_wait(d.combine_launch(y_RH, out.handle), out=y_TH), expected)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("index_graphs", [False, True], ids=["fused", "replayed"])
def test_combine_weights_given_after_dispatch_are_the_dispatched_ones(index_graphs):
    """Dispatch with weight 1 everywhere, then ``set_combine_weights``: the same bits as dispatching
    with those weights (the experts' rank reads them from the rows either way)."""
    x, ids, weights = _inputs(4)
    d = LowLatencyDispatcher(
        NUM_EXPERTS, EPGroup(), max_tokens_per_rank=TOKENS, kernels="triton", index_graphs=index_graphs
    )
    assert d.can_set_combine_weights(x.device)
    with torch.inference_mode():
        out = d.dispatch(x, ids, weights)
        expected = d.combine(out.rows_RH() * 3, out.handle)
        late = d.dispatch(x, ids, torch.ones_like(weights))
        d.set_combine_weights(late.handle, weights)
        assert torch.equal(d.combine(late.rows_RH() * 3, late.handle), expected)
        with pytest.raises(ValueError, match="weights must be float32"):
            d.set_combine_weights(late.handle, weights.double())


def test_combine_weights_after_dispatch_need_the_rows_in_place():
    x, ids, weights = _inputs(5)
    d = LowLatencyDispatcher(NUM_EXPERTS, EPGroup(), max_tokens_per_rank=TOKENS, kernels="torch")
    assert not d.can_set_combine_weights(x.device)
    with torch.inference_mode():
        out = d.dispatch(x, ids, weights)
        with pytest.raises(ValueError, match="pass the weights to dispatch instead"):
            d.set_combine_weights(out.handle, weights)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_fp8_rows_in_place_pack_as_the_gathered_ones():
    """fp8 rows delivered as fp8 stay in the receive buffer with ``index_rows`` (values and scales,
    strided views): packed, they are the bytes and scales the gathered rows give, and the torch
    path's scales (the interpreter's fp8 conversion differs from torch's, so its values are not)."""
    x, ids, weights = _inputs(6)
    packed = {}
    for name, options in {
        "torch": {"kernels": "torch"},
        "gathered": {"kernels": "triton", "index_graphs": False},
        "in place": {"kernels": "triton", "index_graphs": False, "index_rows": True},
        "in place, replayed": {"kernels": "triton", "index_rows": True},
    }.items():
        d = LowLatencyDispatcher(NUM_EXPERTS, EPGroup(), max_tokens_per_rank=TOKENS, fp8=True, **options)
        d.deliver_fp8 = True
        with torch.inference_mode():
            out = d.dispatch(x, ids, weights)
            assert (out.expert_rows_R is not None) == ("in place" in name)
            x_NH = torch.zeros(NUM_EXPERTS * TOKENS + 1, HIDDEN, dtype=torch.float8_e4m3fn)
            scales_NQ = torch.zeros(NUM_EXPERTS * TOKENS + 1, HIDDEN // 128)
            count_L = torch.zeros(NUM_EXPERTS, dtype=torch.int32)
            pack_rows(out, TOKENS, x_NH, scales_NQ, count_L)
        packed[name] = (x_NH.view(torch.uint8), scales_NQ, count_L)
    for name in ("in place", "in place, replayed"):
        assert all(torch.equal(a, b) for a, b in zip(packed[name], packed["gathered"])), name
    assert torch.equal(packed["torch"][1], packed["gathered"][1]) and torch.equal(
        packed["torch"][2], packed["gathered"][2]
    )

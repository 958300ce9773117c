"""Bad input gets a clear error naming the problem and the fix, before any collective starts."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch import EPGroup, make_dispatcher
from moe_sbo.dispatch.base import MAX_SIGNATURES_KEPT
from moe_sbo.layer import MoELayer


def _layer(**kw):
    return MoELayer(get_preset("tiny"), dtype=torch.float32, **kw)


@pytest.mark.parametrize(
    "x, error, message",
    [
        (torch.randn(4, 32), ValueError, r"x must be \[T, 64\]"),
        (torch.randn(2, 4, 64), ValueError, r"x must be \[T, 64\]"),
        (torch.randn(4, 64, dtype=torch.float64), TypeError, "x must have the layer's dtype"),
        ([[0.0] * 64], TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_activations(x, error, message):
    with pytest.raises(error, match=message):
        _layer()(x)


def test_bad_dispatch_arguments():
    d = make_dispatcher("local", 16, EPGroup())
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 16\)"):
        d.dispatch(x, torch.tensor([[0, 16]] * 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match="topk_ids must be"):
        d.dispatch(x, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        d.dispatch(x, torch.zeros(3, 2), torch.ones(3, 2))
    with pytest.raises(ValueError, match="topk_weights must have the shape"):
        d.dispatch(x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 3))
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        make_dispatcher("deepep", 16, EPGroup())


def test_an_input_seen_before_still_has_its_ids_and_every_new_signature_checked():
    """The structural checks are remembered per signature (shapes, dtypes, devices, grad mode); the
    ids' values are checked on every call, and anything new about an input is checked again."""
    d = make_dispatcher("local", 16, EPGroup())
    x, ids, weights = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    d.dispatch(x, ids, weights)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 16\)"):
        d.dispatch(x, torch.tensor([[0, 16]] * 3), weights)  # the signature seen, bad values
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        d.dispatch(x, ids.float(), weights)
    with pytest.raises(ValueError, match="topk_weights must have the shape"):
        d.dispatch(x, ids, torch.ones(3, 3))
    for tokens in range(1, MAX_SIGNATURES_KEPT + 8):  # prefill: a new T each forward
        d.dispatch(torch.randn(tokens, 64), torch.zeros(tokens, 2, dtype=torch.long), torch.ones(tokens, 2))
    assert 0 < len(d._signatures_checked) <= MAX_SIGNATURES_KEPT

    ll = make_dispatcher("low_latency", 16, EPGroup(), max_tokens_per_rank=4, kernels="torch")
    with torch.no_grad():
        ll.dispatch(x, ids, weights)
    with pytest.raises(RuntimeError, match="low_latency is inference-only"):
        ll.dispatch(x, ids, weights)  # the same tensors with autograd on: a new signature
    with torch.no_grad(), pytest.raises(ValueError, match="max_tokens_per_rank = 4"):
        ll.dispatch(torch.randn(5, 64), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))


def test_nan_is_carried_through_not_a_crash():
    layer = _layer()
    x = torch.randn(6, 64)
    x[2, 5] = float("nan")
    with torch.no_grad():
        y = layer(x)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4, 5]]).all()


def test_top_k_larger_than_experts_and_bad_groups():
    with pytest.raises(ValueError, match="top-k"):
        get_preset("tiny").replace(num_experts_per_tok=32)
    with pytest.raises(ValueError, match="n_group must divide num_experts"):
        get_preset("tiny").replace(n_group=5)


def test_group_without_distributed_is_an_error():
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        EPGroup.from_torch(group=object())


def _bad_ep_size_rank(device):
    try:
        MoELayer(
            get_preset("tiny").replace(num_experts=18, n_group=3, topk_group=2),
            dispatcher="alltoall",
            dtype=torch.float32,
        )
    except ValueError as err:
        dist.barrier()  # all ranks got here: nobody was left waiting inside a collective
        return str(err)
    return "no error"


def test_experts_not_divisible_by_ep_size_fail_on_every_rank(ranks4):
    for message in ranks4.run(_bad_ep_size_rank):
        assert "divisible by the EP size, got 18 experts on 4 ranks" in message


def _wrong_device_rank(device):
    layer = MoELayer(get_preset("tiny"), dispatcher="alltoall", dtype=torch.float32)
    try:
        layer(torch.randn(3, 64, dtype=torch.bfloat16))
    except TypeError as err:
        dist.barrier()
        return str(err)
    return "no error"


def test_wrong_dtype_fails_before_any_collective(ranks2):
    for message in ranks2.run(_wrong_device_rank):
        assert "x must have the layer's dtype torch.float32, got torch.bfloat16" in message


def _bad_ids_on_one_rank(device, dispatcher, bad_rank, options=None):
    """Rank ``bad_rank`` passes an out-of-range expert id; the others pass good input."""
    rank = dist.get_rank()
    layer = MoELayer(get_preset("tiny"), dispatcher=dispatcher, dtype=torch.float32, dispatcher_options=options)
    x = torch.randn(5, 64)
    ids = torch.randint(0, 16, (5, 4))
    if rank == bad_rank:
        ids[2, 1] = 99
    started = time.perf_counter()
    try:
        layer.dispatcher.dispatch(x, ids, torch.full((5, 4), 0.25))
        outcome = "no error"
    except ValueError as err:
        outcome = str(err)
    waited = time.perf_counter() - started
    dist.barrier()  # every rank got here: nobody was left inside a collective
    with torch.no_grad():
        layer(x)  # and the group still works: the next forward runs
    return outcome, waited


@pytest.mark.parametrize(
    "dispatcher, options",
    [("allgather", None), ("alltoall", None), ("node_aware", {"ranks_per_node": 2})],  # rank 2: the other node
)
def test_bad_input_on_one_rank_ends_the_forward_on_every_rank(ranks4, dispatcher, options):
    """The count exchange carries a "rejected" sentinel: the others raise at once, no extra collective
    (node_aware's first one spans the whole group, so a rank on another rail and node learns of it too)."""
    results = ranks4.run(_bad_ids_on_one_rank, dispatcher, 2, options)
    assert "topk_ids must lie in [0, 16), got values in [" in results[2][0] and ", 99]" in results[2][0]
    for rank in (0, 1, 3):
        message, waited = results[rank]
        assert "rank(s) [2] rejected their dispatch input" in message
        assert waited < 5.0  # not the collective timeout

"""``low_latency/addresses.py``: the table through which ``low_latency``'s replayed graphs read the caller's
tensors (host writes, the fetch kernel's copy and echo, offsets from the anchor), and the staging
kernel, by hand on CPU under Triton's interpreter. (The graphs using them are checked against direct
launches in ``tests/dispatch/test_low_latency.py``, and on GPU, the host running far ahead of the device
included, in ``tests/dispatch/test_gpu_low_latency.py``.)"""

from __future__ import annotations

import os

import pytest
import torch

from moe_sbo.dispatch.low_latency.addresses import CallerAddresses, aligned, fetch_words, stage_inputs
from moe_sbo.dispatch.low_latency.graphs import Staging

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels run in Triton's CPU interpreter here"
)


def _anchor() -> torch.Tensor:
    return torch.zeros(64, dtype=torch.uint8)


def test_fetch_copies_the_values_written_and_echoes_the_write():
    anchor = _anchor()
    table = CallerAddresses(anchor, 3)
    for seq, values in enumerate([(5, -7, 2**40), (9, 0, -(2**40)), (1,)], start=1):
        table.write(*values)
        assert table.host[3].item() == seq  # the write's sequence number
        assert table.host[4].item() == seq - 1  # not fetched yet
        table.fetch()
        assert table.host[4].item() == seq  # fetched: the host may write again
    # The last write set one value; the others keep the previous write's.
    assert table.table.tolist() == [1, 0, -(2**40)]


def test_offsets_lead_from_the_anchor_to_the_tensor():
    anchor = _anchor()
    table = CallerAddresses(anchor, 1)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert table.offset_of(x) * 16 == x.data_ptr() - anchor.data_ptr()
    assert table.offset_of(x[1:]) - table.offset_of(x) == 1  # a row of 16 bytes further on
    assert table.offset_of(torch.empty(0, 4)) == 0  # nothing read or written through it
    with pytest.raises(ValueError, match="is not 16-byte aligned"):
        table.offset_of(x.view(-1)[1:])


def test_anchor_and_alignment_rules():
    with pytest.raises(ValueError, match="16-byte aligned uint8"):
        CallerAddresses(torch.zeros(4, dtype=torch.float32), 1)
    with pytest.raises(ValueError, match="16-byte aligned uint8"):
        CallerAddresses(_anchor()[1:], 1)
    x = torch.zeros(4, 8)
    assert aligned(x, torch.float32)
    assert not aligned(x, torch.float64)  # another dtype
    assert not aligned(x.t(), torch.float32)  # strided
    assert not aligned(x.view(-1)[1:], torch.float32)  # 4 bytes past an alignment


def test_offset_in_place_is_the_offset_exactly_where_the_graphs_can_read_the_tensor():
    anchor = _anchor()
    table = CallerAddresses(anchor, 1)
    x = torch.zeros(4, 8)
    assert table.offset_in_place(x, torch.float32) == table.offset_of(x)
    assert table.offset_in_place(torch.empty(0, 8), torch.float32) == 0  # nothing read through it
    for tensor, dtype in ((x, torch.float64), (x.t(), torch.float32), (x.view(-1)[1:], torch.float32)):
        assert aligned(tensor, dtype) is False
        assert table.offset_in_place(tensor, dtype) is None  # another dtype, strided, misaligned


def test_pack_values_read_the_callers_tensors_or_converted_copies():
    anchor = _anchor()
    table = CallerAddresses(anchor, 4)
    staging = Staging.allocate(capacity=4, hidden=8, top_k=2, num_ranks=1, dtype=torch.bfloat16, device="cpu")
    x = torch.randn(3, 8).bfloat16()
    ids, weights = torch.tensor([[0, 1], [1, 2], [2, 3]]), torch.rand(3, 2)
    values, read = staging.pack_values(table, x, ids, weights)
    assert values == (3, table.offset_of(x), table.offset_of(ids), table.offset_of(weights))
    assert all(r is t for r, t in zip(read, (x, ids, weights)))  # what the router gives: no copy
    values, read = staging.pack_values(table, x, ids.int(), weights.double())
    assert read[0] is x and read[1].dtype == torch.int64 and read[2].dtype == torch.float32
    assert torch.equal(read[1], ids) and torch.equal(read[2], weights)
    assert values == (3, table.offset_of(x), table.offset_of(read[1]), table.offset_of(read[2]))


def test_stage_inputs_copies_t_rows_and_pads_the_rest():
    capacity, hidden, top_k = 5, 8, 3
    x_CH = torch.full((capacity, hidden), 99.0)
    ids_CK = torch.full((capacity, top_k), 7, dtype=torch.int64)
    weights_CK = torch.full((capacity, top_k), 0.5)
    table = CallerAddresses(x_CH.view(torch.uint8).view(-1), 4)
    x = torch.randn(2, hidden)
    ids = torch.tensor([[0, 1, 2], [3, -1, 4]])
    weights = torch.rand(2, top_k)
    table.write(2, table.offset_of(x), table.offset_of(ids), table.offset_of(weights))
    table.fetch()
    stage_inputs(table, x_CH, ids_CK, weights_CK)
    assert torch.equal(x_CH[:2], x) and torch.equal(ids_CK[:2], ids) and torch.equal(weights_CK[:2], weights)
    assert (ids_CK[2:] == -1).all()  # rows past T go nowhere
    assert (x_CH[2:] == 99.0).all() and (weights_CK[2:] == 0.5).all()  # not copied: never read


def test_fetch_reaches_words_more_than_2_gib_from_the_anchor():
    """Host memory lies far from device memory: an offset that fits int32 as 16-byte units but not
    as bytes (here 3 GiB) must not wrap. The tensor is not initialised, so only two pages are touched."""
    span = 3 << 30
    memory = torch.empty(span + 64, dtype=torch.uint8)
    anchor = memory[:16]
    words = memory[span : span + 32].view(torch.int64)  # two values, the sequence number, the echo
    words.copy_(torch.tensor([11, -12, 1, 0]))
    table = torch.zeros(2, dtype=torch.int64)
    fetch_words(anchor, span // 16, table)
    assert table.tolist() == [11, -12] and words[3].item() == 1

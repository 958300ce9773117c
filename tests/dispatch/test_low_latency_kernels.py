"""The fused Triton kernels of ``low_latency`` (``kernels="triton"``) against its torch reference path.

On CPU they run in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), so the
index logic, the byte layout and the arithmetic are held to the reference without a GPU; the GPU
tests (``tests/dispatch/test_gpu_low_latency.py``) repeat this on CUDA and add fp8 payload bits, graphs and
symmetric memory. Same seed, same inputs, both paths: the dispatched bytes, the layout and the expert
inputs must be identical; combine sums in float32 in another order (tolerance 1e-6 in float32).

The interpreter's fp8 conversion has a carry bug (124.3 rounds to 64, not 128), so on CPU the fp8
payload bytes are not compared, only everything around them (scales, ids, weights, layout).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch import EPGroup, mask_padding_tokens
from moe_sbo.dispatch.low_latency import LowLatencyDispatcher, RowFormat, transport
from moe_sbo.layer import MoELayer

kernels = pytest.importorskip("moe_sbo.dispatch.low_latency.kernels", reason="needs Triton (pip install triton)")
# CPU tensors through the kernels: only in the interpreter (on a CUDA machine the GPU tests cover this).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

COMBINE_TOL = 1e-6  # float32: the same products, summed in another order


def _random_ids(num_tokens: int, num_choices: int, top_k: int, generator=None) -> torch.Tensor:
    """``[T, K]`` distinct expert ids per token among the first ``num_choices``."""
    rows = [torch.randperm(num_choices, generator=generator)[:top_k] for _ in range(num_tokens)]
    return torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.int64)


def _both_paths(dispatcher_for, x_TH, ids_TK, weights_TK):
    """Dispatch, a fixed expert function (2x + row-independent NaN-free), combine, on both paths."""
    results = {}
    for kernels in ("torch", "triton"):
        d = dispatcher_for(kernels)
        with torch.inference_mode():
            recv = d.dispatch(x_TH, ids_TK, weights_TK)
            num_real = int(recv.num_rows_per_expert_L.sum())
            # Padding rows' outputs are undefined: NaN here, so a kernel that reads them fails loudly.
            y_RH = torch.full_like(recv.expert_x_RH, float("nan"))
            y_RH[:num_real] = recv.expert_x_RH[:num_real] * 2 + 1
            out_TH = d.combine(y_RH, recv.handle)
        bufs = d.buffers(x_TH.device, x_TH.dtype, x_TH.shape[1], ids_TK.shape[1])[0]
        results[kernels] = (recv, num_real, out_TH, bufs.dispatch_recv_SB.clone())
    return results["torch"], results["triton"]


def _assert_same(ref, fused, fmt: RowFormat):
    (r_recv, r_n, r_out, r_bytes), (f_recv, f_n, f_out, f_bytes) = ref, fused
    assert r_n == f_n
    assert torch.equal(r_recv.num_rows_per_expert_L, f_recv.num_rows_per_expert_L)
    r_layout, f_layout = r_recv.handle.layout, f_recv.handle.layout
    assert torch.equal(r_layout.row_R, f_layout.row_R) and torch.equal(r_layout.weight_R, f_layout.weight_R)
    assert torch.equal(r_recv.handle.slot_TP, f_recv.handle.slot_TP)
    # The bytes on the wire: ids and weights of every slot (padding slots: ids -1), x of real slots.
    assert torch.equal(fmt.ids(r_bytes), fmt.ids(f_bytes))
    real_S = (fmt.ids(r_bytes) >= 0).any(dim=1)
    assert torch.equal(fmt.weights(r_bytes)[real_S], fmt.weights(f_bytes)[real_S])
    if fmt.fp8:
        scales = slice(fmt.scales_offset, fmt.ids_offset)
        assert torch.equal(r_bytes[real_S, scales], f_bytes[real_S, scales])
    else:
        assert torch.equal(r_bytes[real_S, : fmt.ids_offset], f_bytes[real_S, : fmt.ids_offset])
        assert torch.equal(r_recv.expert_x_RH[:r_n], f_recv.expert_x_RH[:f_n])
    assert f_out.shape == r_out.shape
    if r_out.numel() and not fmt.fp8:
        assert (f_out - r_out).abs().max().item() <= COMBINE_TOL * max(1.0, r_out.abs().max().item())


# (T, C) cases per plan. One pass (decode kernels): (50, 64) is 256 (slot, k) pairs, two chunks of 128
# in the layout kernel. Two passes (``kernels.two_pass``): several token blocks (128 each) and layout chunks
# (256 pairs each), a padding token right after a block boundary.
CASES = {"one_pass": ((0, 4), (1, 4), (5, 8), (8, 8), (50, 64)), "two_pass": ((0, 4), (3, 8), (130, 130), (300, 320))}


@interpreted
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("plan", ["one_pass", "two_pass"])
def test_one_rank_fused_equals_torch_path(monkeypatch, fp8, plan):
    monkeypatch.setattr(kernels, "TWO_PASS_MIN_CAPACITY", 1 if plan == "two_pass" else 1 << 30)
    torch.manual_seed(0)
    num_experts, top_k = 8, 4
    hidden = 256 if plan == "one_pass" else 128
    for num_tokens, capacity in CASES[plan]:
        x = torch.randn(num_tokens, hidden)
        ids = _random_ids(num_tokens, num_experts, top_k)
        if num_tokens > 2:
            ids[1] = -1  # a padding token: sends nothing
            ids[2, :2] = -1  # half a token
        if num_tokens > 200:
            ids[129] = -1
        weights = torch.rand(num_tokens, top_k)
        ref, fused = _both_paths(
            lambda kernels: LowLatencyDispatcher(
                num_experts, EPGroup(), max_tokens_per_rank=capacity, fp8=fp8, kernels=kernels
            ),
            x,
            ids,
            weights,
        )
        _assert_same(ref, fused, RowFormat.make(hidden, top_k, torch.float32, fp8))


def _ranks_bulk_vs_torch(device):
    """Two ranks, the two-pass kernels forced, blocks spanning several programs on both sides."""
    rank = dist.get_rank()
    previous = kernels.TWO_PASS_MIN_CAPACITY
    kernels.TWO_PASS_MIN_CAPACITY = 1
    try:
        gen = torch.Generator().manual_seed(7 + rank)
        num_experts, top_k, hidden, capacity = 8, 4, 128, 200
        num_tokens = (200, 141)[rank]
        x = torch.randn(num_tokens, hidden, generator=gen)
        ids = _random_ids(num_tokens, num_experts, top_k, gen)
        weights = torch.rand(num_tokens, top_k, generator=gen)
        ref, fused = _both_paths(
            lambda kernels: LowLatencyDispatcher(
                num_experts, EPGroup.from_torch(), max_tokens_per_rank=capacity, kernels=kernels
            ),
            x,
            ids,
            weights,
        )
        _assert_same(ref, fused, RowFormat.make(hidden, top_k, torch.float32, False))
    except AssertionError as err:
        return f"rank {rank}: {err!r}"
    finally:
        kernels.TWO_PASS_MIN_CAPACITY = previous
    return "ok"


@interpreted
def test_gloo_ranks_bulk_kernels_equal_torch_path(ranks2):
    assert ranks2.run(_ranks_bulk_vs_torch) == ["ok"] * 2


def test_fused_kernels_refuse_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    d = LowLatencyDispatcher(8, EPGroup(), max_tokens_per_rank=4, kernels="triton")
    with torch.inference_mode(), pytest.raises(ValueError, match="kernels='triton' needs CUDA tensors"):
        d.dispatch(torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2))
    default = LowLatencyDispatcher(8, EPGroup())
    assert not default.uses_triton(torch.device("cpu"))
    assert default.transport_for(torch.device("cpu")) == "nccl"  # auto: symmetric memory only on CUDA, EP > 1
    with pytest.raises(ValueError, match="transport='symm_mem' writes into the peers' buffers"):
        LowLatencyDispatcher(8, EPGroup(), kernels="torch", transport="symm_mem")
    with pytest.raises(ValueError, match="transport must be one of"):
        LowLatencyDispatcher(8, EPGroup(), transport="nvlink")
    with pytest.raises(ValueError, match="transport='symm_mem' needs CUDA tensors"), torch.inference_mode():
        LowLatencyDispatcher(8, EPGroup(), transport="symm_mem").dispatch(
            torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
        )


def _ranks_fused_vs_torch(device, fp8: bool, skew: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts, top_k, hidden, capacity = 4 * world, 4, 128, 6
    gen = torch.Generator().manual_seed(100 + rank)
    num_tokens = [capacity, 0, 3, 1][rank % 4]
    x = torch.randn(num_tokens, hidden, generator=gen)
    # "one_rank": every token to rank 0's experts only.
    ids = _random_ids(num_tokens, 4 if skew == "one_rank" else num_experts, top_k, gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ref, fused = _both_paths(
        lambda kernels: LowLatencyDispatcher(
            num_experts, EPGroup.from_torch(), max_tokens_per_rank=capacity, fp8=fp8, kernels=kernels
        ),
        x,
        ids,
        weights,
    )
    try:
        _assert_same(ref, fused, RowFormat.make(hidden, top_k, torch.float32, fp8))
    except AssertionError as err:
        return f"rank {rank}: {err!r}"
    return "ok"


@interpreted
@pytest.mark.parametrize("fp8,skew", [(False, "spread"), (True, "spread"), (False, "one_rank")])
def test_gloo_ranks_fused_equals_torch_path(ranks4, fp8, skew):
    assert ranks4.run(_ranks_fused_vs_torch, fp8, skew) == ["ok"] * 4


def _layer_rank(device):
    """The whole layer with fused kernels, a device-side token count masking padding, against ``local``."""
    cfg = get_preset("tiny")
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(dist.get_rank()))
    fused = MoELayer(
        cfg,
        dispatcher="low_latency",
        dtype=torch.float32,
        seed=3,
        dispatcher_options={"max_tokens_per_rank": 8, "kernels": "triton"},
    )
    ref = MoELayer(cfg, dtype=torch.float32, seed=3)
    fused.dispatcher.hooks.register("pre_dispatch", mask_padding_tokens(torch.tensor([5])))
    with torch.inference_mode():
        y, expected = fused(x)[:5], ref(x[:5])
    return (y - expected).abs().max().item()


@interpreted
def test_gloo_layer_with_fused_kernels_matches_local(ranks2):
    assert max(ranks2.run(_layer_rank)) < 1e-5


@interpreted
def test_fused_kernels_refuse_rows_not_a_multiple_of_16_bytes():
    d = LowLatencyDispatcher(8, EPGroup(), max_tokens_per_rank=4, kernels="triton")
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=r"multiple of 16 bytes, got H = 10 x 4.*kernels='torch'"),
    ):
        d.dispatch(torch.randn(2, 10), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2))


@interpreted
def test_pack_flags_out_of_range_ids():
    # On CUDA the fused path asserts on these flags instead of checking the ids with torch ops.
    fmt = RowFormat.make(16, 2, torch.float32, False)
    ids = torch.tensor([[0, 3], [-1, 4], [-2, 1]])  # E = 4: token 1 has 4, token 2 has -2
    dst_P = torch.zeros(4, fmt.row_bytes, dtype=torch.uint8)
    slot_TP = torch.empty(3, 1, dtype=torch.int64)
    ok = kernels.pack_rows(
        torch.randn(3, 16),
        ids,
        torch.rand(3, 2),
        transport.Destinations.make(dst_P, [dst_P.data_ptr()]),
        slot_TP,
        fmt,
        num_local_experts=4,
        capacity=4,
    )
    assert ok.tolist() == [1, 0, 0, 1]  # row 3: no token, nothing to flag


def test_auto_transport_needs_one_node_with_peer_access(monkeypatch):
    """``transport="auto"`` takes symmetric memory only when the EP group can be this node's GPUs,
    all reachable from each other (the answer is cached per process: cleared around each case)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    cases = [
        (4, None, True, True),
        (8, None, True, False),  # more ranks than GPUs, symmetric memory not told that they share them
        (4, "2", True, False),  # torchrun says two ranks per node
        (4, None, False, False),
    ]  # no peer access (PCIe without P2P)
    for ep_size, local_world, peer_access, expected in cases:
        if local_world is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b, ok=peer_access: ok)
        transport.peers_reachable.cache_clear()
        assert transport.peers_reachable(ep_size) is expected, (ep_size, local_world, peer_access)
    transport.peers_reachable.cache_clear()


def test_destinations_must_be_16_byte_aligned():
    buf = torch.zeros(64, dtype=torch.uint8)
    dst = transport.Destinations.make(buf, [buf.data_ptr(), buf.data_ptr() + 32])
    assert dst.offsets_P.tolist() == [0, 2]  # in 16-byte units from the anchor
    with pytest.raises(ValueError, match="block addresses must be 16-byte aligned"):
        transport.Destinations.make(buf, [buf.data_ptr() + 8])

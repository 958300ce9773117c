"""``low_latency``: index logic against hand-worked tensors, fp8's error bound, and on gloo ranks:
equality with ``local`` at the capacity edges, buffers reused, overflow refused before any
collective, padding tokens masked from a device-side count, hooks, two rounds in flight.

(``tests/dispatch/test_dispatch.py`` runs it through every routing and token case beside the other schemes,
and ``tests/overlap/test_overlap.py`` through every overlap mode.)
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.dispatch import EPGroup, make_dispatcher, mask_padding_tokens
from moe_sbo.dispatch.low_latency import dispatcher as ll_dispatcher
from moe_sbo.dispatch.low_latency.reference import group_slots_by_expert, plan_send, reduce_pairs
from moe_sbo.hooks import HOOK_EVENTS
from moe_sbo.layer import MoELayer
from moe_sbo.quant.fp8 import FP8_GROUP, dequantize_fp8, quantize_fp8

FLOAT32_TOL = 1e-5  # as the other dispatchers against local (tests/dispatch/test_dispatch.py)
# fp8 e4m3 keeps 3 mantissa bits: each value is off by <= 2^-4 of itself. The routed output's
# Frobenius-relative error measured 0.031-0.041 (float32 and bf16 activations, 4 ranks, 5 seeds).
FP8_REL_TOL = 0.06


def _ll(cfg, capacity, **options):
    return MoELayer(
        cfg,
        dispatcher="low_latency",
        dtype=options.pop("dtype", torch.float32),
        seed=11,
        dispatcher_options={"max_tokens_per_rank": capacity, **options},
    )


def _routed(layer: MoELayer, x_TH: torch.Tensor, ids_TK=None, weights_TK=None) -> torch.Tensor:
    """The routed part of a forward (router unless ids are given, dispatch, experts, combine) and its bytes."""
    if ids_TK is None:
        topk = layer.router(x_TH)
        ids_TK, weights_TK = topk.topk_ids_TK, topk.topk_weights_TK
    recv = layer.dispatcher.dispatch(x_TH, ids_TK, weights_TK)
    y_TH = layer.dispatcher.combine(layer.experts.forward_dispatched(recv), recv.handle)
    return y_TH, layer.dispatcher.last_traffic


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---- index logic, one process ----------------------------------------------------------------------


def test_plan_send_hand_worked():
    # P = 2 ranks, L = 2 experts each (E = 4), capacity 3. Token 0 -> experts 0 (rank 0), 3 (rank 1);
    # token 1 -> experts 1, 0: both rank 0, sent once; token 2 -> no expert (-1) and expert 2 (rank 1).
    plan = plan_send(torch.tensor([[0, 3], [1, 0], [-1, 2]]), num_local_experts=2, num_ranks=2, capacity=3)
    assert plan.slot_TP.tolist() == [[0, 3], [1, 6], [6, 4]]  # 6 = S: not sent
    assert plan.token_S.tolist() == [0, 1, 3, 0, 2, 3]  # 3 = T: the padding row


def test_group_slots_by_expert_hand_worked():
    # S = 3 received slots, K = 2, L = 2 local experts; -1: another rank's expert (or none).
    local_ids = torch.tensor([[1, -1], [0, 1], [-1, -1]])
    weights = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    fixed = group_slots_by_expert(local_ids, weights, 2)
    # Expert 0: slot 1; expert 1: slots 0, 1; then three padding rows pointing at slot S = 3.
    assert fixed.layout.row_R.tolist() == [1, 0, 1, 3, 3, 3]
    assert fixed.layout.num_rows_per_expert_L.tolist() == [1, 2]
    torch.testing.assert_close(fixed.layout.weight_R, torch.tensor([0.3, 0.1, 0.4, 0.0, 0.0, 0.0]))
    assert fixed.pair_row_SK.tolist() == [[1, 3], [0, 2], [4, 5]]
    # Combine: padding rows' outputs are undefined (NaN here) and must not reach any slot.
    y = torch.tensor([[1.0], [2.0], [3.0], [float("nan")] * 1, [float("nan")], [float("nan")]])
    torch.testing.assert_close(reduce_pairs(y, fixed), torch.tensor([[0.1 * 2], [0.3 * 1 + 0.4 * 3], [0.0]]))


def test_fp8_round_trip_within_e4m3_rounding():
    generator = torch.Generator().manual_seed(0)
    # Values spanning ~10 decades, so some fall into e4m3's subnormal range of their group.
    x = torch.randn(64, 4 * FP8_GROUP, generator=generator) * torch.exp(3 * torch.randn(64, 1, generator=generator))
    x[3, :FP8_GROUP] = 0.0  # an all-zero group must come back as zeros, not NaN
    q, scales = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (64, 4)
    back = dequantize_fp8(q, scales, torch.float32)
    # Normal range: half a step of 3 mantissa bits; subnormal: half of the 2^-9 step, in scale units.
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scales.repeat_interleave(FP8_GROUP, dim=1)
    assert ((back - x).abs() <= bound * (1 + 1e-5)).all()
    assert torch.equal(back[3, :FP8_GROUP], torch.zeros(FP8_GROUP))


# ---- one process, no process group -----------------------------------------------------------------


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"dispatcher options must be among \[\] for 'alltoall'"):
        make_dispatcher("alltoall", 16, EPGroup(), max_tokens_per_rank=8)
    with pytest.raises(
        ValueError,
        match=r"among \['max_tokens_per_rank', 'fp8', 'num_buffers', 'kernels', 'transport', 'index_graphs', "
        r"'fixed_expert_rows', 'index_rows'\]"
        r".*'capacity'",
    ):
        make_dispatcher("low_latency", 16, EPGroup(), capacity=8)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be an int >= 1, got 0"):
        make_dispatcher("low_latency", 16, EPGroup(), max_tokens_per_rank=0)
    with pytest.raises(ValueError, match="index_graphs must be True or False, got 'false'"):
        make_dispatcher("low_latency", 16, EPGroup(), index_graphs="false")
    with pytest.raises(ValueError, match="fixed_expert_rows must be True or False, got 1"):
        make_dispatcher("low_latency", 16, EPGroup(), fixed_expert_rows=1)
    with pytest.raises(ValueError, match="index_rows leaves the received rows in place"):
        make_dispatcher("low_latency", 16, EPGroup(), index_rows=True, kernels="torch")
    with pytest.raises(ValueError, match="fixed_expert_rows gathers the expert rows inside the index graphs"):
        make_dispatcher("low_latency", 16, EPGroup(), fixed_expert_rows=True, index_graphs=False)


def test_single_rank_ids_minus_one_and_bad_ids():
    cfg = get_preset("tiny")
    x = torch.randn(6, cfg.hidden_size)
    ref, ll = MoELayer(cfg, dtype=torch.float32, seed=11), _ll(cfg, 8)
    with torch.no_grad():
        torch.testing.assert_close(ll(x), ref(x), atol=FLOAT32_TOL, rtol=0)
        ids = torch.tensor([[0, 5, 9, 15]] * 6)
        ids[2] = -1  # token 2 chose nothing: its routed output is zero
        weights = torch.rand(6, 4)
        y, _ = _routed(ll, x, ids, weights)
        assert torch.equal(y[2], torch.zeros(cfg.hidden_size))
        keep = [0, 1, 3, 4, 5]
        torch.testing.assert_close(
            y[keep], _routed(ref, x[keep], ids[keep], weights[keep])[0], atol=FLOAT32_TOL, rtol=0
        )
        bad_id = r"topk_ids must lie in \[-1, 16\) \(-1: no expert\), got values in \[-2, 15\]"
        with pytest.raises(ValueError, match=bad_id):
            _routed(ll, x, torch.where(ids == 5, -2, ids), weights)


def test_inference_only_and_buffers_outlive_inference_mode():
    cfg = get_preset("tiny")
    ll, x = _ll(cfg, 8), torch.randn(5, cfg.hidden_size)
    with pytest.raises(RuntimeError, match=r"low_latency is inference-only.*torch.inference_mode\(\)"):
        ll(x)  # autograd on: refused before anything moves
    with torch.inference_mode():
        first = ll(x)  # allocates the buffers here...
    with torch.no_grad():
        torch.testing.assert_close(ll(x), first, atol=0, rtol=0)  # ...and they are writable outside it


# ---- gloo ranks ----------------------------------------------------------------------------------------


def _capacity_edges_rank(device, capacity):
    """One dispatcher, several forwards whose T per rank hits 0, T < C and T = C, then a skew that
    fills a whole receive block; every output against local. Returns errors and buffer addresses."""
    cfg = get_preset("tiny")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, ll = MoELayer(cfg, dtype=torch.float32, seed=11), _ll(cfg, capacity)
    token_rounds = [[capacity, 0, 5, capacity], [1, capacity, 0, 2], [0, 0, 0, 0], [capacity] * 4]
    errors, addresses = [], []
    generator = torch.Generator().manual_seed(40 + rank)
    with torch.no_grad():
        for n, tokens in enumerate(token_rounds):
            x = torch.randn(tokens[rank % 4], cfg.hidden_size, generator=generator)
            if n == len(token_rounds) - 1:
                # Every token picks the last rank's experts: its receive blocks are full, all real rows.
                ids = torch.arange(cfg.num_experts - 4, cfg.num_experts).repeat(x.shape[0], 1)
                weights = torch.rand(x.shape[0], 4, generator=generator)
                y, expected = _routed(ll, x, ids, weights)[0], _routed(ref, x, ids, weights)[0]
            else:
                y, expected = ll(x), ref(x)
            errors.append((y - expected).abs().max().item() if x.shape[0] else 0.0)
            buffers = ll.dispatcher.buffers(x.device, torch.float32, cfg.hidden_size, 4)
            addresses.append(
                [b.dispatch_send_SB.data_ptr() for b in buffers] + [b.combine_recv_SH.data_ptr() for b in buffers]
            )
    return errors, addresses, len(ll.dispatcher._sets), ll.last_traffic.dispatch_bytes_sent, world


def test_capacity_edges_match_local_and_buffers_are_reused(ranks4):
    for errors, addresses, buffer_keys, sent, world in ranks4.run(_capacity_edges_rank, 13):
        assert max(errors) < FLOAT32_TOL, errors
        assert buffer_keys == 1 and all(a == addresses[0] for a in addresses)  # allocated once, reused
        assert len(set(addresses[0])) == 4  # two distinct sets, each with its own buffers
        assert sent == (world - 1) * 13 * (64 * 4 + 2 * 4 * 4)  # fixed blocks of 13 rows


def _overflow_rank(device, capacity):
    cfg = get_preset("tiny")
    rank = dist.get_rank()
    ll = _ll(cfg, capacity)
    message = "no error"
    with torch.no_grad():
        if rank == 1:
            try:
                ll(torch.randn(capacity + 1, cfg.hidden_size))
            except ValueError as err:
                message = str(err)
        # Had rank 1 entered the all-to-all, this barrier would pair with it and hang or fail.
        dist.barrier()
        x = torch.randn(capacity, cfg.hidden_size)
        error = (ll(x) - MoELayer(cfg, dtype=torch.float32, seed=11)(x)).abs().max().item()
    return message, error


def test_overflow_is_refused_before_any_collective(ranks2):
    (message0, error0), (message1, error1) = ranks2.run(_overflow_rank, 8)
    assert message0 == "no error"
    assert "tokens per rank must be <= max_tokens_per_rank = 8" in message1 and "got T = 9" in message1
    assert "max_tokens_per_rank" in message1.split(";")[1]  # the fix is named
    assert max(error0, error1) < FLOAT32_TOL  # the group still works after the refusal


def _fp8_rank(device, dtype_name):
    cfg = get_preset("tiny").replace(hidden_size=2 * FP8_GROUP)
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    x = torch.randn([16, 3, 0, 9][rank], cfg.hidden_size, generator=torch.Generator().manual_seed(rank)).to(dtype)
    with torch.no_grad():
        y_plain, traffic_plain = _routed(_ll(cfg, 16, dtype=dtype), x)
        y_fp8, traffic_fp8 = _routed(_ll(cfg, 16, dtype=dtype, fp8=True), x)
    return {
        "rel": _rel(y_fp8, y_plain) if x.shape[0] else None,
        "finite": bool(y_fp8.isfinite().all()),
        "plain": traffic_plain,
        "fp8": traffic_fp8,
    }


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_fp8_dispatch_accuracy_and_bytes(ranks4, dtype_name):
    results = ranks4.run(_fp8_rank, dtype_name)
    rels = [r["rel"] for r in results if r["rel"] is not None]
    assert all(r["finite"] for r in results)
    # Quantisation happened (not a bitwise copy), and stays within the stated bound.
    assert all(0.005 < rel <= FP8_REL_TOL for rel in rels), rels
    # Dispatch row: H fp8 values + H/128 float32 scales + K ids + K weights (256 + 8 + 32 = 296,
    # padded to 16 bytes: 304); against H values in the activation dtype + ids + weights (already
    # multiples of 16). Combine stays in the activation dtype.
    h, elem = 2 * FP8_GROUP, torch.finfo(getattr(torch, dtype_name)).bits // 8
    blocks = 3 * 16  # (P - 1) ranks x capacity rows
    for r in results:
        assert r["fp8"].dispatch_bytes_sent == blocks * 304
        assert r["plain"].dispatch_bytes_sent == blocks * (h * elem + 2 * 4 * 4)
        assert r["fp8"].combine_bytes_sent == r["plain"].combine_bytes_sent == blocks * h * elem


def _fp8_bad_hidden_rank(device):
    layer = _ll(get_preset("tiny"), 8, fp8=True)  # H = 64: not a multiple of 128
    try:
        with torch.no_grad():
            layer(torch.randn(4, 64))
    except ValueError as err:
        dist.barrier()  # every rank got here: none was left inside a collective
        return str(err)
    return "no error"


def test_fp8_needs_hidden_multiple_of_128(ranks2):
    for message in ranks2.run(_fp8_bad_hidden_rank):
        assert "hidden size must be a multiple of 128 for fp8 dispatch" in message and "got H = 64" in message


def _padding_rank(device, capacity, real_tokens):
    """A capacity-sized input whose real count is a tensor: rows past it must act as absent."""
    cfg = get_preset("tiny")
    rank = dist.get_rank()
    ref, ll = MoELayer(cfg, dtype=torch.float32, seed=11), _ll(cfg, capacity)
    num_tokens = torch.zeros(1, dtype=torch.int64)
    ll.dispatcher.hooks.register("pre_dispatch", mask_padding_tokens(num_tokens))
    generator = torch.Generator().manual_seed(90 + rank)
    x = torch.empty(capacity, cfg.hidden_size)
    errors = []
    with torch.no_grad():
        for n in real_tokens[rank]:
            x.normal_(generator=generator)
            x[n:] *= 1e4  # loud padding: any leak into real rows would show
            num_tokens.fill_(n)  # the only change between forwards, as between CUDA-graph replays
            y = ll(x)
            errors.append((y[:n] - ref(x[:n])).abs().max().item() if n else 0.0)
            # Padding rows get no routed output, only the shared experts (which see every row).
            errors.append((y[n:] - ll.shared_experts(x[n:])).abs().max().item() / 1e4 if n < capacity else 0.0)
    return errors


def test_padding_tokens_masked_by_a_device_count(ranks2):
    for errors in ranks2.run(_padding_rank, 12, [[12, 5, 0], [3, 12, 7]]):
        assert max(errors) < FLOAT32_TOL, errors


def _hooks_rank(device):
    cfg = get_preset("tiny")
    ll = _ll(cfg, 8)
    log = []
    for event in HOOK_EVENTS:
        ll.dispatcher.hooks.register(event, lambda d, payload, event=event: log.append(event))
    with torch.no_grad():
        ll(torch.randn(5, cfg.hidden_size))
        ll(torch.randn(0, cfg.hidden_size))
    return log


def test_hooks_fire_in_order(ranks2):
    for log in ranks2.run(_hooks_rank):
        assert log == list(HOOK_EVENTS) * 2


def _rounds_rank(device):
    """Two rounds in flight at once (two-batch overlap's pattern), then a third that reuses the
    first's buffers before the first combined."""
    cfg = get_preset("tiny")
    rank = dist.get_rank()
    ref, ll = MoELayer(cfg, dtype=torch.float32, seed=11), _ll(cfg, 8)
    d = ll.dispatcher
    generator = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, cfg.hidden_size, generator=generator) for n in ([8, 3], [2, 6])[rank]]
    with torch.no_grad():
        topks = [ll.router(x) for x in xs]
        pendings = [d.dispatch_launch(x, t.topk_ids_TK, t.topk_weights_TK) for x, t in zip(xs, topks)]
        recvs = [d.dispatch_wait(p) for p in pendings]
        launches = [d.combine_launch(ll.experts.forward_dispatched(r), r.handle) for r in recvs]
        ys = [d.combine_wait(p) for p in launches]
        errors = [(y - _routed(ref, x)[0]).abs().max().item() for y, x in zip(ys, xs)]
        stale = [d.dispatch(xs[0], topks[0].topk_ids_TK, topks[0].topk_weights_TK) for _ in range(3)]
        try:
            d.combine(ll.experts.forward_dispatched(stale[0]), stale[0].handle)
        except RuntimeError as err:
            return errors, str(err)
    return errors, "no error"


def _staged_rank(device):
    """The fused kernels through ``index_graphs``' pieces (reading the caller's tensors through
    their address tables) against the same kernels launched per forward: token counts that shrink
    and grow across the two buffer sets, two rounds in flight (each y still its own after the
    other's combine), and the local reference. With ``index_rows`` (staged and direct) the rows stay
    in the receive buffer: experts that gather them give the same bytes, the tiled GEMM reading
    through the index the reference within tolerance."""
    cfg = get_preset("tiny")
    rank = dist.get_rank()
    ref = MoELayer(cfg, dtype=torch.float32, seed=11)
    layers = {
        "staged": _ll(cfg, 8, kernels="triton"),
        "fixed rows": _ll(cfg, 8, kernels="triton", fixed_expert_rows=True),
        "direct": _ll(cfg, 8, kernels="triton", index_graphs=False),
        "index rows": _ll(cfg, 8, kernels="triton", index_rows=True),
        "index rows, direct": _ll(cfg, 8, kernels="triton", index_graphs=False, index_rows=True),
        "index rows, tiled": _ll(cfg, 8, kernels="triton", index_rows=True),
    }
    layers["index rows, tiled"].experts.kernels = "tiled"  # reads through the index (Triton's interpreter)
    generator = torch.Generator().manual_seed(100 + rank)
    counts = ([8, 5, 2, 7, 0, 8], [3, 8, 6, 1, 4, 0])[rank]
    results = []
    with torch.inference_mode():
        for first, second in zip(counts[::2], counts[1::2]):
            xs = [torch.randn(n, cfg.hidden_size, generator=generator) for n in (first, second)]
            topks = [ref.router(x) for x in xs]
            ys = {}
            for name, layer in layers.items():
                d = layer.dispatcher
                pendings = [d.dispatch_launch(x, t.topk_ids_TK, t.topk_weights_TK) for x, t in zip(xs, topks)]
                recvs = [d.dispatch_wait(p) for p in pendings]
                assert all((r.expert_rows_R is not None) == d.settings.index_rows for r in recvs)
                outs = [layer.experts.forward_dispatched(r) for r in recvs]
                ys[name] = [d.combine(y, r.handle) for y, r in zip(outs, recvs)]
            for i, x in enumerate(xs):
                expected = _routed(ref, x, topks[i].topk_ids_TK, topks[i].topk_weights_TK)[0]
                results.append(
                    (
                        all(
                            torch.equal(ys[name][i], ys["direct"][i])
                            for name in ("staged", "fixed rows", "index rows", "index rows, direct")
                        ),
                        max((ys[name][i] - expected).abs().max().item() for name in ("staged", "index rows, tiled"))
                        if x.shape[0]
                        else 0.0,
                        tuple(ys["staged"][i].shape) == tuple(x.shape),
                    )
                )
        staging = [g.staging for g in next(iter(layers["staged"].dispatcher._sets.values())).graphs]
    return results, all(s is not None for s in staging)


def test_index_graphs_staging_equals_direct_launches(ranks2):
    for results, both_sets_staged in ranks2.run(_staged_rank):
        assert both_sets_staged
        for equal, error, shaped in results:
            assert equal and shaped and error < FLOAT32_TOL, results


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the staged path runs the fused kernels")
def test_staging_kept_from_inference_mode_is_written_under_no_grad():
    """The staging keeps its views of the last T between forwards; made under inference_mode, they
    must still take a later no_grad forward's tokens (as the buffers do), and a new T new views."""
    cfg = get_preset("tiny")
    staged, direct = (_ll(cfg, 8, kernels="triton", index_graphs=flag) for flag in (True, False))
    x = torch.randn(6, cfg.hidden_size)
    with torch.inference_mode():
        staged(2 * x), staged(2 * x)  # both buffer sets stage T = 6 inside inference mode
    with torch.no_grad():
        for rows in (6, 6, 3, 6):
            torch.testing.assert_close(staged(x[:rows]), direct(x[:rows]), atol=0, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the staged path runs the fused kernels")
def test_graphs_convert_what_they_cannot_read_in_place():
    """The graphs read the router's dtypes (int64 ids, float32 weights) and the experts' output in
    place when contiguous and 16-byte aligned; int32 ids, float64 weights, a strided or misaligned
    x, and a strided, misaligned or float64 expert output are converted first, with the same result."""
    cfg = get_preset("tiny")
    staged, direct = (_ll(cfg, 8, kernels="triton", index_graphs=flag) for flag in (True, False))
    x_TH = torch.randn(cfg.hidden_size, 7).t()  # [T, H] with column stride T: not contiguous
    misaligned_TH = torch.randn(7 * cfg.hidden_size + 1)[1:].view(7, cfg.hidden_size)  # 4 bytes off
    with torch.inference_mode():
        topk = staged.router(x_TH)
        ids, weights = topk.topk_ids_TK, topk.topk_weights_TK
        inputs = [
            (x_TH.contiguous(), ids, weights, lambda y: y),  # every tensor read in place
            (x_TH, ids.int(), weights.double(), lambda y: y.double()),
            (misaligned_TH.copy_(x_TH), ids, weights, lambda y: y.t().contiguous().t()),  # strided y
            (x_TH.contiguous(), ids, weights, _misaligned_copy),  # y contiguous, 4 bytes off
        ]
        for x, ids_, weights_, expert_output in inputs * 2:  # each buffer set sees each
            ys = []
            for layer in (staged, direct):
                recv = layer.dispatcher.dispatch(x, ids_, weights_)
                y_RH = layer.experts.forward_dispatched(recv)
                ys.append(layer.dispatcher.combine(expert_output(y_RH), recv.handle))
            torch.testing.assert_close(ys[0], ys[1], atol=0, rtol=0)


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view_as(t).copy_(t)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the staged path runs the fused kernels")
def test_fixed_expert_rows_are_kept_per_buffer_set():
    """``fixed_expert_rows``: each buffer set gathers into rows of its own, which the set's next
    round reuses; without it every forward's rows are new (so a caller may keep them)."""
    cfg = get_preset("tiny")
    x = torch.randn(6, cfg.hidden_size)
    pointers = {}
    with torch.inference_mode():
        for fixed in (True, False):
            layer = _ll(cfg, 8, kernels="triton", fixed_expert_rows=fixed)
            topk = layer.router(x)
            recvs = []
            for _ in range(3):  # sets 0, 1, 0
                recvs.append(layer.dispatcher.dispatch(x, topk.topk_ids_TK, topk.topk_weights_TK))
                layer.dispatcher.combine(layer.experts.forward_dispatched(recvs[-1]), recvs[-1].handle)
            pointers[fixed] = [r.expert_x_RH.data_ptr() for r in recvs]
    first, second, third = pointers[True]
    assert first != second and third == first
    assert len(set(pointers[False])) == 3


def test_a_deleted_layer_frees_its_buffers_without_garbage_collection():
    """The index graphs keep no reference to their dispatcher, so dropping a layer frees its buffer
    sets at once (symmetric memory must not wait for a collection, which may come mid-capture)."""
    cfg = get_preset("tiny").replace(hidden_size=256)
    collecting = gc.isenabled()
    gc.disable()
    try:
        layer = _ll(cfg, 8, kernels="triton")
        with torch.inference_mode():
            for n in (5, 3):  # both buffer sets staged
                layer(torch.randn(n, cfg.hidden_size))
        dispatcher = weakref.ref(layer.dispatcher)
        del layer
        assert dispatcher() is None
    finally:
        if collecting:
            gc.enable()


def test_two_rounds_in_flight_and_a_third_is_refused(ranks2):
    for errors, message in ranks2.run(_rounds_rank):
        assert max(errors) < FLOAT32_TOL, errors
        assert "this dispatch's buffers were taken by a later one: 2 dispatches started after it" in message


@pytest.mark.parametrize(
    "kernels, fixed_rows", [("torch", False), ("triton", False), pytest.param("triton", True, id="triton-fixed_rows")]
)
@pytest.mark.parametrize("fp8", [False, True])
def test_buffer_bytes_is_what_the_buffers_take(fp8, kernels, fixed_rows):
    """The stated memory formula against the buffers two forwards allocate (one rank; the fused
    kernels' path adds each buffer set's staging for the index graphs, and with
    ``fixed_expert_rows`` each set's expert rows)."""
    cfg = get_preset("tiny").replace(hidden_size=256)
    layer = _ll(cfg, 24, fp8=fp8, kernels=kernels, **({"fixed_expert_rows": True} if fixed_rows else {}))
    with torch.inference_mode():
        for _ in range(2):  # one per buffer set
            layer(torch.randn(5, cfg.hidden_size))
    d = layer.dispatcher
    key = (torch.device("cpu"), torch.float32, cfg.hidden_size, cfg.num_experts_per_tok)
    buffers = [
        t
        for b in d.buffers(*key)
        for t in (b.dispatch_send_SB, b.dispatch_recv_SB, b.combine_send_SH, b.combine_recv_SH)
    ]
    staging = [s for s in (g.staging for g in d.shape_sets(*key).graphs) if s is not None]
    assert len(staging) == (2 if kernels == "triton" else 0)
    staged = [t for s in staging for t in (s.x_CH, s.ids_CK, s.weights_CK, s.slot_CP)]
    rows = [t for g in d.shape_sets(*key).graphs if g.expert_rows is not None for t in g.expert_rows if t is not None]
    assert len(rows) == (2 if fixed_rows else 0)
    allocated = sum(t.numel() * t.element_size() for t in buffers + staged + rows)
    assert allocated == d.buffer_bytes(*key[1:], device="cpu")


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the fused paths run the kernels")
PHASES = ("launch_dispatch", "wait_dispatch", "launch_combine", "wait_combine")


def _forward(d, x_TH, ids_TK, weights_TK):
    recv = d.dispatch(x_TH, ids_TK, weights_TK)
    return d.combine(recv.rows_RH() * 2, recv.handle)


def _record(calls, path, monkeypatch):
    """Every phase of ``path`` (this object, not its class) appends (path, phase) to ``calls``."""
    for phase in PHASES:
        run = getattr(path, phase)
        monkeypatch.setattr(path, phase, lambda *a, run=run, phase=phase: calls.append((path, phase)) or run(*a))


@pytest.mark.parametrize(
    "options, eager, captured",
    [
        ({"kernels": "torch"}, "TorchPath", "TorchPath"),
        pytest.param({"kernels": "triton", "index_graphs": False}, "FusedPath", "FusedPath", marks=INTERPRETED),
        pytest.param({"kernels": "triton"}, "ReplayedPath", "FusedPath", marks=INTERPRETED),
    ],
)
def test_the_path_is_chosen_once_per_shape_and_runs_every_phase(monkeypatch, options, eager, captured):
    """The shape's first forward chooses its path (and the one a caller's capture runs); after it,
    each phase runs that object and nothing decides again: the choice's inputs and the table's
    ``supports`` raise if asked, and both buffer sets' forwards give the first forward's y."""
    d = make_dispatcher("low_latency", 8, EPGroup(), max_tokens_per_rank=8, **options)
    gen = torch.Generator().manual_seed(3)
    x, ids, weights = torch.randn(6, 64, generator=gen), torch.randint(-1, 8, (6, 2), generator=gen), torch.rand(6, 2)
    with torch.inference_mode():
        first = _forward(d, x, ids, weights)
    sets = d.shape_sets(torch.device("cpu"), torch.float32, 64, 2)
    assert (type(sets.path).__name__, type(sets.capture_path).__name__) == (eager, captured)

    def decided(*args):
        raise AssertionError("a phase chose its path again")

    monkeypatch.setattr(d, "uses_triton", decided)
    monkeypatch.setattr(d, "transport_for", decided)
    for path_type in ll_dispatcher.PATHS:
        monkeypatch.setattr(path_type, "supports", staticmethod(decided))
    calls: list = []
    _record(calls, sets.path, monkeypatch)
    with torch.inference_mode():
        for _ in range(2):  # each buffer set
            assert torch.equal(_forward(d, x, ids, weights), first)
    assert calls == [(sets.path, phase) for phase in PHASES] * 2


@INTERPRETED
@pytest.mark.parametrize("captured_phases", [("dispatch", "combine"), ("combine",)])
def test_a_callers_capture_runs_the_shapes_capture_path(monkeypatch, captured_phases):
    """Inside a caller's CUDA-graph capture (faked here: CPU has none) a replayed shape's launches run
    its ``FusedPath``, the kernels launched directly, and each wait runs what its launch ran; a
    combine captured after an eager (replayed) dispatch reads the replayed layout. Same y."""
    x, ids, weights = torch.randn(5, 64), torch.randint(-1, 8, (5, 2)), torch.rand(5, 2)
    replayed, direct = (
        make_dispatcher("low_latency", 8, EPGroup(), max_tokens_per_rank=8, kernels="triton", index_graphs=flag)
        for flag in (True, False)
    )
    with torch.inference_mode():
        want = _forward(direct, x, ids, weights)
        sets = replayed.shape_sets(torch.device("cpu"), torch.float32, 64, 2)
        calls: list = []
        for path in (sets.path, sets.capture_path):
            _record(calls, path, monkeypatch)
        monkeypatch.setattr(ll_dispatcher, "capturing", lambda device: "dispatch" in captured_phases)
        recv = replayed.dispatch(x, ids, weights)
        monkeypatch.setattr(ll_dispatcher, "capturing", lambda device: True)
        got = replayed.combine(recv.rows_RH() * 2, recv.handle)
    assert torch.equal(got, want)
    dispatch_path = sets.capture_path if "dispatch" in captured_phases else sets.path
    expected = [(dispatch_path, "launch_dispatch"), (dispatch_path, "wait_dispatch")]
    assert calls == expected + [(sets.capture_path, "launch_combine"), (sets.capture_path, "wait_combine")]
    assert (sets.graphs[0].pack is None) == ("dispatch" in captured_phases)  # no index graph ran
    assert sets.graphs[0].combine is None and sets.graphs[0].combine_end is None


def test_copy_engine_refuses_cpu_tensors_before_any_transfer():
    d = make_dispatcher("low_latency", 8, EPGroup(), transport="copy_engine", kernels="torch")
    with torch.inference_mode(), pytest.raises(ValueError, match="transport='copy_engine' needs CUDA tensors"):
        d.dispatch(torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2))


def _mismatch_rank(device, options_per_rank, dtype_per_rank):
    rank = dist.get_rank()
    cfg = get_preset("tiny").replace(hidden_size=128)
    dtype = getattr(torch, dtype_per_rank[rank])
    options = dict(options_per_rank[rank])
    layer = _ll(cfg, options.pop("capacity"), dtype=dtype, **options)
    x = torch.randn(5, cfg.hidden_size).to(dtype)
    try:
        with torch.no_grad():
            layer(x)
        message = "no error"
    except ValueError as err:
        message = str(err)
    # The group still works afterwards: the same ranks run a layer built alike.
    with torch.no_grad():
        _ll(cfg, 8, dtype=torch.float32)(x.float())
    return message


@pytest.mark.parametrize(
    "options, dtypes, expected",
    [
        ([{"capacity": 8}, {"capacity": 16}], ["float32", "float32"], "max_tokens_per_rank [8, 16]"),
        ([{"capacity": 8, "fp8": True}, {"capacity": 8}], ["float32", "float32"], "fp8 [1, 0]"),
        ([{"capacity": 8, "num_buffers": 1}, {"capacity": 8}], ["float32", "float32"], "num_buffers [1, 2]"),
        (
            [{"capacity": 8}, {"capacity": 8}],
            ["float32", "bfloat16"],
            "activation dtype ['torch.float32', 'torch.bfloat16']",
        ),
    ],
)
def test_ranks_built_differently_are_refused_on_every_rank_before_any_transfer(ranks2, options, dtypes, expected):
    for message in ranks2.run(_mismatch_rank, options, dtypes):
        assert "must be built alike on every rank" in message and expected in message, message


def test_dispatch_says_how_many_of_its_fixed_rows_to_expect_real():
    # P x C x K fixed rows reach the experts; C x K of them are real on average (each slot's K choices
    # are on this rank with probability 1 / P): what the experts choose their kernels by.
    d = make_dispatcher("low_latency", 8, EPGroup(), max_tokens_per_rank=6, kernels="torch")
    with torch.inference_mode():
        recv = d.dispatch(torch.randn(4, 16), torch.randint(8, (4, 2)), torch.ones(4, 2))
        d.combine(recv.expert_x_RH, recv.handle)
    assert recv.expected_rows == 6 * 2 and recv.expert_x_RH.shape[0] == 6 * 2
    other = make_dispatcher("local", 8, EPGroup())
    with torch.inference_mode():
        recv = other.dispatch(torch.randn(4, 16), torch.randint(8, (4, 2)), torch.ones(4, 2))
    assert recv.expected_rows is None  # every row real

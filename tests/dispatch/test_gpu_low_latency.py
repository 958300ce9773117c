"""``low_latency`` on GPUs (NCCL, bf16, grouped GEMM): a forward without any device-to-host sync, and
the whole MoE layer captured in one CUDA graph, replayed with new inputs and fewer real tokens, for
each kernel path (fused Triton, torch reference) and transport (NCCL; symmetric memory from 2 GPUs);
and the fused kernels against the torch path on the same inputs.

Every test runs one NCCL rank per visible GPU (world size 1 on a 1-GPU machine: the all-to-all is
still NCCL's). Skipped without CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from gpu_ranks import gpu_world, shares_gpus
from moe_sbo.config import get_preset
from moe_sbo.dispatch import EPGroup, mask_padding_tokens
from moe_sbo.dispatch.low_latency import LowLatencyDispatcher, RowFormat
from moe_sbo.launch.ranks import RankPool
from moe_sbo.layer import MoELayer
from moe_sbo.streams import capture_graph

pytestmark = pytest.mark.gpu
BF16_REL_TOL = 2e-2  # as tests/test_gpu.py: bf16 on the wire and in the GEMMs vs the same math on one rank
# fp8 dispatch vs bf16 local: on CPU the layer output's error measured 0.031 on average and up to 0.068
# for single tokens (2048 tokens); a replay with one real token is judged on that token alone.
FP8_REL_TOL = 8e-2


def _config(preset: str):
    # tiny at H = 256 so fp8 (one scale per 128 values) applies; V2-Lite as it ships (H = 2048).
    return get_preset("tiny").replace(hidden_size=256) if preset == "tiny" else get_preset(preset)


WORLD = gpu_world()  # ranks share the GPU where there is one: symmetric memory and the copy engine run too
# Ranks that share a GPU have a gloo group: the process group's all-to-all (transport "nccl") then goes
# through host memory, which neither runs free of host syncs nor can be captured in a CUDA graph.
GLOO_ALL_TO_ALL = "ranks sharing a GPU: transport 'nccl' is gloo's all-to-all, through host memory"


_POOL = RankPool(WORLD, "cuda")  # started on first use and kept (a failed call restarts it)


@contextlib.contextmanager
def _ranks():
    """The module's GPU ranks (``_POOL``)."""
    yield _POOL


@pytest.fixture(scope="module", autouse=True)
def _close_pool():
    yield
    _POOL.close()


# (kernels, transport): every path a GPU user can pick, the default first.
PATHS = [
    ("auto", "auto"),
    ("triton", "nccl"),
    ("torch", "nccl"),
    ("triton", "symm_mem"),
    ("triton", "copy_engine"),
    ("torch", "copy_engine"),
]

# Every transport of the fused kernels.
FUSED_TRANSPORTS = ["nccl", "symm_mem", "copy_engine"]


def _sync_free_rank(device, capacity, kernels, transport):
    cfg = _config("tiny")
    rank = dist.get_rank()
    layer = MoELayer(
        cfg,
        dispatcher="low_latency",
        device=device,
        seed=1,
        dispatcher_options={"max_tokens_per_rank": capacity, "kernels": kernels, "transport": transport},
    )
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(capacity, cfg.hidden_size, generator=generator, device=device).bfloat16()
    with torch.inference_mode():
        for _ in range(layer.dispatcher.settings.num_buffers):
            # warm-up, outside the checked region: allocates the buffers and captures each buffer
            # set's index graphs (a capture synchronises the device once)
            layer(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any implicit device-to-host sync now raises
        try:
            outputs = [layer(x), layer(x[: capacity // 2 + rank]), layer(x[:0])]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    resolved = (layer.dispatcher.uses_triton(device), layer.dispatcher.transport_for(device))
    return [tuple(y.shape) for y in outputs], bool(outputs[0].isfinite().all()), resolved


@pytest.mark.parametrize("kernels, transport", PATHS)
def test_forward_has_no_device_to_host_sync(kernels, transport):
    if transport == "nccl" and shares_gpus(WORLD):
        pytest.skip(GLOO_ALL_TO_ALL)
    with _ranks() as ranks:
        for shapes, finite, (fused, resolved) in ranks.run(_sync_free_rank, 32, kernels, transport):
            assert finite and shapes[0] == (32, 256) and shapes[2] == (0, 256)
            if transport == "auto":  # the default: fused kernels over symmetric memory (GPUs shared or not)
                assert fused and resolved == "symm_mem"


def _graph_rank(device, preset, capacity, fp8, real_tokens, kernels, transport):
    """Capture one capacity-sized forward; replay it for several real counts; compare with eager local."""
    cfg = _config(preset)
    rank = dist.get_rank()
    layer = MoELayer(
        cfg,
        dispatcher="low_latency",
        device=device,
        seed=1,
        dispatcher_options={"max_tokens_per_rank": capacity, "fp8": fp8, "kernels": kernels, "transport": transport},
    )
    reference = MoELayer(cfg, dispatcher="local", device=device, seed=1)
    num_tokens = torch.full((1,), capacity, dtype=torch.int64, device=device)
    x_static = torch.zeros(capacity, cfg.hidden_size, dtype=torch.bfloat16, device=device)
    ids_static = torch.zeros(capacity, cfg.num_experts_per_tok, dtype=torch.int64, device=device)

    def keep_ids(dispatcher, inp):
        ids_static.copy_(inp.topk_ids_TK)  # the routing the graph used, to compare like with like

    layer.dispatcher.hooks.register("pre_dispatch", keep_ids)
    layer.dispatcher.hooks.register("pre_dispatch", mask_padding_tokens(num_tokens))
    generator = torch.Generator(device=device).manual_seed(100 + rank)
    results = []
    with torch.inference_mode():
        graph, y_static = capture_graph(lambda: layer(x_static))

        for n in real_tokens[rank]:
            x = torch.randn(n, cfg.hidden_size, generator=generator, device=device).bfloat16()
            x_static.normal_(generator=generator).mul_(100)  # loud padding rows: a leak would show
            x_static[:n].copy_(x)
            num_tokens.fill_(n)  # device-side count: no host read inside the graph
            graph.replay()
            got, expected = y_static[:n].float(), reference(x).float()
            # Near-tied experts may flip in bf16 between batch shapes; compare tokens routed alike.
            same = (torch.sort(ids_static[:n], 1).values == torch.sort(reference.router(x).topk_ids_TK, 1).values).all(
                1
            )
            rel = ((got[same] - expected[same]).norm() / expected[same].norm()).item() if n else 0.0
            pad_rel = 0.0
            if n < capacity:
                # Padding rows carry only the shared experts' output: nothing routed reached them.
                shared = layer.shared_experts(x_static[n:]).float()
                pad_rel = ((y_static[n:].float() - shared).norm() / shared.norm()).item()
            results.append({"n": n, "rel": rel, "pad_rel": pad_rel, "same": same.float().mean().item() if n else 1.0})
    return results


@pytest.mark.parametrize("kernels, transport", PATHS)
@pytest.mark.parametrize(
    "preset, fp8, tolerance",
    [
        ("tiny", False, BF16_REL_TOL),
        ("tiny", True, FP8_REL_TOL),
        ("deepseek-v2-lite", False, BF16_REL_TOL),
    ],
)
def test_whole_layer_in_a_cuda_graph_replays_with_fewer_tokens(preset, fp8, tolerance, kernels, transport):
    world = WORLD
    if _config(preset).num_experts % world:
        pytest.skip(f"{world} ranks do not divide {preset}'s experts")
    if transport == "nccl" and shares_gpus(world):
        pytest.skip(GLOO_ALL_TO_ALL)
    capacity = 64
    # Per rank: full, a few, one, none, and back to full (each replay is a new input and count).
    real_tokens = [[64, 17 + rank, 1, 0, 64] for rank in range(world)]
    with _ranks() as ranks:
        for results in ranks.run(_graph_rank, preset, capacity, fp8, real_tokens, kernels, transport):
            for r in results:
                assert r["same"] >= 0.9, r
                assert r["rel"] <= tolerance, r
                assert r["pad_rel"] <= BF16_REL_TOL, r


def _fused_vs_torch_rank(device, fp8, transport, capacity, top_k=8):
    """Same inputs through the torch path (NCCL) and the fused kernels (``transport``): the bytes that
    arrive, the layout and the expert inputs are identical (fp8 payload included: the kernel rounds as
    torch does); combine's float32 sums differ in order only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts, hidden = 8 * world, 7168
    gen = torch.Generator(device=device).manual_seed(rank)
    num_tokens = [capacity, 77 * capacity // 128, 1, 0][rank % 4]
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).bfloat16()
    ids = torch.rand(num_tokens, num_experts, generator=gen, device=device).topk(top_k, dim=1).indices
    ids[: num_tokens // 5, : max(1, min(2, top_k - 1))] = -1  # some tokens with fewer experts (top-1: none)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device)
    fmt = RowFormat.make(hidden, top_k, torch.bfloat16, fp8)
    got = {}
    for kernels, tr in (("torch", "nccl"), ("triton", transport)):
        d = LowLatencyDispatcher(
            num_experts, EPGroup.from_torch(), max_tokens_per_rank=capacity, fp8=fp8, kernels=kernels, transport=tr
        )
        with torch.inference_mode():
            recv = d.dispatch(x, ids, weights)
            y_RH = recv.expert_x_RH * 2 + 1  # padding rows: whatever was there; combine must ignore them
            out = d.combine(y_RH, recv.handle)
        recv_SB = d.buffers(device, torch.bfloat16, hidden, top_k)[0].dispatch_recv_SB[:-1]
        real_S = (fmt.ids(recv_SB) >= 0).any(dim=1)
        n = int(recv.num_rows_per_expert_L.sum())
        got[kernels] = (recv_SB.clone(), real_S, recv.handle.layout, recv.expert_x_RH[:n].clone(), out)
    (ref_bytes, ref_real, ref_layout, ref_x, ref_out), (bytes_, real, layout, x_fused, out) = (
        got["torch"],
        got["triton"],
    )
    ref_payload = ref_bytes[ref_real][:, : fmt.weights_offset + 4 * top_k]
    return {
        "ids": torch.equal(fmt.ids(ref_bytes), fmt.ids(bytes_)),
        "payload": torch.equal(ref_payload, bytes_[real][:, : fmt.weights_offset + 4 * top_k]),
        "layout": all(
            torch.equal(getattr(ref_layout, f), getattr(layout, f))
            for f in ("row_R", "weight_R", "num_rows_per_expert_L")
        ),
        "x": torch.equal(ref_x, x_fused),
        "combine_rel": ((out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)).item(),
        "finite": bool(out.isfinite().all()),
    }


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("transport", FUSED_TRANSPORTS)
@pytest.mark.parametrize("capacity", [128, 640])  # 640: the two-pass kernels run
def test_fused_kernels_equal_torch_path_on_gpu(fp8, transport, capacity):
    with _ranks() as ranks:
        for r in ranks.run(_fused_vs_torch_rank, fp8, transport, capacity):
            assert r["ids"] and r["payload"] and r["layout"] and r["x"] and r["finite"], r
            assert r["combine_rel"] <= 4e-3, r  # bf16 outputs: the same float32 sums in another order


@pytest.mark.parametrize("capacity", [128, 640])
def test_fused_kernels_with_one_expert_per_token_equal_torch_path_on_gpu(capacity):
    """Top-1: the kernels' top-k axis has one real lane (``kernel_choice.lanes`` pads it to two)."""
    with _ranks() as ranks:
        for r in ranks.run(_fused_vs_torch_rank, False, "nccl", capacity, 1):
            assert r["ids"] and r["payload"] and r["layout"] and r["x"] and r["finite"], r
            assert r["combine_rel"] <= 4e-3, r


def _graphed_and_direct(cfg, device, transport: str, capacity: int, seed: int) -> dict[bool, MoELayer]:
    """The same layer with ``index_graphs`` on (True) and off (False), fused kernels over ``transport``."""
    options = {"max_tokens_per_rank": capacity, "kernels": "triton", "transport": transport}
    return {
        flag: MoELayer(
            cfg,
            dispatcher="low_latency",
            device=device,
            seed=seed,
            dispatcher_options={**options, "index_graphs": flag},
        )
        for flag in (True, False)
    }


def _index_graphs_rank(device, transport, capacity):
    """Eager forwards with the index work replayed from graphs (``index_graphs``, the default) and
    with the kernels launched each time: bitwise-equal outputs over token counts that shrink and
    grow, each buffer set's graphs captured on its first forward and replayed after."""
    cfg = _config("tiny")
    rank = dist.get_rank()
    layers = _graphed_and_direct(cfg, device, transport, capacity, seed=1)
    generator = torch.Generator(device=device).manual_seed(200 + rank)
    counts = [capacity, capacity // 3 + rank, 1, capacity, 0, capacity // 2, 7 + rank, capacity]
    equal = []
    with torch.inference_mode():
        for n in counts:
            x = torch.randn(n, cfg.hidden_size, generator=generator, device=device).bfloat16()
            equal.append(torch.equal(layers[True](x), layers[False](x)))
    rounds = next(iter(layers[True].dispatcher._sets.values())).graphs
    captured = all(
        piece is not None and piece.captured for r in rounds for piece in (r.pack, r.layout, r.combine, r.combine_end)
    )
    return equal, captured


def _host_ahead_rank(device, transport):
    """The host queues eight eager forwards while the GPU is held back (a sleeping kernel), so it
    writes each buffer set's address tables again before the device has read the last ones: the
    tables must make it wait (``low_latency/addresses.py``), and every y must equal the direct launches'."""
    cfg = _config("tiny")
    rank = dist.get_rank()
    layers = _graphed_and_direct(cfg, device, transport, 64, seed=2)
    generator = torch.Generator(device=device).manual_seed(400 + rank)
    xs = [
        torch.randn(n, cfg.hidden_size, generator=generator, device=device).bfloat16()
        for n in (64, 9, 33, 64, 1, 50, 64, 17)
    ]
    with torch.inference_mode():
        for layer in layers.values():  # capture every piece first
            layer(xs[0]), layer(xs[1])
        torch.cuda.synchronize(device)
        dist.barrier()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the host gets far ahead
        ys = [layers[True](x) for x in xs]
        expected = [layers[False](x) for x in xs]
    return [torch.equal(a, b) for a, b in zip(ys, expected)]


@pytest.mark.parametrize("transport", FUSED_TRANSPORTS)
def test_index_graphs_with_the_host_far_ahead_of_the_gpu(transport):
    with _ranks() as ranks:
        for equal in ranks.run(_host_ahead_rank, transport):
            assert all(equal), equal


@pytest.mark.parametrize("transport", FUSED_TRANSPORTS)
@pytest.mark.parametrize("capacity", [128, 640])  # 640: the two-pass kernels run
def test_index_graphs_replay_equals_direct_launches(transport, capacity):
    with _ranks() as ranks:
        for equal, captured in ranks.run(_index_graphs_rank, transport, capacity):
            assert captured and all(equal), equal


def _index_rows_rank(device, transport, capacity):
    """``index_rows``: the experts' tiled GEMM reads the received rows through the layout's index
    instead of a copy in expert order. Eager forwards (index graphs) over token counts that shrink
    and grow, and the whole layer captured in a CUDA graph and replayed on new inputs, against the
    same layer copying the rows (the same tiles over the same rows: equal within bf16 tolerance)."""
    cfg = _config("tiny")
    rank = dist.get_rank()
    options = {"max_tokens_per_rank": capacity, "kernels": "triton", "transport": transport}
    layers = {
        flag: MoELayer(
            cfg, dispatcher="low_latency", device=device, seed=3, dispatcher_options={**options, "index_rows": flag}
        )
        for flag in (False, True)
    }
    for layer in layers.values():
        layer.experts.kernels = "tiled"  # at these sizes "auto" may pick the GEMV, which gathers first
    generator = torch.Generator(device=device).manual_seed(500 + rank)
    rel = []

    def relative(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() if b.numel() else 0.0

    with torch.inference_mode():
        for n in (capacity, capacity // 3 + rank, 1, 0, capacity):
            x = torch.randn(n, cfg.hidden_size, generator=generator, device=device).bfloat16()
            rel.append(relative(layers[True](x), layers[False](x)))
        x_static = torch.randn(capacity, cfg.hidden_size, generator=generator, device=device).bfloat16()
        graph, y_static = capture_graph(lambda: layers[True](x_static), warmup=1)
        for _ in range(2):
            x_static.copy_(torch.randn(capacity, cfg.hidden_size, generator=generator, device=device).bfloat16())
            graph.replay()
            rel.append(relative(y_static, layers[False](x_static)))
    return rel


@pytest.mark.parametrize("transport", FUSED_TRANSPORTS)
@pytest.mark.parametrize("capacity", [64, 640])  # 640: the two-pass kernels run
def test_index_rows_equal_the_copy_eager_and_replayed(transport, capacity):
    if transport == "nccl" and shares_gpus(WORLD):
        pytest.skip(GLOO_ALL_TO_ALL)  # the replayed half captures the transfer
    with _ranks() as ranks:
        for rel in ranks.run(_index_rows_rank, transport, capacity):
            assert max(rel) <= BF16_REL_TOL, rel


def _graphed_rows_rank(device, transport):
    """``fixed_expert_rows``: the expert rows come from each buffer set's ``layout`` graph.
    Two rounds in flight (two-batch overlap's pattern) get rows of their own, equal to the direct
    launches' rows; the third round reuses the first set's rows (valid until then, as documented);
    switching ``deliver_fp8`` captures the gather again (e4m3 rows equal to the direct path's)."""
    cfg = _config("tiny")
    rank = dist.get_rank()
    options = {"max_tokens_per_rank": 64, "kernels": "triton", "transport": transport, "fp8": True}
    staged, direct = (
        MoELayer(cfg, dispatcher="low_latency", device=device, seed=5, dispatcher_options={**options, **extra})
        for extra in ({"fixed_expert_rows": True}, {"index_graphs": False})
    )
    generator = torch.Generator(device=device).manual_seed(300 + rank)
    xs = [torch.randn(n, cfg.hidden_size, generator=generator, device=device).bfloat16() for n in (64, 17 + rank, 40)]
    checks = {}

    def rounds(layer, keep_fp8):
        """Two dispatches in flight, each combined (any [R, H] serves), then a third."""
        layer.dispatcher.deliver_fp8 = keep_fp8
        d, kept = layer.dispatcher, []

        def launch(x):
            topk = layer.router(x)
            return d.dispatch(x, topk.topk_ids_TK, topk.topk_weights_TK)

        recvs = [launch(x) for x in xs[:2]]
        for r in recvs:
            n = int(r.num_rows_per_expert_L.sum())
            scales = None if r.expert_scales_RQ is None else r.expert_scales_RQ[:n].clone()
            kept.append((r.expert_x_RH, r.expert_x_RH[:n].clone(), scales))
            d.combine(torch.zeros(r.expert_x_RH.shape, dtype=torch.bfloat16, device=device), r.handle)
        third = launch(xs[2])
        d.combine(torch.zeros(third.expert_x_RH.shape, dtype=torch.bfloat16, device=device), third.handle)
        return kept, third

    with torch.inference_mode():
        for keep_fp8 in (False, True):
            rounds(staged, keep_fp8)  # each set's first round (after a deliver_fp8 change) captures
            (s0, s1), s2 = rounds(staged, keep_fp8)
            (d0, d1), _ = rounds(direct, keep_fp8)
            checks[keep_fp8] = {
                "own rows": s0[0].data_ptr() != s1[0].data_ptr(),
                "third reuses the first set": s2.expert_x_RH.data_ptr() == s0[0].data_ptr(),
                "rows equal direct": all(torch.equal(a[1], b[1]) for a, b in ((s0, d0), (s1, d1))),
                "scales equal direct": all(
                    (a[2] is None) == (not keep_fp8) and (a[2] is None or torch.equal(a[2], b[2]))
                    for a, b in ((s0, d0), (s1, d1))
                ),
                "dtype": s0[0].dtype == (torch.float8_e4m3fn if keep_fp8 else torch.bfloat16),
            }
    rounds_ = next(iter(staged.dispatcher._sets.values())).graphs
    checks["captured"] = all(r.layout is not None and r.layout.captured for r in rounds_)
    return checks


@pytest.mark.parametrize("transport", FUSED_TRANSPORTS)
def test_fixed_expert_rows_are_gathered_in_the_layout_graph(transport):
    with _ranks() as ranks:
        for checks in ranks.run(_graphed_rows_rank, transport):
            assert checks.pop("captured"), checks
            for keep_fp8, c in checks.items():
                assert all(c.values()), (keep_fp8, c)


def _misuse_rank(device, transport):
    """On this rank's GPU: a batch over capacity on rank 1, then dispatchers built with different
    capacities on the two ranks; after each refusal, a forward built alike must still run."""
    cfg = _config("tiny")
    rank = dist.get_rank()

    def layer(capacity: int) -> MoELayer:
        options = {"max_tokens_per_rank": capacity, "kernels": "triton", "transport": transport}
        return MoELayer(cfg, dispatcher="low_latency", device=device, seed=3, dispatcher_options=options)

    def refusal(fn) -> str:
        try:
            fn()
        except ValueError as err:
            return str(err)
        return "no error"

    x = torch.randn(9, cfg.hidden_size, device=device).bfloat16()
    reference = MoELayer(cfg, device=device, seed=3)
    with torch.inference_mode():
        ll = layer(8)
        over = refusal(lambda: ll(x)) if rank == 1 else "no error"
        dist.barrier()  # had rank 1 started a transfer, this would pair with it and fail or hang
        after_over = (ll(x[:8]).float() - reference(x[:8]).float()).norm() / reference(x[:8]).float().norm()
        mismatched = refusal(lambda: layer(8 if rank == 0 else 16)(x[:4]))
        alike = (layer(8)(x[:4]).float() - reference(x[:4]).float()).norm() / reference(x[:4]).float().norm()
    return over, mismatched, after_over.item(), alike.item()


@pytest.mark.parametrize("transport", FUSED_TRANSPORTS)
def test_capacity_misuse_is_refused_before_any_transfer_and_the_gpus_keep_working(transport):
    from moe_sbo.launch.ranks import LocalRanks

    with LocalRanks(2, device="cuda") as ranks:
        results = ranks.run(_misuse_rank, transport)
    (over0, mismatched0, after0, alike0), (over1, mismatched1, after1, alike1) = results
    assert over0 == "no error"
    assert "tokens per rank must be <= max_tokens_per_rank = 8" in over1 and "got T = 9" in over1
    for message in (mismatched0, mismatched1):
        assert "must be built alike on every rank" in message and "max_tokens_per_rank [8, 16]" in message
    assert max(after0, after1, alike0, alike1) < 2e-2  # bf16 against the local reference

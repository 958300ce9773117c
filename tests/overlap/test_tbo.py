"""Two-batch overlap: the split rules, the stage schedule, and TBO (with every SBO mode) giving the
output of the layer without TBO on 2 gloo ranks for every dispatcher."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from moe_sbo.config import get_preset
from moe_sbo.decoder.attention import AttentionConfig, Batch
from moe_sbo.decoder.decoder_layer import DecoderLayer
from moe_sbo.decoder.micro_batches import split_batch
from moe_sbo.dispatch import DISPATCHERS
from moe_sbo.dispatch.low_latency import LowLatencyOptions
from moe_sbo.layer import MoELayer
from moe_sbo.overlap import FIXED_MODES
from moe_sbo.overlap.stages import run_interleaved, run_to_end
from moe_sbo.overlap.tbo import dispatcher_for, tbo_forward

ATTN = AttentionConfig(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16)
EP_DISPATCHERS = sorted(set(DISPATCHERS) - {"local"})


def _lengths(split):
    return split.a.batch.lengths, split.b.batch.lengths


def test_prefill_split_at_a_balanced_sequence_boundary():
    assert _lengths(split_batch(Batch.prefill([40, 24, 30, 34]))) == ((40, 24), (30, 34))


def test_prefill_cuts_one_sequence_when_no_boundary_is_balanced():
    split = split_batch(Batch.prefill([50, 30, 20, 28]))
    assert _lengths(split) == ((50, 14), (16, 20, 28))
    assert split.b.batch.starts == (14, 0, 0) and split.b.batch.slots == (1, 2, 3)
    assert split.b.batch.positions_T[:3].tolist() == [14, 15, 16]
    assert _lengths(split_batch(Batch.prefill([100]))) == ((50,), (50,))


def test_unsplittable_batches_run_without_tbo_and_say_why(caplog):
    assert split_batch(Batch.prefill([3])).reason.startswith("prefill of 3 tokens is below 64")
    assert split_batch(Batch.decode_step(0, torch.tensor([5]))).reason.startswith("decode batch of 1 sequence")
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dtype=torch.float32))
    with caplog.at_level(logging.DEBUG, logger="moe_sbo.tbo"), torch.no_grad():
        tbo_forward(layer, torch.randn(3, 64), Batch.prefill([3]), layer.make_cache(1, 8))
    assert "two-batch overlap off for this batch: prefill of 3 tokens" in caplog.text


def test_decode_split_halves_the_sequences():
    split = split_batch(Batch.decode_step(4, torch.tensor([7, 8, 9, 10, 11])))
    assert split.a.batch.slots == (4, 5, 6) and split.b.batch.slots == (7, 8)
    assert split.b.batch.positions_T.tolist() == [10, 11] and split.b.batch.decode


def _recorder(name, log, stages=3):
    for i in range(stages):
        log.append(f"{name}{i}")
        if i < stages - 1:
            yield
    return name


@pytest.mark.parametrize(
    "delay, order",
    [
        (0, "A0 B0 A1 B1 A2 B2"),
        (1, "A0 A1 B0 A2 B1 B2"),
        (2, "A0 A1 A2 B0 B1 B2"),
        (5, "A0 A1 A2 B0 B1 B2"),
    ],
)
def test_schedule_for_each_delay(delay, order):
    log = []
    assert run_interleaved(_recorder("A", log), _recorder("B", log), delay) == ("A", "B")
    assert " ".join(log) == order


def test_an_error_in_one_micro_batch_closes_both():
    closed = []

    def stages(name, fail):
        try:
            yield
            if fail:
                raise RuntimeError(f"boom in {name}")
            yield
        finally:
            closed.append(name)

    with pytest.raises(RuntimeError, match="boom in B"):
        run_interleaved(stages("A", False), stages("B", True), 0)
    assert sorted(closed) == ["A", "B"]


def _tbo_rank(device, dispatcher, regime, modes):
    """TBO vs the same layer without TBO on this rank's own batch (rank 0's cannot be split)."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    if regime == "prefill":
        lengths = [[5], [40, 24, 30, 34], [50, 30, 20, 28], [100]][rank % 4]
        batch = Batch.prefill(lengths)
        make_cache = lambda layer: layer.make_cache(len(lengths), 128)  # noqa: E731
    else:
        prefix = [[6], [5, 9, 3, 12, 7]][rank % 2]
        batch = Batch.decode_step(0, torch.tensor(prefix))
        make_cache = lambda layer: layer.make_cache(len(prefix), 32)  # noqa: E731
    x = torch.randn(batch.num_tokens, 64)
    results = {}
    with torch.no_grad():
        for mode in modes:
            layer = DecoderLayer(
                ATTN,
                MoELayer(get_preset("tiny"), dispatcher=dispatcher, dtype=torch.float32, seed=3, overlap=mode),
                seed=3,
            )
            events = {0: [], 1: []}
            for mb in (0, 1):
                for event in ("dispatch_in_flight", "combine_in_flight"):
                    dispatcher_for(layer.moe, mb).hooks.register(
                        event, lambda d, p, mb=mb, e=event: events[mb].append(e)
                    )
            plain = layer(x, batch, make_cache(layer))
            events[0].clear()
            tbo = tbo_forward(layer, x, batch, make_cache(layer))
            tbo_events = {mb: list(fired) for mb, fired in events.items()}
            # The same two micro-batches run one after the other: interleaving must change nothing.
            split = split_batch(batch)
            cache = make_cache(layer)
            sequential = [
                run_to_end(layer.stages(x[m.start : m.stop], m.batch, cache, dispatcher=dispatcher_for(layer.moe, i)))
                for i, m in enumerate((split.a, split.b))
            ]
            results[mode] = {
                "tbo": tbo,
                "rel": ((tbo - plain).norm() / plain.norm()).item(),
                "same_as_sequential": torch.equal(tbo, torch.cat(sequential)),
                "events": tbo_events,
                "leaked": sum(dispatcher_for(layer.moe, mb).hooks.count() for mb in (0, 1)) - 4,
                "twin_is_separate": dispatcher_for(layer.moe, 1) is not layer.moe.dispatcher,
            }
    return results


@pytest.mark.parametrize("dispatcher", EP_DISPATCHERS)
@pytest.mark.parametrize("regime", ["prefill", "decode"])
def test_tbo_matches_the_layer_without_tbo(ranks2, dispatcher, regime):
    for _rank, results in enumerate(ranks2.run(_tbo_rank, dispatcher, regime, ("none",))):
        r = results["none"]
        assert r["rel"] <= 1e-5 and r["same_as_sequential"] and r["leaked"] == 0 and r["twin_is_separate"]
        # both micro-batches fired their in-flight hooks, each on its own dispatcher
        assert r["events"][0] == r["events"][1] == ["dispatch_in_flight", "combine_in_flight"], r["events"]


def test_tbo_with_every_sbo_mode_on_four_ranks(ranks4):
    for results in ranks4.run(_tbo_rank, "alltoall", "prefill", FIXED_MODES):
        for mode, r in results.items():
            assert torch.equal(r["tbo"], results["none"]["tbo"]), f"TBO + SBO {mode} differs from TBO alone"
            assert r["rel"] <= 1e-5 and r["leaked"] == 0


def _tbo_two_nodes_rank(device):
    """node_aware with its two legs (4 ranks as 2 nodes): TBO's twin dispatcher shares the leg groups."""
    os.environ["MOE_SBO_RANKS_PER_NODE"] = "2"
    try:
        return _tbo_rank(device, "node_aware", "prefill", ("none", "dispatch", "split"))
    finally:
        del os.environ["MOE_SBO_RANKS_PER_NODE"]


def test_tbo_with_node_aware_across_two_nodes(ranks4):
    for results in ranks4.run(_tbo_two_nodes_rank):
        for mode, r in results.items():
            assert r["rel"] <= 1e-5 and r["same_as_sequential"] and r["leaked"] == 0, mode


def test_two_batch_overlap_needs_two_buffer_sets():
    """micro-batch B's dispatcher shares A's buffers: one buffer set is refused before any transfer."""
    cfg = get_preset("tiny")
    layer = MoELayer(cfg, dispatcher="low_latency", dtype=torch.float32, dispatcher_options={"num_buffers": 1})
    with pytest.raises(ValueError, match="needs 2 rounds in flight, but this one keeps 1; build it with num_buffers=2"):
        dispatcher_for(layer, 1)
    assert dispatcher_for(layer, 0) is layer.dispatcher


# ---- auto: TBO on or off per bucket, the same on every rank ------------------------------------------


def _auto_rank(device, slow):
    """``AutoTbo`` over 2 gloo ranks with different local batches and one agreed token count.

    ``slow``: where a 40 ms sleep makes a candidate slower, on some ranks only: ``"tbo_rank1"`` (micro-
    batch B's dispatcher sleeps on rank 1: TBO loses on rank 1 alone, and the slowest rank decides),
    ``"plain"`` (the layer without TBO sleeps on every rank: TBO wins everywhere)."""
    import time as clock

    from moe_sbo.overlap.tbo_auto import AutoTbo

    rank = dist.get_rank()
    torch.manual_seed(200 + rank)
    lengths = [[40, 24], [30, 34, 20]][rank]  # different T per rank; the agreed count is the larger
    batch = Batch.prefill(lengths)
    x = torch.randn(batch.num_tokens, 64)
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dispatcher="alltoall", dtype=torch.float32, seed=3), seed=3)
    sleep = lambda *args: clock.sleep(0.04)  # noqa: E731
    if slow == "tbo_rank1" and rank == 1:
        dispatcher_for(layer.moe, 1).hooks.register("pre_dispatch", sleep)
    if slow == "plain":
        # Only the layer without TBO sends all of this rank's tokens in one dispatch.
        layer.moe.dispatcher.hooks.register(
            "pre_dispatch", lambda d, inp: clock.sleep(0.04) if inp.x_TH.shape[0] == batch.num_tokens else None
        )
    auto = AutoTbo(trials=2, warmup=1)
    outputs = []
    with torch.no_grad():
        plain = layer(x, batch, layer.make_cache(len(lengths), 128))
        for _ in range(10):  # 2 x (1 warm-up + 2 trials) explore, then the choice runs
            outputs.append(auto.forward(layer, x, batch, layer.make_cache(len(lengths), 128), agreed_tokens=84))
    rel = max(((y - plain).norm() / plain.norm()).item() for y in outputs)
    return auto.choices, rel, {c: len(v) for c, v in auto.timings_us[128].items()}


@pytest.mark.parametrize("slow, tbo_wins", [("tbo_rank1", False), ("plain", True)])
def test_auto_tbo_keeps_one_choice_on_every_rank(ranks2, slow, tbo_wins):
    results = ranks2.run(_auto_rank, slow)
    for choices, rel, counts in results:
        assert choices == {128: tbo_wins}, results  # 84 agreed tokens: bucket 128, the same on both ranks
        assert rel <= 1e-5 and counts == {False: 2, True: 2}


def _decide_rank(device):
    """Rank 0 measured TBO faster, rank 1 slower: both must keep what the slowest rank says."""
    from moe_sbo.overlap.tbo_auto import AutoTbo

    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dispatcher="alltoall", dtype=torch.float32, seed=3), seed=3)
    samples = [{False: [10.0], True: [5.0]}, {False: [10.0], True: [20.0]}][dist.get_rank()]
    return AutoTbo()._decide(samples, layer.moe.dispatcher.ep, device)


def test_auto_tbo_decides_by_the_slowest_rank(ranks2):
    assert ranks2.run(_decide_rank) == [False, False]


def test_auto_tbo_refuses_bad_settings():
    from moe_sbo.overlap.tbo_auto import AutoTbo

    with pytest.raises(ValueError, match="trials must be >= 1"):
        AutoTbo(trials=0)


def test_a_gemm_sm_budget_changes_nothing_on_cpu():
    """CPU has no SMs: the budget is accepted and the output is the unbudgeted one, bit for bit."""
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dtype=torch.float32, seed=5), seed=5)
    batch, x = Batch.prefill([70, 60]), torch.randn(130, 64)
    with torch.no_grad():
        plain = tbo_forward(layer, x, batch, layer.make_cache(2, 80))
        budgeted = tbo_forward(layer, x, batch, layer.make_cache(2, 80), gemm_sm_budget=8)
    assert torch.equal(plain, budgeted)


def test_the_default_gemm_sm_budget_leaves_out_the_sms_the_transfer_holds(monkeypatch):
    """``"auto"``: all SMs but NCCL's CTAs when the transfer is an NCCL collective beside the compute
    (``NCCL_MAX_CTAS`` when set); no budget where nothing runs beside it (symmetric memory, copy
    engines, one rank, CPU). Numbers and None pass through; anything else is refused."""
    import moe_sbo.overlap.tbo as tbo
    from moe_sbo.dispatch import EPGroup, make_dispatcher
    from moe_sbo.dispatch.base import NCCL_TRANSFER_SMS

    monkeypatch.setattr(tbo, "sm_count", lambda device: 132)  # an H200, without one
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    cuda, cpu, two = torch.device("cuda"), torch.device("cpu"), EPGroup(rank=0, size=2)
    alltoall = make_dispatcher("alltoall", 16, two)
    assert tbo.resolve_gemm_sm_budget("auto", alltoall, cuda) == 132 - NCCL_TRANSFER_SMS
    monkeypatch.setenv("NCCL_MAX_CTAS", "16")
    assert tbo.resolve_gemm_sm_budget("auto", alltoall, cuda) == 116
    ll = {t: make_dispatcher("low_latency", 16, two, transport=t, kernels="triton") for t in ("nccl", "symm_mem")}
    assert tbo.resolve_gemm_sm_budget("auto", ll["nccl"], cuda) == 116
    assert tbo.resolve_gemm_sm_budget("auto", ll["symm_mem"], cuda) is None
    assert tbo.resolve_gemm_sm_budget("auto", alltoall, cpu) is None
    assert tbo.resolve_gemm_sm_budget("auto", make_dispatcher("local", 16, EPGroup()), cuda) is None
    assert tbo.resolve_gemm_sm_budget(100, alltoall, cuda) == 100
    assert tbo.resolve_gemm_sm_budget(None, alltoall, cuda) is None
    for bad in ("most", True, 1.5):
        with pytest.raises(ValueError, match="gemm_sm_budget must be a number of SMs, 'auto' or None"):
            tbo.resolve_gemm_sm_budget(bad, alltoall, cuda)


def test_bench_reads_a_tbo_gemm_sm_budget_as_a_number_auto_or_all():
    import argparse

    from moe_sbo.cli.parsers.bench_tbo import gemm_sm_budget_arg

    assert [gemm_sm_budget_arg(t) for t in ("128", "auto", "all")] == [128, "auto", None]
    for bad in ("0", "-4", "most"):
        with pytest.raises(argparse.ArgumentTypeError, match="a number of SMs, 'auto' or 'all'"):
            gemm_sm_budget_arg(bad)


NOTICES_SCRIPT = """
import os, sys, torch
from moe_sbo import streams

# The CPU build has no cuBLASLt: this stands in for PyTorch's setter, which prints its notice once
# per process from C++, straight to file descriptor 2. The carve-out is PyTorch's own.
state = {"library": "default", "noticed": False}
def preferred_blas_library(backend=None):
    if backend == "cublaslt" and not state["noticed"]:
        os.write(2, b"Warning: torch.backends.cuda.preferred_blas_library is an experimental feature\\n")
        state["noticed"] = True
    state["library"] = backend or state["library"]
    return state["library"]
torch.backends.cuda.preferred_blas_library = preferred_blas_library

if sys.argv[1] == "spent":
    streams.spend_experimental_notices()
    assert (state["library"], torch._C._get_sm_carveout_experimental()) == ("default", None)  # restored
torch.backends.cuda.preferred_blas_library("cublaslt")  # what sm_budget sets
torch._C._set_sm_carveout_experimental(8)
torch._C._set_sm_carveout_experimental(None)
print("ok")
"""


@pytest.mark.parametrize("spent", [True, False])
def test_the_sm_budgets_settings_print_no_notice_once_spent(spent):
    """PyTorch's once-per-process notices that the BLAS preference and the SM carve-out are
    experimental (C++, on the standard error of every rank) are spent quietly before the first
    budget; without that, they reach the terminal."""
    run = subprocess.run(
        [sys.executable, "-c", NOTICES_SCRIPT, "spent" if spent else "not spent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr
    if spent:
        assert run.stderr == ""
    else:
        assert "preferred_blas_library is an experimental feature" in run.stderr
        assert "Setting the SM carveout for matmuls is a temporary experimental mitigation" in run.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gemm_sm_budget_holds_during_tbo_and_is_undone_after(monkeypatch):
    """On CUDA every GEMM under TBO plans for the budget (PyTorch's SM carve-out, which
    ``torch._grouped_mm`` honours), and the carve-out before the call is back after it."""
    from moe_sbo.streams import sm_count

    device = torch.device("cuda")
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dtype=torch.bfloat16, device=device, seed=5), seed=5).to(
        device
    )
    batch = Batch.prefill([70, 60], device=device)
    x = torch.randn(130, 64, device=device, dtype=torch.bfloat16)
    seen = []
    experts = type(layer.moe.experts)
    forward = experts.forward
    monkeypatch.setattr(
        experts,
        "forward",
        lambda self, *a, **k: seen.append(torch._C._get_sm_carveout_experimental()) or forward(self, *a, **k),
    )
    before = torch._C._get_sm_carveout_experimental()
    with torch.inference_mode():
        plain = tbo_forward(layer, x, batch, layer.make_cache(2, 80))
        budgeted = tbo_forward(layer, x, batch, layer.make_cache(2, 80), gemm_sm_budget=sm_count(device) - 4)
    assert seen == [before, before, 4, 4]
    assert torch._C._get_sm_carveout_experimental() == before
    torch.testing.assert_close(budgeted, plain, rtol=2e-2, atol=2e-2)


def _half_capacity_rank(device):
    """TBO on the layer's own weights with a ``low_latency`` dispatcher sized for half the batch:
    the output of the layer without TBO, half the dispatch bytes of the whole-batch dispatcher's TBO."""
    cfg = get_preset("tiny")
    moe = MoELayer(
        cfg, dispatcher="low_latency", dtype=torch.float32, seed=3, dispatcher_options={"max_tokens_per_rank": 128}
    )
    layer = DecoderLayer(ATTN, moe, seed=3)
    half = moe.sibling_dispatcher(max_tokens_per_rank=64)
    batch = Batch.prefill([64, 64])
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        plain = layer(x, batch, layer.make_cache(2, 64))
        whole = tbo_forward(layer, x, batch, layer.make_cache(2, 64))
        whole_bytes = moe.last_traffic.dispatch_bytes_sent
        halved = tbo_forward(layer, x, batch, layer.make_cache(2, 64), dispatcher=half)
        half_bytes = moe.last_traffic.dispatch_bytes_sent
    return (halved - plain).abs().max().item(), (whole - plain).abs().max().item(), whole_bytes, half_bytes


def test_tbo_with_a_half_capacity_sibling_dispatcher_matches_and_halves_the_bytes(ranks2):
    for err_half, err_whole, whole_bytes, half_bytes in ranks2.run(_half_capacity_rank):
        assert err_half < 1e-5 and err_whole < 1e-5
        assert half_bytes * 2 == whole_bytes > 0


def test_tbo_refuses_a_dispatcher_for_other_experts_before_any_transfer():
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dtype=torch.float32))
    other = MoELayer(get_preset("tiny").with_num_experts(32), dtype=torch.float32).dispatcher  # tiny: 16
    with pytest.raises(ValueError, match=r"must serve the layer's experts.*sibling_dispatcher"), torch.no_grad():
        tbo_forward(layer, torch.randn(128, 64), Batch.prefill([64, 64]), layer.make_cache(2, 64), dispatcher=other)


def test_a_sibling_dispatcher_keeps_the_layers_options_and_replaces_the_ones_given():
    moe = MoELayer(
        get_preset("tiny").replace(hidden_size=256),
        dispatcher="low_latency",
        dtype=torch.float32,
        dispatcher_options={"max_tokens_per_rank": 128, "fp8": True, "num_buffers": 3, "kernels": "torch"},
    )
    half = moe.sibling_dispatcher(max_tokens_per_rank=64)
    assert half.settings == LowLatencyOptions(max_tokens_per_rank=64, fp8=True, num_buffers=3, kernels="torch")
    assert half.options == {"max_tokens_per_rank": 64, "fp8": True, "num_buffers": 3, "kernels": "torch"}
    assert moe.dispatcher.settings.max_tokens_per_rank == 128  # the layer's own is untouched

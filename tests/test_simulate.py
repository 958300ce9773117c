"""The simulator (``moe-sbo plan --simulate``): calibration from a result file written here, a layer
predicted by hand on a toy calibration, physics it must not break, validation, the routed experts'
Triton kernels (the GEMV and the tiled GEMM) and which of them a row ran, the command line."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from moe_sbo import planner
from moe_sbo.config import get_preset
from moe_sbo.overlap.sbo import FIXED_MODES
from moe_sbo.planner.simulate import dense_path, stage_ops
from moe_sbo.planner.simulate_fit import (
    EMULATED_INTERNODE_GBPS,
    GEMV,
    GEMV_BLOCK_ROWS,
    TILED,
    TILED_TILE_ROWS,
    TILED_TMA,
    TMA_MIN_ROWS_PER_EXPERT,
    Contention,
    RowDraw,
    expected_experts_with_rows,
    expected_weight_passes,
    fit_extra_tile,
    weight_passes,
)
from moe_sbo.planner.simulate_rows import (
    BY_ROWS_PER_EXPERT,
    BY_ROWS_TILED_TO_128,
    GEMV_BY_ROWS,
    GEMV_SINCE,
    GROUPED_MM_ONLY,
    TILED_512_SINCE,
    TILED_SINCE,
    TILED_TMA_BELOW_256,
    TILED_TMA_SINCE,
)

REPO_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
HIDDEN, INTER = 7168, 2048  # DeepSeek-V3's expert dims, the ones fp8_experts rows are measured at
GBPS, TFLOPS = 3000.0, 600.0  # the synthetic GPU: weight stream and GEMM rate
WIRE_LAT, WIRE_GBPS = 10.0, 100.0  # the synthetic wire


def gemm_us(experts: int, rows: float) -> float:
    """The synthetic grouped GEMM: a hard roofline, bf16 weights."""
    return max(experts * 3 * HIDDEN * INTER * 2 / (GBPS * 1e3), experts * rows * 6 * HIDDEN * INTER / (TFLOPS * 1e6))


def route_us(t: float) -> float:
    return 50 + 0.05 * t


def shared_us(t: float) -> float:
    return 20 + 0.1 * t


def wire_us(nbytes: float) -> float:
    return WIRE_LAT + nbytes / (WIRE_GBPS * 1e3)


def kernel_us(t: float) -> float:
    return 5 + 0.01 * t


ROW_B = 1000  # bytes per token and phase in the synthetic rows


def synthetic_rows() -> list[dict]:
    """GEMM-only rows, and EP2 low_latency layers timed as CUDA graphs, from the functions above."""
    rows = [
        {"bench": "fp8_experts", "weight_dtype": "bf16", "experts": e, "rows_per_expert": n, "t_us": gemm_us(e, n)}
        for e in (8, 32)
        for n in (16, 64, 1024, 4096)
    ]
    for t in (128, 1024, 4096):
        routed = gemm_us(16, t * 8 / 16)  # 16 experts per GPU, top-8
        d = c = t * ROW_B
        row = {
            "bench": "prefill",
            "preset": "deepseek-v3",
            "ep": 2,
            "num_experts": 32,
            "experts_per_gpu": 16,
            "tokens_per_rank": t,
            "dispatcher": "low_latency",
            "kernels": "triton",
            "transport": "nccl",
            "dispatch_dtype": "bfloat16",
            "overlap": "none",
            "graph": True,
            "wire": "nvlink",
            "t_floor_route_us": route_us(t),
            "t_floor_shared_us": shared_us(t),
            "t_floor_routed_us": routed,
            "ref_t_dispatch_us": wire_us(d),
            "ref_t_combine_us": wire_us(c),
            "dispatch_bytes_sent": d,
            "combine_bytes_sent": c,
            "t_dispatch_us": wire_us(d) + kernel_us(t),
            "t_combine_us": wire_us(c) + kernel_us(t),
        }
        row["t_layer_us"] = route_us(t) + row["t_dispatch_us"] + routed + row["t_combine_us"] + shared_us(t)
        rows.append(row)
    return rows


@pytest.fixture
def results(tmp_path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "synthetic_h200x2.json").write_text(json.dumps({"meta": {"world_size": 2}, "rows": synthetic_rows()}))
    return folder


@pytest.fixture(scope="module")
def real_costs() -> planner.StageCosts:
    return planner.calibrate_simulator(planner.load_rows(REPO_RESULTS))


@pytest.fixture(scope="module")
def repo_checked() -> list[planner.Checked]:
    """The repository's results validated as ``moe-sbo plan --simulate`` does (10 folds)."""
    return planner.validate(planner.load_rows(REPO_RESULTS))


# ---- calibration ----------------------------------------------------------------------------------


def test_calibration_recovers_the_synthetic_costs(results):
    cal = planner.calibrate_simulator(planner.load_rows(results))
    gemm = cal.gemm["bf16"]
    assert gemm.weight_GBps == pytest.approx(GBPS) and gemm.TFLOPs == pytest.approx(TFLOPS)
    assert gemm.knee == float("inf")  # a hard max fits the hard roofline exactly
    link = cal.links["nvlink"]
    assert link.latency_us == pytest.approx(WIRE_LAT) and link.GBps == pytest.approx(WIRE_GBPS)
    assert cal.route_gpu(1024) == pytest.approx(route_us(1024)) and cal.shared_gpu(4096) == pytest.approx(
        shared_us(4096)
    )
    path = planner.DispatchPath("low_latency", "triton", "nccl", "bf16", True)
    assert cal.kernel_us(path, "dispatch", 1024) == pytest.approx(kernel_us(1024))
    assert cal.kernel_us(path, "combine", 2048) == pytest.approx(kernel_us(2048))  # between the knots
    assert cal.links["rdma"].GBps == planner.RDMA_GBPS  # no RDMA rows: the stated assumption
    assert cal.contention == Contention(1.0, 1.0, "no contention probe among the files")


def test_calibration_refuses_files_without_what_it_needs(tmp_path):
    with pytest.raises(ValueError, match="--results must be a folder of result files"):
        planner.load_rows(tmp_path / "missing")
    (tmp_path / "empty.json").write_text(json.dumps({"meta": {}, "rows": []}))
    with pytest.raises(ValueError, match="got none with rows"):
        planner.load_rows(tmp_path)
    no_gemm = [r for r in synthetic_rows() if r["bench"] != "fp8_experts"]
    (tmp_path / "empty.json").write_text(json.dumps({"meta": {}, "rows": no_gemm}))
    with pytest.raises(ValueError, match="grouped-GEMM rows"):
        planner.calibrate_simulator(planner.load_rows(tmp_path))


def test_calibration_is_a_function_of_the_rows_kept(results):
    rows = planner.load_rows(results)
    held = next(r.group for r in rows if r.tokens == 4096)
    cal = planner.calibrate_simulator(rows, keep=lambda g: g != held)
    # Without the 4096-token setup the wire is fitted on the other two: still the same line, by design.
    assert cal.links["nvlink"].samples == 4
    assert cal.route_gpu.knots[-1][0] == 1024  # its floor is gone too


def test_the_router_costs_what_its_code_version_measured(tmp_path):
    """The router's GPU time is its code version's curve (``meta.source_sha``) where that spans the
    tokens, else the least any version measured (a path without a version: the scale-out)."""
    rows = synthetic_rows()
    slower = [{**r, "t_floor_route_us": 3 * r["t_floor_route_us"]} for r in rows if r.get("t_floor_route_us")]
    (tmp_path / "new_h200x2.json").write_text(
        json.dumps({"meta": {"world_size": 2, "source_sha": "new"}, "rows": rows})
    )
    (tmp_path / "old_h200x2.json").write_text(
        json.dumps({"meta": {"world_size": 2, "source_sha": "old"}, "rows": slower[:2]})  # 128 and 1024 tokens
    )
    cal = planner.calibrate_simulator(planner.load_rows(tmp_path))
    path = planner.DispatchPath("low_latency", "triton", "nccl", "bf16", True)
    old, new = replace(path, version="old"), replace(path, version="new")
    assert cal.router_us(old, 1024) == pytest.approx(3 * route_us(1024))
    assert cal.router_us(new, 1024) == cal.router_us(path, 1024) == pytest.approx(route_us(1024))
    assert cal.router_us(old, 4096) == pytest.approx(route_us(4096))  # past the old code's floors: the least
    assert cal.router_us(replace(path, version="unmeasured"), 1024) == pytest.approx(route_us(1024))


def test_a_wire_without_references_takes_its_files_measured_bandwidth(tmp_path):
    rows = synthetic_rows()
    emulated = [{**r, "wire": "emulated-internode", "ref_t_dispatch_us": None, "ref_t_combine_us": None} for r in rows]
    (tmp_path / "nvlink.json").write_text(json.dumps({"meta": {"world_size": 2}, "rows": rows}))
    meta = {"world_size": 2, "wire": "emulated-internode", "wire_all_to_all_GBps": 12.5}
    (tmp_path / "emulated.json").write_text(json.dumps({"meta": meta, "rows": emulated}))
    link = planner.calibrate_simulator(planner.load_rows(tmp_path)).links["emulated-internode"]
    assert link.GBps == 12.5 and link.latency_us == pytest.approx(WIRE_LAT) and "measured" in link.source
    (tmp_path / "emulated.json").unlink()  # no file on that wire: the stated assumption
    link = planner.calibrate_simulator(planner.load_rows(tmp_path)).links["emulated-internode"]
    assert link.GBps == EMULATED_INTERNODE_GBPS and link.samples == 0


def test_the_routed_factor_adds_rows_not_weight_reads():
    fit = planner.GemmFit(weight_GBps=GBPS, TFLOPs=TFLOPS, knee=3.0, samples=0)
    w, c = fit.parts_us(16, 4096, HIDDEN, INTER, 2.0)
    t = fit.time_us(16, 4096 * 1.3, HIDDEN, INTER, 2.0)
    assert fit.rows_factor(t, w, c) == pytest.approx(1.3)  # the inverse of the roofline in the rows
    path = planner.DispatchPath("low_latency", "triton", "nccl", "bf16", True)
    costs = replace(_toy_costs(fit), routed_factor={path: 1.3})
    v3 = get_preset("deepseek-v3")
    # Weight-bound (decode): the factor barely moves it; FLOP-bound (prefill): about x1.3.
    decode = costs.routed_gpu_us(v3, 16, 16 * 8, "bf16", path) / fit.time_us(16, 8, HIDDEN, INTER, 2.0)
    prefill = costs.routed_gpu_us(v3, 16, 16384 * 8, "bf16", path) / fit.time_us(16, 8192, HIDDEN, INTER, 2.0)
    assert decode < 1.001 and prefill == pytest.approx(1.3, rel=0.01)


def _toy_costs(fit: planner.GemmFit) -> planner.StageCosts:
    flat = planner.Curve(((1.0, 0.0),))
    links = {"nvlink": planner.LinkFit(WIRE_LAT, WIRE_GBPS, 0, "toy")}
    return planner.StageCosts({"bf16": fit}, {}, flat, flat, {}, {}, {}, links, Contention(1.0, 1.0, "toy"))


# ---- one layer, by hand -----------------------------------------------------------------------------


def test_prediction_equals_the_hand_sum_on_the_synthetic_calibration(results):
    rows = planner.load_rows(results)
    cal = planner.calibrate_simulator(rows)
    for row in rows:
        setup = planner.setup_of(row)
        if setup is None:
            continue
        t = row.tokens
        by_hand = route_us(t) + 2 * (wire_us(t * ROW_B) + kernel_us(t)) + gemm_us(16, t / 2) + shared_us(t)
        assert planner.predict(setup, cal).t_layer_us == pytest.approx(by_hand, rel=1e-9)
        assert by_hand == pytest.approx(row.get("t_layer_us"))


def test_dispatch_mode_hides_the_shared_experts_behind_the_transfer(results):
    cal = planner.calibrate_simulator(planner.load_rows(results))
    setup = planner.setup_of(next(r for r in planner.load_rows(results) if r.tokens == 4096))
    none = planner.predict(setup, cal).t_layer_us
    hidden = min(shared_us(4096), wire_us(4096 * ROW_B))  # overlap efficiency 1 without a probe
    assert planner.predict(replace(setup, overlap="dispatch"), cal).t_layer_us == pytest.approx(none - hidden)
    # combine launches the shared experts before the combine: its transfer waits, nothing is hidden.
    assert planner.predict(replace(setup, overlap="combine"), cal).t_layer_us == pytest.approx(none)
    auto = planner.predict(replace(setup, overlap="auto"), cal)
    assert auto.t_layer_us == min(planner.predict(replace(setup, overlap=m), cal).t_layer_us for m in FIXED_MODES)


# ---- physics ----------------------------------------------------------------------------------------

V3 = get_preset("deepseek-v3")
CASES = [
    (ep, regime, tokens)
    for ep in (8, 32, 128)
    for regime, tokens in (("decode", 32), ("decode", 256), ("prefill", 4096))
]


@pytest.mark.parametrize(("ep", "regime", "tokens"), CASES)
def test_more_bandwidth_never_predicts_slower(real_costs, ep, regime, tokens):
    faster = {w: replace(link, GBps=link.GBps * 2) for w, link in real_costs.links.items()}
    fast = replace(real_costs, links=faster)
    base = planner.scaleout_setup(V3, ep, regime, tokens)
    for mode in FIXED_MODES:
        for tbo in (False, True):
            setup = replace(base, overlap=mode, tbo=tbo)
            assert planner.predict(setup, fast).t_layer_us <= planner.predict(setup, real_costs).t_layer_us + 1e-6


@pytest.mark.parametrize("tokens", [1, 128, 4096])
def test_two_batch_overlap_of_a_compute_only_layer_gains_nothing(real_costs, tokens):
    """EP1 moves nothing: TBO has no transfer to hide and reads the weights twice."""
    for regime in ("prefill", "decode"):
        base = replace(planner.scaleout_setup(V3, 1, regime, tokens), wire="nvlink")
        for mode in FIXED_MODES:
            none = planner.predict(replace(base, overlap=mode), real_costs).t_layer_us
            assert planner.predict(replace(base, overlap=mode, tbo=True), real_costs).t_layer_us >= none - 1e-6


@pytest.mark.parametrize("ep", [8, 32, 128])
def test_more_tokens_never_faster_and_rdma_bytes_bounded(real_costs, ep):
    times = [planner.predict(planner.scaleout_setup(V3, ep, "decode", t), real_costs).t_layer_us for t in (16, 64, 256)]
    assert times == sorted(times)
    # Node-limited routing: a token's experts sit in at most topk_group groups, so on at most that many
    # nodes while a group fits in a node (EP <= 64 for DeepSeek-V3's 8 groups of 32 experts).
    nodes = planner.remote_nodes_per_token(V3, ep, 8)
    assert nodes <= (V3.topk_group if ep <= 64 else 2 * V3.topk_group)
    assert nodes == 0 if ep <= 8 else nodes > 0


def test_scaleout_refuses_an_ep_that_does_not_divide_the_experts():
    with pytest.raises(ValueError, match="--simulate-ep must divide the 256 routed experts"):
        planner.scaleout_setup(V3, 3, "decode", 32)


# ---- validation -------------------------------------------------------------------------------------


def test_validation_holds_out_each_setup(results):
    rows = planner.load_rows(results)
    checked = planner.validate(rows, folds=0)  # leave one setup out
    assert len(checked) == 3 and {c.metric for c in checked} == {"layer"}
    # Every fit here is a straight line through three points: two predict the third exactly (the
    # middle one by interpolation, the ends by extending the end segment), GEMM aside.
    assert all(abs(c.error) < 1e-6 for c in checked), [(c.label, c.error) for c in checked]


def test_direct_launches_are_a_path_and_a_setup_of_their_own(tmp_path):
    """``index_graphs: false`` (the fused kernels launched directly: more host time per eager
    forward) gets its own path, so its own host-time curve, and its own hold-out group; a row that
    records the default (``true``) and one without the field stay where they were."""
    base = {**synthetic_rows()[-1], "graph": False}
    rows = [base, {**base, "index_graphs": True}, {**base, "index_graphs": False}]
    unrecorded, graphs, direct = planner.load_rows(_write(tmp_path / "index_graphs_h200x2.json", rows))
    assert unrecorded.path == graphs.path and unrecorded.group == graphs.group
    assert direct.path.kernels == "triton+direct" and direct.path != graphs.path
    assert direct.group != graphs.group
    assert graphs.path not in direct.path.own_keys()  # its samples never reach the index-graph curve
    assert direct.path.own_keys()[-1] == graphs.path.own_keys()[-1]  # the dispatcher-wide fallback
    torch = {**base, "kernels": "torch", "index_graphs": False}  # only the fused kernels have index graphs
    assert planner.load_rows(_write(tmp_path / "torch.json", [torch]))[0].path.kernels == "torch"


def test_one_rank_keeps_symmetric_memory_apart_from_its_usual_path(tmp_path):
    """At EP1 nothing crosses a wire: NCCL's one-rank collective (or no transport recorded) is the
    usual path ("none"), but symmetric memory (no collective call; other host costs) keeps its own,
    and its label names it."""
    base = {**synthetic_rows()[-1], "ep": 1, "graph": False}
    rows = [base, {**base, "transport": "nccl"}, {**base, "transport": "symm_mem"}]
    path = tmp_path / "one_rank_h200x1.json"
    path.write_text(json.dumps({"meta": {"world_size": 1}, "rows": rows}))
    unrecorded, nccl, symm = planner.load_rows(path)
    assert unrecorded.path.transport == nccl.path.transport == "none"
    assert symm.path.transport == "symm_mem" and symm.group != nccl.group
    labels = {c.label for c in planner.validate([unrecorded, nccl, symm, *planner.load_rows(REPO_RESULTS)])}
    assert any("triton/symm_mem" in label and label.startswith("EP1 ") for label in labels)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"meta": {"world_size": 2}, "rows": rows}))
    return path


def test_validation_of_the_repository_results_reports_every_row(repo_checked):
    rows = planner.load_rows(REPO_RESULTS)
    checked = repo_checked
    layer_rows = sum(planner.setup_of(r) is not None for r in rows)
    assert sum(c.metric == "layer" for c in checked) == layer_rows > 800
    summary = planner.validation_summary(checked)
    assert summary[-1][0] == "all" and summary[-1][2] == str(len(checked))


def test_tbo_rows_with_a_gemm_sm_budget_are_predicted_with_it(tmp_path):
    """A TBO row that planned its GEMMs for fewer SMs is a setup with that budget; AutoTbo's row
    repeats a fixed row's setup and is not predicted twice."""
    base = {
        "bench": "tbo",
        "preset": "deepseek-v3",
        "ep": 2,
        "experts_per_gpu": 32,
        "dispatcher": "low_latency",
        "kernels": "triton",
        "transport": "nccl",
        "regime": "prefill",
        "tokens_per_rank": 4096,
        "sequences_per_rank": 2,
        "overlap": "none",
        "delay": 0,
        "graph": False,
        "capacity": 4096,
        "t_layer_us": 16000.0,
    }
    rows = [
        {**base, "tbo": False},
        {**base, "tbo": True, "capacity": 2048, "tbo_gemm_sm_budget": 128},
        {**base, "tbo": True, "capacity": 2048, "tbo_policy": "auto"},
    ]
    plain, budgeted, auto = planner.load_rows(_write(tmp_path / "tbo.json", rows))
    assert planner.setup_of(plain).gemm_sm_budget is None
    assert planner.setup_of(budgeted).gemm_sm_budget == 128 and planner.setup_of(budgeted).tbo
    assert planner.setup_of(auto) is None


def test_a_persistent_gemm_beside_a_transfer_waits_for_it_and_others_stretch():
    """The schedule's two contention rules: a compute op overlapping an SM transfer is stretched by
    (1 - efficiency) x the overlap; a persistent one (the bf16 grouped GEMM) that starts while the
    transfer is in flight ends its whole time after the transfer ends."""
    from moe_sbo.planner.simulate import COMPUTE, WIRE, Op, schedule

    wire = Op("transfer", "comm", WIRE, 100.0, sm_transfer=True)
    plain = Op("gemm", "routed_experts", COMPUTE, 40.0)
    persistent = Op("gemm", "routed_experts", COMPUTE, 40.0, persistent=True)

    def gemm_end(ops):
        span = next(s for s in schedule(ops, 0.5)[0] if s.name == "gemm")
        return span.start_us + span.dur_us

    assert gemm_end([wire, plain]) == pytest.approx(60.0)  # 40 + 0.5 x 40, inside the transfer
    assert gemm_end([wire, persistent]) == pytest.approx(140.0)  # the transfer's end + 40
    later = Op("gemm", "routed_experts", COMPUTE, 40.0, after=("transfer",), persistent=True)
    assert gemm_end([wire, later]) == pytest.approx(140.0)  # starts after the transfer: no wait added


def test_a_gemm_budget_slows_gemms_as_the_probe_measured():
    from moe_sbo.planner.simulate_fit import Contention, curve

    measured = Contention(1.2, 0.5, "probe", 132, curve([(132, 500.0), (100, 600.0)], trend=True))
    assert measured.gemm_slowdown(132) == pytest.approx(1.0)
    assert measured.gemm_slowdown(116) == pytest.approx(1.1)  # halfway between the probe's points
    assert Contention(1.0, 1.0, "no probe", 132).gemm_slowdown(66) == pytest.approx(2.0)  # SMs / budget


def test_tbo_predictions_follow_the_gemm_budget(real_costs):
    """Under TBO the bf16 grouped GEMM of one micro-batch waits for the other's transfer unless the
    GEMMs leave it SMs; a budget changes the prediction, and without TBO it changes nothing."""
    from dataclasses import replace

    from moe_sbo.planner.simulate import predict

    cal = real_costs
    rows = planner.load_rows(REPO_RESULTS)
    setup = next(
        s
        for r in rows
        if (s := planner.setup_of(r)) is not None
        and s.tbo
        and s.regime == "prefill"
        and s.wire != "nvlink"
        and s.gemm_sm_budget is None  # a row measured with a budget already has one
    )
    free, budgeted = predict(setup, cal), predict(replace(setup, gemm_sm_budget=128), cal)
    assert budgeted.t_layer_us != free.t_layer_us
    plain = replace(setup, tbo=False)
    assert predict(replace(plain, gemm_sm_budget=128), cal).t_layer_us == predict(plain, cal).t_layer_us


def test_validation_covers_both_wires_of_the_repository_results(repo_checked):
    """The emulated inter-node wire's rows are validated, on a wire fitted from their own references,
    whose bandwidth is what the file that sent the largest all-to-all measured (a decode file's small
    messages measure latency as much as bandwidth)."""
    rows = planner.load_rows(REPO_RESULTS)
    emulated = [r for r in rows if r.wire == "emulated-internode" and planner.setup_of(r) is not None]
    if not emulated:
        pytest.skip("no emulated-internode rows among the repository's results")
    link = planner.calibrate_simulator(rows).links["emulated-internode"]
    assert link.source.startswith("raw all_to_all_single") and link.samples > 0
    measured = [
        (r.meta["wire_all_to_all_bytes"], r.meta["wire_all_to_all_GBps"])
        for r in emulated
        if "wire_all_to_all_GBps" in r.meta and "wire_all_to_all_bytes" in r.meta
    ]
    assert measured and link.GBps == pytest.approx(max(measured)[1], rel=0.15)
    labels = [c.label for c in repo_checked if c.file == emulated[0].file]
    assert len(labels) == sum(r.file == emulated[0].file for r in emulated)
    assert all(label.endswith("emulated-internode") for label in labels)


# ---- the routed experts' Triton kernels: the GEMV and the tiled GEMM ---------------------------------

GEMV_GBPS = 4000.0  # the synthetic GEMV's weight read (the grouped GEMM's: GBPS)
TILED_GBPS = 3500.0  # the synthetic tiled GEMM's
EXPERT_B = 3 * HIDDEN * INTER * 2  # one bf16 expert's weights
LL_PATH = planner.DispatchPath("low_latency", "triton", "nccl", "bf16", True)
V3_EP2 = V3.with_num_experts(64)  # 32 experts per GPU at EP2, as the sbo_wire files ran


def _uniform(experts: int, rows: float) -> float:
    return expected_experts_with_rows(experts, RowDraw.uniform(experts, rows))


def test_expected_experts_with_rows_counts_uniform_draws():
    assert _uniform(2, 2) == pytest.approx(1.5)  # two rows on two experts: apart half the time
    assert _uniform(16, 1) == pytest.approx(1.0)
    assert _uniform(16, 0) == 0.0 and _uniform(1, 5) == 1.0
    assert _uniform(32, 10_000) == pytest.approx(32.0)
    # bench_gemv's draws (each row on one of L experts, uniformly): the mean count of experts hit.
    rng = random.Random(0)
    mean = statistics.mean(len({rng.randrange(16) for _ in range(32)}) for _ in range(4000))
    assert mean == pytest.approx(_uniform(16, 32), abs=0.05)


def test_the_routing_draw_is_each_tokens_distinct_top_k():
    """A layer's rows: each of the T P tokens reaching a rank picks top-k distinct experts of N, so a
    local expert gets n ~ Binomial(T P, k / N) rows (T P = R N / (k L) for R rows on the rank). With
    N = k every expert gets every token: all L have rows, each ceil(T P / 16) GEMV passes; as p -> 0
    an expert with rows has one; a small case by hand; and the mean over routed draws."""
    for tokens in (1, 8, 16, 17, 48, 128):  # EP1, 8 experts, top-8: exactly T rows on each
        draw = RowDraw.routing(V3.with_num_experts(8), 8, tokens * 8)
        assert draw == (tokens, 1.0)
        assert expected_experts_with_rows(8, draw) == 8.0
        assert expected_weight_passes(draw, 16) == math.ceil(tokens / 16)
    assert RowDraw.routing(V3.with_num_experts(16), 8, 16 * 8) == (32, 0.5)  # EP2, T = 16: 2 x 16 tokens, 8 of 16
    assert expected_weight_passes(RowDraw(10**6, 1e-12), 16) == pytest.approx(1.0)
    assert expected_experts_with_rows(8, RowDraw(10**6, 1e-12)) == pytest.approx(8e-6)
    assert expected_experts_with_rows(8, RowDraw(100, 0.0)) == 0.0
    assert expected_weight_passes(RowDraw(100, 0.0), 16) == 1.0
    # N = 8, top-2, EP4 (L = 2), T = 1: R = 2 rows on the rank, trials T P = 4, p = 1/4. n = 0..4 with
    # 81, 108, 54, 12, 1 /256: 2 (1 - 81/256) experts with rows; at one pass per row E[n | n > 0] =
    # 1 / (175/256). The uniform draw of the same 2 rows on 2 experts (Binomial(2, 1/2)): 1.5 and 4/3.
    draw = RowDraw.routing(V3.with_num_experts(8).replace(num_experts_per_tok=2), 2, 2)
    assert draw == (4, 0.25)
    assert expected_experts_with_rows(2, draw) == pytest.approx(2 * 175 / 256)
    assert expected_weight_passes(draw, 1) == pytest.approx(256 / 175)
    assert _uniform(2, 2) == pytest.approx(1.5)
    assert expected_weight_passes(RowDraw.uniform(2, 2), 1) == pytest.approx(4 / 3)
    # Routed draws (EP2, 32 experts per GPU, 16 tokens per rank, top-8 of 64): the experts hit on rank 0.
    rng = random.Random(0)
    hit, passes = [], []
    for _ in range(2000):
        counts = [0] * 32
        for _ in range(2 * 16):
            for e in rng.sample(range(64), 8):
                if e < 32:
                    counts[e] += 1
        hit.append(sum(1 for n in counts if n))
        passes += [math.ceil(n / 4) for n in counts if n]
    routed = RowDraw.routing(V3_EP2, 32, 16 * 8)
    assert statistics.mean(hit) == pytest.approx(expected_experts_with_rows(32, routed), abs=0.03)
    assert statistics.mean(passes) == pytest.approx(expected_weight_passes(routed, 4), abs=0.01)


def test_dense_path_takes_the_rows_record_then_its_codes_rule():
    """A row's recorded ``expert_path`` wins; else the rule of its code: today's by the real rows to
    expect per expert (low_latency: capacity x top-k of its P x capacity x top-k slots; alltoall:
    T x top-k; the GEMV up to 8, the tiled GEMM up to 512, torch._grouped_mm above; the code before
    ``TILED_512_SINCE`` the tiled GEMM up to 128), the GEMV code's up to 256 rows handed to the experts
    in all, padding included, older code torch._grouped_mm at every size; FP8 experts run none of them."""
    decode = planner.Setup(V3_EP2, 2, 16, LL_PATH)  # 2 x 16 x 8 = 256 slots over 32 experts, 4 rows each

    def path(tokens: int, **fields) -> str | None:
        return dense_path(replace(decode, tokens=tokens, **fields), tokens)

    assert (path(32), path(33)) == ("gemv", "tiled")  # 8 and 8.25 rows per expert
    assert (path(2048), path(2049)) == ("tiled", "grouped_mm")  # 512 and 512.25 rows per expert
    assert (path(512, dense_rule=BY_ROWS_TILED_TO_128), path(513, dense_rule=BY_ROWS_TILED_TO_128)) == (
        "tiled",
        "grouped_mm",
    )  # 128 and 128.25 rows per expert
    assert (path(16, dense_rule=GEMV_BY_ROWS), path(17, dense_rule=GEMV_BY_ROWS)) == ("gemv", "grouped_mm")
    assert path(1, dense_rule=GROUPED_MM_ONLY) == "grouped_mm"
    assert path(1, expert_path="grouped_mm") == "grouped_mm"  # kernels="torch": the record, not the rule
    assert path(1024, expert_path="gemv", dense_rule=GROUPED_MM_ONLY) == "gemv"
    assert path(16, expert_dtype="fp8") is None and path(16, expert_dtype="fp8", expert_path="gemv") is None
    alltoall = replace(decode, path=planner.DispatchPath("alltoall", dispatch_dtype="bf16", multi=True))
    assert (dense_path(alltoall, 32), dense_path(alltoall, 33)) == ("gemv", "tiled")  # no padding: 256 rows
    with pytest.raises(ValueError, match="dense_rule must be one of"):
        path(16, dense_rule="gemv")


def test_rows_take_their_dense_rule_from_their_files_date_and_their_recorded_path(tmp_path):
    """No row before the tiled GEMM records which GEMMs ran, so a file's ``meta.date`` says which rule
    its code had (``GEMV_SINCE``, ``TILED_SINCE``, ``TILED_512_SINCE``; undated: the oldest); a row that records its
    ``expert_path`` is predicted with that path whatever the rule would pick."""
    dates = {
        "old": "2026-11-30T19:22:54+00:00",
        "gemv": GEMV_SINCE,
        "before_tiled": "2026-12-01T11:23:19+00:00",
        "tiled": TILED_SINCE,
        "naive": "2026-12-01T12:00:00",  # no zone: UTC, as measure.results writes
        "tiled_512": TILED_512_SINCE,
        "undated": None,
    }
    for name, date in dates.items():
        meta = {"world_size": 2, **({"date": date} if date else {})}
        (tmp_path / f"{name}_h200x2.json").write_text(json.dumps({"meta": meta, "rows": synthetic_rows()}))
    setups = {r.file: planner.setup_of(r) for r in planner.load_rows(tmp_path)}
    rules = {file[: -len("_h200x2.json")]: s.dense_rule for file, s in setups.items() if s is not None}
    assert rules == {
        "old": GROUPED_MM_ONLY,
        "gemv": GEMV_BY_ROWS,
        "before_tiled": GEMV_BY_ROWS,
        "tiled": BY_ROWS_TILED_TO_128,
        "naive": BY_ROWS_TILED_TO_128,
        "tiled_512": BY_ROWS_PER_EXPERT,
        "undated": GROUPED_MM_ONLY,
    }
    assert all(s.expert_path is None for s in setups.values() if s is not None)
    prefill = next(r for r in synthetic_rows() if r["bench"] == "prefill")  # EP2 low_latency, 16 experts per GPU
    layer = {**prefill, "tokens_per_rank": 8, "capacity": 8}  # 2 x 8 x 8 slots over 16 experts: 8 each, the GEMV
    forced = [{**layer, "expert_kernels": "torch", "expert_path": "grouped_mm"}, {**layer, "expert_kernels": "auto"}]
    meta = {"world_size": 2, "date": TILED_SINCE}
    (tmp_path / "forced.json").write_text(json.dumps({"meta": meta, "rows": forced}))
    recorded, unrecorded = (planner.setup_of(r) for r in planner.load_rows(tmp_path / "forced.json"))
    assert recorded.expert_path == "grouped_mm" and dense_path(recorded, 8) == "grouped_mm"
    assert unrecorded.expert_path is None and dense_path(unrecorded, 8) == "gemv"


def _triton_costs() -> planner.StageCosts:
    """The toy calibration with GEMV and tiled-GEMM fits beside the grouped GEMM's (all weight-bound
    at these sizes)."""
    grouped = planner.GemmFit(weight_GBps=GBPS, TFLOPs=TFLOPS, knee=math.inf, samples=0)
    gemv = planner.GemmFit(weight_GBps=GEMV_GBPS, TFLOPs=50.0, knee=math.inf, samples=0)
    tiled = planner.GemmFit(weight_GBps=TILED_GBPS, TFLOPs=500.0, knee=math.inf, samples=0)
    return replace(_toy_costs(grouped), gemm={"bf16": grouped, GEMV: gemv, TILED: tiled})


def _routed_op(setup: planner.Setup, cal: planner.StageCosts) -> planner.Op:
    stages = stage_ops(setup, cal, "", setup.tokens, setup.sequences, setup.overlap)
    return next(op for stage in stages for op in stage if op.kind == "routed_experts")


def test_the_triton_kernels_read_the_experts_with_rows_and_ignore_a_gemm_budget():
    """Where bf16 experts run the GEMV or the tiled GEMM, each is costed from its own fit over the
    experts with rows (no path factor: neither computes a padded row), never waits for a transfer and
    ignores an SM budget; torch._grouped_mm (code before the GEMV, or more rows than the code's rule)
    is the persistent grouped GEMM over every expert, slowed by a budget. Without a kernel's fit among
    the files, the grouped GEMM's roofline stands in."""
    cal = _triton_costs()
    decode = planner.Setup(V3_EP2, 2, 16, LL_PATH)  # 256 slots over 32 experts, 4 real rows each: the GEMV
    gemv = _routed_op(decode, cal)  # 2 x 16 tokens reach the rank, each on 8 of 64 experts
    routed = RowDraw.routing(V3_EP2, 32, 128)
    assert gemv.gpu_us == pytest.approx(expected_experts_with_rows(32, routed) * EXPERT_B / (GEMV_GBPS * 1e3))
    mid = replace(decode, tokens=64)  # 1024 slots, 16 real rows each: the tiled GEMM (512 real rows)
    tiled = _routed_op(mid, cal)
    routed = RowDraw.routing(V3_EP2, 32, 512)
    assert tiled.gpu_us == pytest.approx(expected_experts_with_rows(32, routed) * EXPERT_B / (TILED_GBPS * 1e3))
    assert not gemv.persistent and not tiled.persistent
    before = _routed_op(replace(decode, dense_rule=GROUPED_MM_ONLY), cal)  # measured before the GEMV
    assert before.gpu_us == pytest.approx(gemm_us(32, 128 / 32)) and before.persistent
    gemv_code = _routed_op(replace(mid, dense_rule=GEMV_BY_ROWS), cal)  # 1024 slots > 256: torch._grouped_mm
    assert gemv_code.gpu_us == pytest.approx(gemm_us(32, 512 / 32)) and gemv_code.persistent
    for ran in (decode, mid):  # half the SMs: a GEMM twice as slow, but not these grids
        assert _routed_op(replace(ran, tbo=True, gemm_sm_budget=66), cal).gpu_us == pytest.approx(
            _routed_op(ran, cal).gpu_us
        )
    budgeted = replace(decode, tbo=True, gemm_sm_budget=66, dense_rule=GROUPED_MM_ONLY)
    assert _routed_op(budgeted, cal).gpu_us == pytest.approx(2 * before.gpu_us)
    no_fit = replace(cal, gemm={"bf16": cal.gemm["bf16"]})  # files without gemv rows: the grouped GEMM's
    assert _routed_op(decode, no_fit).gpu_us == pytest.approx(before.gpu_us)
    assert _routed_op(mid, no_fit).gpu_us == pytest.approx(gemm_us(32, 512 / 32))


def _bench_gemv_row(experts: int, rows: int, **times: float) -> dict:
    return {"bench": "gemv", "experts": experts, "rows": rows, "experts_with_rows": min(experts, rows), **times}


def test_the_gemv_is_fitted_on_bench_draws_and_predicts_layers_on_routed_ones(tmp_path):
    """bench_gemv's ``t_gemv_us`` fits the GEMV over ``experts_with_rows``, each expert's weights
    streamed once per 16 of its rows under bench_gemv's draw (each row on one of L experts, uniformly),
    at every size timed (past today's 8 rows per expert and the GEMV code's 256 rows in all: the passes
    describe the re-reads). Times that are exactly those streams give back their rate. A layer is
    predicted over its router's draw instead: with 8 experts and top-8 each gets exactly T rows, so
    ceil(T / 16) passes on all 8, fewer than the uniform draw of the same rows gives."""
    sizes = (8, 16, 256, 1024)  # 1 to 128 rows per expert on 8 experts
    one_stream = EXPERT_B / (GEMV_GBPS * 1e3)

    def bench_us(rows: int) -> float:
        draw = RowDraw.uniform(8, rows)
        return expected_experts_with_rows(8, draw) * weight_passes(GEMV, draw) * one_stream

    gemv = [{**_bench_gemv_row(8, n), "experts_with_rows": _uniform(8, n), "t_gemv_us": bench_us(n)} for n in sizes]
    _write(tmp_path / "gemv_h200x1.json", gemv)
    _write(tmp_path / "layers_h200x2.json", synthetic_rows())
    cal = planner.calibrate_simulator(planner.load_rows(tmp_path))
    fit = cal.gemm[GEMV]
    assert fit.weight_GBps == pytest.approx(GEMV_GBPS) and fit.samples == len(sizes)
    # Weight-bound (the fit's FLOP rate is the most any sample showed, which full 16-row passes exceed).
    cal = replace(cal, gemm={**cal.gemm, GEMV: replace(fit, TFLOPs=math.inf)})
    cfg = V3.with_num_experts(8)
    forced = planner.Setup(cfg, 1, 1, LL_PATH, expert_path="gemv")  # EP1, 8 experts, top-8, kernels="gemv"
    for n in sizes:
        tokens = n // 8
        layer_us = _routed_op(replace(forced, tokens=tokens), cal).gpu_us
        assert layer_us == pytest.approx(cal.triton_us(cfg, 8, n, GEMV)), n
        assert layer_us == pytest.approx(8 * math.ceil(tokens / 16) * one_stream), n
    assert bench_us(1024) == pytest.approx(8 * 8.47 * one_stream, rel=1e-3)  # the uniform draw: 8.47 passes, not 8


def test_grouped_mm_streams_the_experts_with_rows_at_the_rate_measured_for_that_many(tmp_path):
    """bench_gemv's ``t_grouped_mm_us`` gives torch._grouped_mm's weight rate by experts with rows, from
    its weight-bound rows only (a FLOP-bound row says nothing of the stream), interpolated in log2 of
    the count and flat beyond the counts measured. A layer's bf16 grouped GEMM streams the weights
    of the experts its router's draw leaves with rows at that rate: 7.5 of its 32 for 8 rows, every
    one for many."""
    rates = {8: 2000.0, 32: 3000.0}
    gemm = [
        {**_bench_gemv_row(e, e * n), "t_grouped_mm_us": e * EXPERT_B / (rates[e] * 1e3)}
        for e in rates
        for n in (1, 4, 16)
    ]
    gemm.append({**_bench_gemv_row(8, 8 * 4096), "t_grouped_mm_us": 1e6})  # FLOP-bound: not a rate sample
    gemm.append({**_bench_gemv_row(8, 8), "draw": "equal", "t_grouped_mm_us": 1.0})  # an even draw fits nothing
    _write(tmp_path / "gemv_h200x1.json", gemm)
    layers = synthetic_rows()
    for row in layers[-3:]:  # the layers' routed spans 1.3x the roofline: 1.3x the rows where FLOP-bound
        row["t_floor_routed_us"] *= 1.3
    _write(tmp_path / "layers_h200x2.json", layers)
    cal = planner.calibrate_simulator(planner.load_rows(tmp_path))
    rate = cal.grouped_mm
    assert rate is not None and rate.samples == 6
    assert cal.routed_scale(LL_PATH) == pytest.approx(1.3)  # from the 1024- and 4096-token layers
    assert [rate.GBps(e) for e in (4, 8, 16, 32, 256)] == pytest.approx([2000, 2000, 2500, 3000, 3000])
    # Weight-bound. 8 rows on a rank of 32 of the model's 64 experts (EP2): the 2 tokens that reach it
    # each pick 8 of the 64, so each of its experts has rows with probability 1 - (7 / 8)^2.
    cal = replace(cal, gemm={"bf16": replace(cal.gemm["bf16"], TFLOPs=math.inf)})
    touched = expected_experts_with_rows(32, RowDraw.routing(V3_EP2, 32, 8))
    assert touched == pytest.approx(32 * (1 - (7 / 8) ** 2))
    one_token = cal.routed_gpu_us(V3_EP2, 32, 8, "bf16", LL_PATH, "grouped_mm")
    assert one_token == pytest.approx(touched * EXPERT_B / (rate.GBps(touched) * 1e3))
    many = cal.routed_gpu_us(V3_EP2, 32, 32 * 512, "bf16", LL_PATH, "grouped_mm")
    assert many == pytest.approx(32 * EXPERT_B / (3000.0 * 1e3))


def test_expected_weight_passes_count_blocks_of_uniform_draws():
    """E[ceil(n / block) | n > 0] for n ~ Binomial(R, 1/L) (``RowDraw.uniform``): one pass while no
    expert can get more than a block; one expert gets every row; small cases by hand; never fewer with
    more rows; and the mean over bench_gemv-style draws (each row on one of L experts, uniformly)."""
    assert (
        expected_weight_passes(RowDraw.uniform(1, 16), 16) == 1.0
        and expected_weight_passes(RowDraw.uniform(32, 16), 16) == 1.0
    )
    assert (expected_weight_passes(RowDraw.uniform(1, 17), 16), expected_weight_passes(RowDraw.uniform(1, 48), 16)) == (
        2.0,
        3.0,
    )
    # L = 2, R = 3, block 2: n = 1, 2, 3 with probability 3/8, 3/8, 1/8 -> 1, 1, 2 passes, over P(n > 0) = 7/8
    assert expected_weight_passes(RowDraw.uniform(2, 3), 2) == pytest.approx((3 / 8 + 3 / 8 + 2 / 8) / (7 / 8))  # 8/7
    # L = 2, R = 4, block 2: n = 1..4 with 4, 6, 4, 1 sixteenths -> 1, 1, 2, 2 passes, over 15/16
    assert expected_weight_passes(RowDraw.uniform(2, 4), 2) == pytest.approx((4 + 6 + 8 + 2) / 15)  # 4/3
    for experts in (2, 8, 32):
        passes = [expected_weight_passes(RowDraw.uniform(experts, r), 16) for r in range(1, 600, 7)]
        assert all(a <= b + 1e-12 for a, b in zip(passes, passes[1:])), experts
    assert expected_weight_passes(RowDraw.uniform(8, 8 * 64), 16) == pytest.approx(
        4.47, abs=0.01
    )  # mean 64: 4, often 5
    rng = random.Random(0)
    draws = []
    for _ in range(2000):
        counts = [0] * 8
        for _ in range(256):
            counts[rng.randrange(8)] += 1
        draws += [math.ceil(n / 16) for n in counts if n]
    assert statistics.mean(draws) == pytest.approx(expected_weight_passes(RowDraw.uniform(8, 256), 16), abs=0.02)


def test_the_planners_gemv_block_is_the_kernels():
    """``GEMV_BLOCK_ROWS`` copies ``gemv_kernels.BLOCK_M`` and ``TILED_TILE_ROWS`` the tiled GEMM's row
    tiles by rows per expert (the planner runs without Triton, which those modules import)."""
    gemv_kernels = pytest.importorskip("moe_sbo.experts.gemv")
    assert GEMV_BLOCK_ROWS == gemv_kernels.BLOCK_M
    gemm_kernels = pytest.importorskip("moe_sbo.experts.tiled_gemm")
    for per_expert in (1, 64, 65, 128, 255, 256, 4096):
        tile_rows = next(rows for up_to, rows in TILED_TILE_ROWS if per_expert <= up_to)
        assert tile_rows == gemm_kernels.dense_config(per_expert).block_m


def test_the_gemv_costs_each_weight_pass_and_the_tiled_gemm_each_row_tile():
    """Weight-bound, the GEMV's time is its weight streams': the experts with rows times their passes,
    so twice each expert's stream at 17-32 rows on each, and more with more passes at a fixed count of
    experts with rows; the tiled GEMM streams each expert's weights once per row tile (128 rows above
    64 rows per expert), so 129 rows on each cost twice 128."""
    weights_only = planner.GemmFit(weight_GBps=GEMV_GBPS, TFLOPs=math.inf, knee=math.inf, samples=0)
    toy = _triton_costs()
    cal = replace(toy, gemm={**toy.gemm, GEMV: weights_only, TILED: weights_only})
    one_stream = EXPERT_B / (GEMV_GBPS * 1e3)
    every = V3.with_num_experts(8)  # EP1, 8 experts, top-8: every token on every expert
    assert cal.triton_us(every, 8, 8 * 16, GEMV) == pytest.approx(8 * one_stream)
    assert cal.triton_us(every, 8, 8 * 17, GEMV) == pytest.approx(16 * one_stream)
    assert cal.triton_us(every, 8, 8 * 32, TILED) == pytest.approx(8 * one_stream)
    assert cal.triton_us(every, 8, 8 * 128, TILED) == pytest.approx(8 * one_stream)  # one 128-row tile each
    assert cal.triton_us(every, 8, 8 * 129, TILED) == pytest.approx(16 * one_stream)  # a second, for one row
    times = [cal.triton_us(V3, 8, rows, GEMV) for rows in (64, 128, 256, 512, 1024)]  # all 8 experts hit
    assert all(a < b for a, b in zip(times, times[1:]))
    routed = RowDraw.routing(V3, 8, 1024)  # 8 of V3's 256 experts (EP32): 1024 tokens reach the rank
    assert times[-1] == pytest.approx(8 * expected_weight_passes(routed, 16) * one_stream, rel=1e-6)


def test_a_further_row_tile_costs_the_tiled_gemm_its_fitted_share_of_a_pass():
    """With per-thread loads each row tile past an expert's first costs ``extra_tile``'s share of a
    weight pass (a whole one for a tile size without a share); the descriptor loads' kernel and the
    GEMV keep whole passes."""
    two_tiles = RowDraw.even(8, 8 * 129)  # 129 rows on each expert: two 128-row tiles
    share = {128: 0.5}
    assert weight_passes(TILED, two_tiles, share) == pytest.approx(1.5)
    assert weight_passes(TILED, two_tiles) == weight_passes(TILED, two_tiles, {64: 0.5}) == 2.0
    assert weight_passes(TILED_TMA, two_tiles, share) == 2.0
    assert weight_passes(GEMV, RowDraw.even(8, 8 * 17), share) == 2.0  # two 16-row blocks
    random = RowDraw.uniform(8, 8 * 64)  # about half the experts past one 64-row tile
    assert weight_passes(TILED, random, {64: 0.25}) == pytest.approx(
        1 + 0.25 * (expected_weight_passes(random, 64) - 1)
    )


def test_the_extra_tile_share_is_fitted_from_bench_gemvs_two_draws():
    """Weight-bound times of 1 + a (tiles - 1) passes per expert under each draw give back a per tile
    size: 64-row tiles at 64 rows per expert, 128-row tiles at 128. Pairs whose draws need the same
    tiles (32 rows per expert), rows without the ``draw`` field (older runs) and a lone draw say
    nothing; a share is at most a whole pass."""
    shares = {64: 0.2, 128: 0.6}

    def timed(experts: int, rows: int, draw: str, share: float | None = None, **extra) -> planner.ResultRow:
        drawn = RowDraw.uniform(experts, rows) if draw == "random" else RowDraw.even(experts, rows)
        tile = 64 if rows / experts <= 64 else 128
        passes = 1 + (shares[tile] if share is None else share) * (expected_weight_passes(drawn, tile) - 1)
        row = {**_bench_gemv_row(experts, rows), "draw": draw, "t_tiled_us": 100.0 * experts * passes, **extra}
        return planner.ResultRow("gemv_h200x1.json", "gemv", row, {})

    rows = [
        timed(e, e * n, d, graph=g) for e in (8, 32) for n in (32, 64, 128) for d in ("random", "equal") for g in (0, 1)
    ]
    assert fit_extra_tile(rows) == pytest.approx(shares)
    older = [planner.ResultRow("gemv_h200x1.json", "gemv", {**_bench_gemv_row(8, 512), "t_tiled_us": 1.0}, {})]
    lone = [timed(16, 16 * 64, "random", share=0.9)]  # no equal draw of 16 experts
    assert fit_extra_tile(rows + older + lone) == pytest.approx(shares)
    dearer = [timed(8, 8 * 64, d, share=3.0) for d in ("random", "equal")]
    assert fit_extra_tile(dearer) == {64: 1.0}
    assert fit_extra_tile(older) == {}


def test_the_tiled_gemm_is_fitted_only_where_layers_run_it(tmp_path):
    """bench_gemv's ``t_tiled_us`` (the whole routed MLP on the tiled GEMM) enters the per-thread tiled
    fit only over 8 and below 256 rows per expert, where ``RoutedExperts.dense_path`` runs it with
    per-thread loads; its times at the GEMV's sizes, the descriptor loads' and torch._grouped_mm's do
    not."""
    weight_read = 16 * EXPERT_B / (TILED_GBPS * 1e3)
    in_range = [_bench_gemv_row(16, n, t_tiled_us=weight_read) for n in (136, 1024, 2064)]  # 8.5, 64, 129 each
    outside = [_bench_gemv_row(16, n, t_tiled_us=1.0) for n in (8, 128, 4096, 16384)]  # 0.5, 8, 256, 1024 each
    _write(tmp_path / "gemv_h200x1.json", in_range + outside)
    _write(tmp_path / "layers_h200x2.json", synthetic_rows())
    cal = planner.calibrate_simulator(planner.load_rows(tmp_path))
    fit = cal.gemm[TILED]
    assert fit.samples == 3 and fit.weight_GBps == pytest.approx(TILED_GBPS)
    assert GEMV not in cal.gemm  # rows without t_gemv_us fit no GEMV


def test_the_tiled_gemms_descriptor_loads_have_their_own_fit(tmp_path):
    """From 256 rows per expert the tiled GEMM loads through tensor descriptors, another rate: bench_gemv's
    tiled times there, from code that had them (dated since ``TILED_TMA_SINCE``), fit ``TILED_TMA``; a
    layer running the tiled GEMM that large (rows read in place) is costed by it. The per-thread fit
    takes none of them, nor the small sizes of the code versions that took descriptors there too."""
    tma_gbps = 2 * TILED_GBPS
    after = {"date": "2026-12-02T00:00:00+00:00", "source_sha": "today"}

    def read_us(experts: int, rows: int, gbps: float) -> float:
        """The weight streams of the tiled GEMM over bench_gemv's draw: one per expert and row tile."""
        return experts * weight_passes(TILED, RowDraw.uniform(experts, rows)) * EXPERT_B / (gbps * 1e3)

    rows = [_bench_gemv_row(16, 16 * n, t_tiled_us=read_us(16, 16 * n, TILED_GBPS)) for n in (32, 64)]
    rows += [_bench_gemv_row(16, 16 * n, t_tiled_us=read_us(16, 16 * n, tma_gbps)) for n in (256, 512)]
    (tmp_path / "gemv_today_h200x1.json").write_text(json.dumps({"meta": {"world_size": 1, **after}, "rows": rows}))
    between = {**after, "source_sha": TILED_TMA_BELOW_256[0]}
    odd = [_bench_gemv_row(16, 16 * 64, t_tiled_us=1.0)]  # descriptor loads at 64 rows per expert: left out
    (tmp_path / "gemv_between_h200x1.json").write_text(json.dumps({"meta": {"world_size": 1, **between}, "rows": odd}))
    before = [_bench_gemv_row(16, 16 * 512, t_tiled_us=1.0)]  # per-thread loads at 512: neither fit
    _write(tmp_path / "gemv_before_h200x1.json", before)
    _write(tmp_path / "layers_h200x2.json", synthetic_rows())
    assert TILED_TMA_SINCE < after["date"]
    cal = planner.calibrate_simulator(planner.load_rows(tmp_path))
    assert cal.gemm[TILED].samples == 2 and cal.gemm[TILED].weight_GBps == pytest.approx(TILED_GBPS)
    assert cal.gemm[TILED_TMA].samples == 2 and cal.gemm[TILED_TMA].weight_GBps == pytest.approx(tma_gbps)
    every = V3.with_num_experts(8)  # every token on every expert: each expert's weights read once
    path = planner.DispatchPath("low_latency", "triton", "none", "bfloat16", False, None)
    large = TMA_MIN_ROWS_PER_EXPERT
    assert cal.routed_gpu_us(every, 8, 8 * large, "bf16", path, "tiled") == pytest.approx(
        cal.triton_us(every, 8, 8 * large, TILED_TMA)
    )
    assert cal.routed_gpu_us(every, 8, 8 * 128, "bf16", path, "tiled") == pytest.approx(
        cal.triton_us(every, 8, 8 * 128, TILED)
    )


def test_the_planners_descriptor_threshold_is_the_kernels():
    """``TMA_MIN_ROWS_PER_EXPERT`` copies ``grouped_gemm_kernels``' (which imports Triton)."""
    kernels = pytest.importorskip("moe_sbo.experts.tiled_gemm")
    assert TMA_MIN_ROWS_PER_EXPERT == kernels.TMA_MIN_ROWS_PER_EXPERT


@pytest.mark.parametrize("bench", ["gather_gemm", "dense_gemm_config", "a_probe_not_yet_written"])
def test_a_kernel_probe_is_neither_validated_nor_a_calibration_sample(results, repo_checked, bench):
    """Rows of a bench that times no layer (``gather_gemm``: a GEMM reading its rows through an index;
    ``dense_gemm_config``: tile configs; any bench the simulator does not know) are no layer to validate
    and no sample of any fit, even carrying fields a layer fit reads."""
    probe = {
        "bench": bench,
        "tokens_per_rank": 128,
        "ranks": 2,
        "rows": 1001,
        "gather_us": 11.3,
        "grouped_mm_us": 638.9,
        "t_floor_route_us": 1.0,
        "t_floor_shared_us": 1.0,
        "t_floor_routed_us": 1.0,
        "t_layer_us": 1.0,
    }
    without = planner.calibrate_simulator(planner.load_rows(results))
    _write(results / f"{bench}_h200x1.json", [probe])
    rows = planner.load_rows(results)
    assert planner.setup_of(next(r for r in rows if r.get("bench") == bench)) is None
    assert replace(planner.calibrate_simulator(rows), files=()) == replace(without, files=())
    assert not any(c.file.startswith(bench) for c in planner.validate(rows))
    assert not any(c.file.startswith(("gather_gemm", "dense_gemm_config")) for c in repo_checked)


def test_decode_rows_measured_with_the_gemv_are_predicted_with_it(repo_checked, real_costs):
    """The sbo_wire files measured on both sides of the GEMV's landing, at 16 tokens per rank (EP2:
    2 x 16 x 8 = 256 slots, so the GEMV since): the older ran torch._grouped_mm, the newer (_v3) the
    GEMV, ~1/3 faster, which the grouped GEMM's roofline over-predicted by 32-47 %. With the GEMV each
    is closer, and held out they are off by a median under 20 % (the GEMV fit, one weight rate over
    three GEMV-only files, puts 32 experts with 4 rows each 12 % above bench_gemv's time: the GEMV
    streams weights faster over 32 experts than over 8)."""
    rows = planner.load_rows(REPO_RESULTS)
    for file, ran in (("sbo_wire_nvlink_h200x2.json", "grouped_mm"), ("sbo_wire_nvlink_h200x2_v3.json", "gemv")):
        setups = [s for r in rows if r.file == file and (s := planner.setup_of(r)) is not None and s.tokens == 16]
        assert setups and {dense_path(s, 16) for s in setups} == {ran}
    graph16 = [
        (r, s)
        for r in rows
        if r.file.startswith("sbo_wire_")
        and r.file.endswith("_v3.json")
        and (s := planner.setup_of(r)) is not None
        and s.tokens == 16
        and s.graph
    ]
    assert len(graph16) == 12  # 6 modes x 2 wires
    for r, s in graph16:  # each closer with the GEMV than as torch._grouped_mm
        measured = float(r.get("t_layer_us"))
        with_gemv = planner.predict(s, real_costs).t_layer_us / measured - 1
        as_grouped_mm = planner.predict(replace(s, dense_rule=GROUPED_MM_ONLY), real_costs).t_layer_us / measured - 1
        assert abs(with_gemv) < abs(as_grouped_mm), r.get("overlap")
    held_out = [
        c
        for c in repo_checked
        if c.file.startswith("sbo_wire_") and c.file.endswith("_v3.json") and " 16 tok graph " in c.label
    ]
    assert len(held_out) == 12 and statistics.median(abs(c.error) for c in held_out) < 0.2


# ---- command line -----------------------------------------------------------------------------------


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "moe_sbo", "plan", *args], capture_output=True, text=True, timeout=240, env=env
    )


def test_cli_simulate_writes_json(results, tmp_path):
    out = tmp_path / "sim.json"
    proc = _plan("--simulate", "--results", str(results), "--simulate-ep", "8", "16", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc) == {"calibration", "validation", "scaleout", "sglang", "meta"}
    assert len(doc["scaleout"]) == 2 * (1 + 3)  # EP8, EP16 x (prefill 4096; decode 32, 128, 256)
    assert {r["regime"] for r in doc["scaleout"]} == {"prefill", "decode"}
    assert all({"t_modes_us", "tbo_gain", "sbo_gain", "sglang"} <= set(r) for r in doc["scaleout"])
    assert len(doc["validation"]) == 3 and all("error" in r for r in doc["validation"])
    assert "Predicted deepseek-v3" in proc.stdout and "SGLang's published figures" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100


def test_cli_simulate_on_the_repository_results_draws_the_timeline(tmp_path):
    png = tmp_path / "timeline.png"
    proc = _plan("--simulate", "--results", str(REPO_RESULTS), "--timeline", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 10_000
    assert "Rows off by more than 15%" in proc.stdout and "measurements' own spread" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--simulate-ep", "3"], "--simulate-ep must divide the 256 routed experts of deepseek-v3"),
        (["--results", "/nonexistent/results"], "--results must be a folder of result files or one file"),
        (["--simulate-decode", "0"], "--simulate-prefill and --simulate-decode must be >= 1"),
    ],
)
def test_cli_simulate_bad_input_exits_2_in_one_line(results, argv, message):
    proc = _plan("--simulate", "--results", str(results), *argv)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_tbo_row_that_records_its_capacity_is_simulated_with_it():
    """``bench --tbo`` rows record each forward's dispatcher capacity (one micro-batch's under TBO);
    older rows do not, and then the whole batch's capacity stands in."""
    meta = {"world_size": 2}
    row = {
        "bench": "tbo",
        "dispatcher": "low_latency",
        "ep": 2,
        "tokens_per_rank": 4096,
        "regime": "prefill",
        "tbo": True,
        "delay": 0,
        "overlap": "none",
        "t_layer_us": 1.0,
        "preset": "deepseek-v3",
        "experts_per_gpu": 32,
        "num_experts": 64,
    }
    old = planner.ResultRow("tbo.json", "g", row, meta)
    new = planner.ResultRow("tbo.json", "g", {**row, "capacity": 2048}, meta)
    assert planner.setup_of(old).capacity == 4096
    assert planner.setup_of(new).capacity == 2048


def test_a_tbo_rows_micro_batches_send_the_blocks_of_their_own_capacity():
    """A ``low_latency`` TBO row records the whole batch's bytes (its wire reference's), but each
    micro-batch's dispatcher sends blocks of the half capacity the row records: the simulator charges
    those, not the reference's bytes; the row without TBO keeps its measured bytes."""
    from dataclasses import replace

    from moe_sbo.planner.simulate import phase_bytes
    from moe_sbo.planner.simulate_rows import ResultRow

    base = {
        "bench": "tbo",
        "dispatcher": "low_latency",
        "kernels": "triton",
        "transport": "nccl",
        "ep": 2,
        "experts_per_gpu": 32,
        "regime": "prefill",
        "tokens_per_rank": 4096,
        "sequences_per_rank": 2,
        "overlap": "none",
        "delay": 0,
        "t_layer_us": 1.0,
        "dispatch_bytes_sent": 1e9,
        "combine_bytes_sent": 5e8,
    }
    plain = planner.setup_of(ResultRow("f.json", "g", {**base, "tbo": False, "capacity": 4096}, {}))
    tbo = planner.setup_of(ResultRow("f.json", "g", {**base, "tbo": True, "capacity": 2048}, {}))
    assert phase_bytes(plain, 4096) == ((1e9, 0.0), (5e8, 0.0))
    (dispatch, _), (combine, _) = phase_bytes(tbo, 2048)
    (whole_dispatch, _), (whole_combine, _) = phase_bytes(replace(tbo, capacity=4096), 4096)
    assert (dispatch, combine) == (whole_dispatch / 2, whole_combine / 2)

"""Smoke test of ``moe-sbo bench`` (``sbo``, the default mode, and ``tbo``) on 2 CPU ranks: every
dispatcher x every mode gets a row with the result-file fields, efficiency and speedup are computed
against ``none``, and the timeline is drawn.
It checks that the benchmark works, not what it measures (CPU times are not GPU numbers)."""

from __future__ import annotations

import io
import json

import pytest
import torch.distributed as dist
from rich.console import Console

from in_process import InProcess
from moe_sbo.bench import sweep
from moe_sbo.cli.main import main
from moe_sbo.cli.parsers import parse_args
from moe_sbo.dispatch import DISPATCHERS
from moe_sbo.measure import progress, run
from moe_sbo.measure.trace import load_spans
from moe_sbo.overlap import OVERLAP_MODES

FIELDS = (
    "bench",
    "preset",
    "ep",
    "tokens_per_rank",
    "dispatcher",
    "overlap",
    "tbo",
    "dtype",
    "graph",
    "t_layer_us",
    "t_dispatch_us",
    "t_combine_us",
    "t_shared_us",
    "t_routed_us",
    "t_comm_us",
    "t_ideal_us",
    "efficiency",
    "speedup_vs_none",
    "bytes_sent",
    "bytes_recv",
    "experts_per_gpu",
)


def test_bench_sweep_rows_and_timeline(tmp_path):
    out, png = tmp_path / "sbo.json", tmp_path / "timeline.png"
    code = main(
        [
            "bench",
            "--device",
            "cpu",
            "--ranks",
            "2",
            "--preset",
            "tiny",
            "--experts",
            "16",
            "8",
            "--tokens",
            "4",
            "24",
            "--warmup",
            "0",
            "--iters",
            "2",
            "--out",
            str(out),
            "--timeline",
            str(png),
            "--trace",
            str(tmp_path / "trace"),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    dispatchers = sorted(set(DISPATCHERS) - {"local"})
    assert len(rows) == 2 * len(dispatchers) * 2 * len(OVERLAP_MODES)
    assert {r["experts_per_gpu"] for r in rows} == {8, 4}
    for row in rows:
        assert all(field in row for field in FIELDS), sorted(set(FIELDS) - set(row))
        assert row["t_layer_us"] > 0 and row["t_shared_us"] > 0 and row["t_comm_us"] > 0
        assert row["expert_path"] == "grouped_mm"  # CPU: torch's grouped GEMM whatever the rows
        if row["overlap"] == "none":
            assert row["speedup_vs_none"] == 1.0 and row["efficiency"] == 0.0
        if row["overlap"] == "auto":
            assert all(choice in OVERLAP_MODES for choice in row["auto_choice"])
        # --transport reaches the dispatcher that has one (auto: NCCL/gloo on CPU); the others say None.
        assert row["transport"] == ("auto" if row["dispatcher"] == "low_latency" else None)
    assert result["meta"]["world_size"] == 2
    assert png.stat().st_size > 10_000
    spans = load_spans(png.with_suffix(".spans.json"))
    assert set(spans) == {f"{d} / {m}" for d in dispatchers for m in OVERLAP_MODES if m != "auto"}
    kinds = {s.kind for s in spans["alltoall / dispatch"]}
    assert {"router", "dispatch", "routed_experts", "combine", "shared_experts"} <= kinds
    assert (tmp_path / "trace.split.json").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sbo", "--overlap", "sideways"], "--overlap must be among"),
        (["sbo", "--dispatcher", "deepep"], "--dispatcher must be among"),
        (["sbo", "--ranks", "3"], "divisible by the EP size"),
        (["sbo", "--ranks", "0"], "--ranks must be >= 1, got 0; leave it out for the default"),
        (["tbo", "--prefill-tokens", "--decode-seqs"], "--decode-seqs must give at least one size, got neither"),
        (["tbo", "--delay", "-1"], "--delay must be >= 0, got -1"),
        (["eplb", "--tokens", "0"], "--tokens must be >= 1, got 0; leave --tokens out for its default"),
        (["sbo", "--tokens", "0"], "--tokens must be >= 1, got 0; leave --tokens out for its default"),
        (["sbo", "--transport", "symm_mem"], "--transport symm_mem needs CUDA and >= 2 ranks"),
        (["tbo", "--transport", "copy_engine"], "--transport copy_engine needs CUDA and >= 2 ranks"),
        (
            ["sbo", "--index-rows", "--dispatcher", "alltoall"],
            "--index-rows is an option of the low_latency dispatcher",
        ),
    ],
)
def test_bench_bad_input_exits_2(argv, message, capsys):
    mode, *options = argv
    assert main(["bench", mode, "--device", "cpu", "--ranks", "2", "--preset", "tiny", *options]) == 2
    assert message in capsys.readouterr().err


def test_bench_tbo_rows_per_delay_and_timeline(tmp_path):
    out, png = tmp_path / "tbo.json", tmp_path / "tbo.png"
    code = main(
        [
            "bench",
            "tbo",
            "--device",
            "cpu",
            "--ranks",
            "2",
            "--preset",
            "tiny",
            "--dispatcher",
            "alltoall",
            "low_latency",
            "--overlap",
            "none",
            "split",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--prefill-tokens",
            "96",
            "--decode-seqs",
            "4",
            "--kv-len",
            "16",
            "--delay",
            "0",
            "2",
            "--auto-tbo",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--out",
            str(out),
            "--timeline",
            str(png),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    # 2 dispatchers x 2 sizes x 2 modes x (no TBO + 2 delays + AutoTbo's choice)
    assert len(rows) == 2 * 2 * 2 * 4
    fixed = [r for r in rows if r["tbo_policy"] == "fixed"]
    assert {(r["tbo"], r["delay"]) for r in fixed} == {(False, None), (True, 0), (True, 2)}
    auto = [r for r in rows if r["tbo_policy"] == "auto"]
    assert len(auto) == 2 * 2 * 2 and all(r["delay"] == (0 if r["tbo"] else None) for r in auto)
    for row in rows:
        assert row["bench"] == "tbo" and row["t_layer_us"] > 0 and row["experts_per_gpu"] == 8
        if row["overlap"] == "none" and not row["tbo"] and row["tbo_policy"] == "fixed":
            assert row["speedup_vs_none"] == 1.0
        # The physical references: the whole batch's compute, each part alone, and the raw wire.
        parts = ("attention", "route", "routed", "shared")
        assert all(row[f"t_floor_{part}_us"] > 0 for part in parts), row
        assert row["t_floor_us"] == pytest.approx(sum(row[f"t_floor_{part}_us"] for part in parts), rel=1e-2)
        assert row["t_wire_us"] == pytest.approx(row["ref_t_dispatch_us"] + row["ref_t_combine_us"], rel=1e-2)
        limit = max(row["t_floor_us"], row["t_wire_us"])
        assert row["limit_ratio"] == pytest.approx(row["t_layer_us"] / limit, rel=1e-2)  # fields are rounded
        # A fixed-capacity dispatcher is sized for what one forward sends: the whole batch without
        # TBO, the larger micro-batch with it (96 prefill tokens split 48 + 48; 4 sequences 2 + 2).
        if row["dispatcher"] == "low_latency":
            tokens = row["tokens_per_rank"]
            assert row["capacity"] == (tokens // 2 if row["tbo"] else tokens), row
        else:
            assert row["capacity"] is None
    # Measured once per size: every row of a (dispatcher, size) carries the same references.
    for key in {(r["dispatcher"], r["tokens_per_rank"]) for r in rows}:
        same = [r for r in rows if (r["dispatcher"], r["tokens_per_rank"]) == key]
        assert len({(r["t_floor_us"], r["t_wire_us"]) for r in same}) == 1
    spans = load_spans(png.with_suffix(".spans.json"))
    assert {"alltoall / no TBO", "alltoall / TBO", "alltoall / TBO + SBO split"} <= set(spans)
    assert "attention" in {s.kind for s in spans["alltoall / TBO"]}


def _tbo_capacity_rank(device, lengths_per_rank):
    from moe_sbo.bench.tbo import _decoder, _tbo_dispatcher
    from moe_sbo.decoder.attention import Batch

    spec = {
        "preset": "tiny",
        "num_experts": 8,
        "dispatcher": "low_latency",
        "dtype": "float32",
        "seed": 0,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "transport": "auto",
    }
    batch = Batch.prefill(lengths_per_rank[dist.get_rank()], device=device)
    layer = _decoder(device, spec, 100)  # the whole-batch layer, as the bench sizes it (--prefill-tokens)
    dispatcher, capacity = _tbo_dispatcher(layer, spec, batch)
    # The TBO dispatcher runs on the layer's own weights: no second layer.
    return capacity, dispatcher.settings.max_tokens_per_rank, layer.moe.dispatcher.settings.max_tokens_per_rank


def test_bench_tbo_sizes_every_rank_for_the_largest_micro_batch_of_any_rank(ranks2):
    """Each rank splits its own batch (here 50 + 47 tokens on rank 0, 48 + 48 on rank 1): the TBO
    dispatcher's capacity must still be the same everywhere (low_latency refuses unlike buffers)."""
    results = ranks2.run(_tbo_capacity_rank, [[50, 47], [48, 48]])
    assert results == [(50, 50, 100), (50, 50, 100)]


def test_bench_index_rows_reach_low_latency_and_its_rows(tmp_path):
    # --index-rows: low_latency leaves the received rows in place (the experts gather them on CPU),
    # and its rows say so (the outputs' equality is tests/dispatch/test_low_latency.py's).
    out = tmp_path / "sbo.json"
    argv = ["bench", "--device", "cpu", "--ranks", "2", "--preset", "tiny", "--dispatcher", "low_latency"]
    argv += ["--overlap", "none", "--tokens", "6", "--warmup", "0", "--iters", "1", "--index-rows", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["index_rows"] is True and r["dispatcher"] == "low_latency" for r in rows)


# ---- what a sweep prints and records -------------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch):
    """A terminal wider than the output (rich folds nothing); one rank, in this process."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(run, "LocalRanks", InProcess)
    monkeypatch.setattr(run, "RankPool", InProcess)


def test_bench_default_output_is_short_and_ends_on_the_best_mode(tmp_path, capsys):
    """Two expert counts x 2 dispatchers x 2 token counts x 2 modes: one summary line per expert
    count, token count and dispatcher (not per mode), GB/s beside the time, a few lines of context, and
    last the best mode per expert count; the rows record the wire the run crossed and their GB/s."""
    out = tmp_path / "sbo.json"
    argv = ["bench", "--device", "cpu", "--ranks", "2", "--preset", "tiny", "--experts", "16", "8"]
    argv += ["--dispatcher", "alltoall", "low_latency", "--overlap", "none", "split", "--tokens", "4", "8"]
    assert main([*argv, "--warmup", "0", "--iters", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("E/GPU"))
    assert header.split() == ["E/GPU", "tokens", "dispatcher", "none", "µs", "split", "GB/s"]
    assert len(lines) <= 20 and "weights" not in "\n".join(lines)  # the memory's parts: --detail
    assert lines[-3] == f"16 rows, 0 errors; written to {out}"
    assert lines[-2].startswith("best at 8 experts/GPU: 4 tokens ") and "; 8 tokens " in lines[-2]
    assert lines[-1].startswith("best at 4 experts/GPU: 4 tokens ")
    result = json.loads(out.read_text())
    assert result["meta"]["summary"] == lines[-2:]
    assert result["meta"]["partial"] is False and "partial_reason" not in result["meta"]  # the sweep ended
    assert result["meta"]["wire"] == "gloo-cpu" and {r["wire"] for r in result["rows"]} == {"gloo-cpu"}
    for row in result["rows"]:
        for phase in ("dispatch", "combine"):
            expected = row[f"{phase}_bytes_sent"] / row[f"t_{phase}_us"] / 1e3
            assert row[f"{phase}_GBps"] == pytest.approx(expected, rel=1e-2) and expected > 0
            assert row[f"ref_{phase}_GBps"] > 0  # the raw all_to_all_single of the same bytes
        both = (row["dispatch_bytes_sent"] + row["combine_bytes_sent"]) / (row["t_dispatch_us"] + row["t_combine_us"])
        assert row["comm_GBps"] == pytest.approx(both / 1e3, rel=1e-2)
        assert row["dispatch_bytes_sent"] + row["combine_bytes_sent"] == row["bytes_sent"]


def test_bench_detail_adds_every_mode_and_phase(in_process, capsys):
    argv = ["bench", "--device", "cpu", "--ranks", "1", "--dispatcher", "local", "--overlap", "none", "split"]
    assert main([*argv, "--tokens", "4", "--iters", "1", "--detail"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[1].startswith("  weights") and lines[2].startswith("  activations")  # the memory's parts
    assert "single-batch overlap (µs: slowest rank, median)" in printed  # the per-mode table and its phases
    rows = [line.split() for line in lines if line.split()[:3] == ["16", "4", "local"]]
    # The summary's line (time with none, split's speedup, GB/s), then a line per mode with its phases.
    assert [len(row) for row in rows] == [6, 12, 12] and [row[3] for row in rows[1:]] == ["none", "split"]
    assert rows[0][-1] == "-"  # one rank: no byte crosses a link, so no GB/s is claimed
    assert lines[-1].startswith("best: 4 tokens local/")


def test_bench_progress_is_on_stderr_and_off_stdout(in_process, monkeypatch, capsys):
    """On a terminal the sweep's bar is drawn on stderr (``progress.progress_console``, as every
    command's); stdout holds the tables and ends on the conclusion, with no bar left in it."""
    drawn = io.StringIO()
    terminal = Console(file=drawn, force_terminal=True, width=100)
    monkeypatch.setattr(progress, "progress_console", lambda: terminal)
    argv = ["bench", "--device", "cpu", "--ranks", "1", "--dispatcher", "local", "--overlap", "none", "split"]
    assert main([*argv, "--tokens", "4", "8", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "E=16 local T=8" in drawn.getvalue() and "━" in drawn.getvalue()
    assert "E=16 local" not in out and "━" not in out and "%" not in out
    assert out.splitlines()[-1].startswith("best: 4 tokens local/")


def test_wire_label_says_what_the_run_crosses(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert sweep.wire_label("cpu", 1) == "none" and sweep.wire_label("cuda", 1) == "none"
    assert sweep.wire_label("cpu", 4) == "gloo-cpu"
    monkeypatch.setattr(sweep, "shared_gpu_note", lambda device, ranks: "2 ranks share 1 GPU(s)")
    assert sweep.wire_label("cuda", 2) == "shared-gpu"
    monkeypatch.setattr(sweep, "shared_gpu_note", lambda device, ranks: None)
    for peers, label in ((True, "nvlink"), (False, "host-memory")):
        monkeypatch.setattr(sweep, "peer_to_peer", lambda ranks, peers=peers: peers)
        assert sweep.wire_label("cuda", 2) == label
        args = parse_args(["bench"])
        assert sweep.resolve_wire(args, "cuda", 2) is None and args.wire == label
    # NCCL_P2P_DISABLE=1 in the environment (the ranks inherit it) is the emulated wire, --wire or not.
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert sweep.wire_label("cuda", 2) == "emulated-internode" and sweep.wire_label("cpu", 2) == "gloo-cpu"
    args = parse_args(["bench"])
    assert sweep.resolve_wire(args, "cuda", 2).startswith("NCCL_P2P_DISABLE=1: low_latency uses --transport nccl")
    assert args.wire == "emulated-internode" and args.transport == "nccl"
    with pytest.raises(ValueError, match="got it with NCCL_P2P_DISABLE=1; use --transport nccl"):
        sweep.resolve_wire(parse_args(["bench", "--transport", "symm_mem"]), "cuda", 2)

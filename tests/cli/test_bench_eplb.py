"""Expert load balancing on the command line: ``bench eplb`` on 2 CPU ranks (rows, balance measured
before and after, a load file that ``--skew`` and ``plan --load`` read back), ``plan --skew/--load``,
``demo --eplb``, widths, and bad input refused in one line before any rank starts. CPU times show that
the commands work, not what a GPU measures."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from in_process import InProcess
from moe_sbo.bench import eplb as bench_eplb
from moe_sbo.cli.main import main
from moe_sbo.cli.parsers.common import PLACEMENT_POLICY_NAMES
from moe_sbo.config import get_preset
from moe_sbo.eplb import PLACEMENT_POLICIES, zipf_load
from moe_sbo.layer import MoELayer
from moe_sbo.measure import run

WIDTH = 100


@pytest.fixture
def no_ranks(monkeypatch):
    """Bad input must be refused before any rank (and so any collective) starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started for bad input")

    monkeypatch.setattr(run, "LocalRanks", refuse)
    monkeypatch.setattr(run, "RankPool", refuse)


@pytest.fixture
def in_process(monkeypatch):
    """A terminal wider than the output must be (rich folds nothing); one rank, in this process."""
    monkeypatch.setenv("COLUMNS", str(2 * WIDTH))
    monkeypatch.setattr(run, "LocalRanks", InProcess)
    monkeypatch.setattr(run, "RankPool", InProcess)


def _fits(text: str) -> list[str]:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
    return lines


def _load_file(path, load: list[float], preset: str = "tiny") -> str:
    path.write_text(json.dumps({"meta": {}, "load": load, "num_experts": len(load), "preset": preset}))
    return str(path)


def test_the_parser_names_every_placement_policy():
    assert PLACEMENT_POLICY_NAMES == PLACEMENT_POLICIES


# ---- bench eplb ---------------------------------------------------------------------------------


def test_bench_eplb_on_two_ranks_balances_and_records_the_load(tmp_path, capsys):
    out, load = tmp_path / "eplb.json", tmp_path / "load.json"
    argv = ["bench", "eplb", "--device", "cpu", "--ranks", "2", "--dispatcher", "alltoall", "--tokens", "16"]
    argv += ["--redundant", "0", "1", "--warmup", "0", "--iters", "2", "--out", str(out), "--record-load", str(load)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["policy"] == "global" and result["meta"]["skew"] == ["zipf:1"]
    rows = result["rows"]
    assert [(r["bench"], r["redundant_per_rank"], r["slots_per_rank"]) for r in rows] == [
        ("eplb", 0, 8),
        ("eplb", 1, 9),
    ]
    cfg = get_preset("tiny")
    per_slot = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # gate, up, down in float32
    for r in rows:
        # The Zipf(1) router loads one rank far more; the rebalance evens it out, measured on held-out tokens.
        assert r["load_max_over_mean_before"] > 1.2 and r["load_max_over_mean_after"] < 1.1
        assert r["predicted_max_over_mean_after"] <= r["predicted_max_over_mean_before"]
        assert r["predicted_max_over_mean_after"] == pytest.approx(r["load_max_over_mean_after"], abs=0.1)
        assert sum(r["received_rows_before"]) == sum(r["received_rows_after"]) == 2 * 4096 * cfg.num_experts_per_tok
        assert r["moved_slots"] > 0 and r["moved_bytes"] == r["moved_slots"] * per_slot
        assert sum(r["sent_bytes_per_rank"]) == r["moved_bytes"]
        assert r["t_rebalance_ms"] > 0 and r["layer_ms_before"] > 0 and r["layer_ms_after"] > 0
        assert r["eplb_overhead"] is None  # CUDA graphs only
        assert 0.9 < r["skew_reached"] <= 1 and r["skew_measured_max_over_mean"] <= 4.0 + 1e-9
    recorded = json.loads(load.read_text())
    assert recorded["num_experts"] == 16 and recorded["preset"] == "tiny" and recorded["meta"]["world_size"] == 2
    # One step's window: 32 forwards of 16 tokens on 2 ranks, K = 4 picks each.
    assert sum(recorded["load"]) == 32 * 16 * 2 * cfg.num_experts_per_tok
    printed = capsys.readouterr().out
    assert "expert load balancing, global, skew zipf:1: rank load max/mean, measured" in printed
    assert f"load of 16 experts written to {load}" in printed
    # The recorded load feeds the planner and the next bench.
    assert main(["plan", "--model", "tiny", "--load", str(load), "--eplb-ep", "2", "4"]) == 0
    assert f"the load: {load}, 16 experts, the hottest " in capsys.readouterr().out


def _documented(prefix: str) -> list[list[str]]:
    """The commands README.md and docs/EPLB.md give that start with ``prefix``, as argv (no comment)."""
    root = Path(__file__).parents[2]
    lines = [line for doc in ("README.md", "docs/EPLB.md") for line in (root / doc).read_text().splitlines()]
    found = [shlex.split(line.split("#")[0])[1:] for line in lines if line.startswith(prefix)]
    assert found, f"no {prefix!r} in README.md or docs/EPLB.md"
    return found


def _option(argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with ``name``'s value replaced by ``value``."""
    index = argv.index(name)
    return [*argv[: index + 1], value, *argv[index + 2 :]]


def test_the_documented_record_then_plan_chain_runs_as_written_on_cpu(tmp_path, monkeypatch, capsys):
    """``bench --eplb ... --record-load load.json`` then ``plan --load load.json --eplb-ep ...``, as
    the docs write them (bench on 2 CPU ranks at 16 tokens; plan word for word): plan takes the
    model the load was recorded on, bench's CPU default (tiny), not its own default."""
    monkeypatch.chdir(tmp_path)
    recording = [argv for argv in _documented("moe-sbo bench") if "--record-load" in argv]
    assert len({" ".join(sorted(argv)) for argv in recording}) == 1, recording  # one command, in any order
    bench_argv = _option(_option(recording[0], "--ranks", "2"), "--tokens", "16")
    assert main([*bench_argv, "--device", "cpu", "--warmup", "0", "--iters", "2"]) == 0
    assert json.loads((tmp_path / "load.json").read_text())["preset"] == "tiny"
    capsys.readouterr()
    for plan_argv in {tuple(argv) for argv in _documented("moe-sbo plan --load load.json")}:
        assert main(list(plan_argv)) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "Expert load balance, tiny: max/mean rank load" in out and "the load: load.json, 16 experts" in out


def test_bench_eplb_fits_100_columns_and_reads_a_load_file(in_process, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short relative path: a long one wraps its note, whatever the width
    skew = _load_file(Path("load.json"), [8.0, 1.0] + [2.0] * 14)
    argv = ["bench", "eplb", "--ranks", "1", "--dispatcher", "local", "--tokens", "8", "--iters", "1"]
    assert main([*argv, "--skew", skew, "--policy", "hierarchical", "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out.replace(skew, "LOAD"))
    assert lines[-2] == "1 rows, 0 errors; not written (no --out)"
    assert lines[-1].startswith("best balance: 8 tokens local +0 slots: load max/mean ")
    assert any(line.startswith("skew LOAD on 16 experts: ") for line in lines)


def test_bench_eplb_trivial_policy_keeps_experts_in_place(in_process, capsys, tmp_path):
    out = tmp_path / "trivial.json"
    argv = ["bench", "eplb", "--ranks", "1", "--dispatcher", "alltoall", "--tokens", "8", "--iters", "1"]
    assert main([*argv, "--policy", "trivial", "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["policy"] == "trivial" and row["redundant_per_rank"] == 0 and row["moved_slots"] == 0
    assert result["meta"]["wire"] == row["wire"] == "none"  # one rank: no link between ranks


def test_statistics_overhead_times_graph_replays_of_the_layer_with_and_without_eplb(monkeypatch):
    """CUDA only in a run; here its plumbing, with the graph timer replaced by one that records and
    answers 100 µs without the statistics, 101 µs with, and 0.5 µs per statistics step alone."""
    calls = []

    def timer(fn, device, warmup, iters, graph):
        out = fn()
        layer = getattr(fn, "func", None)
        calls.append((graph, "stats" if layer is None else layer.eplb is not None))
        if layer is None:  # the statistics step: the physical slot ids of the layer's routing
            assert out.shape == (8, cfg.num_experts_per_tok)
            return 0.5 * bench_eplb.STATS_REPEAT
        return 101.0 if layer.eplb is not None else 100.0

    monkeypatch.setattr(bench_eplb, "time_fn", timer)
    cfg = get_preset("tiny")
    x_TH = torch.randn(8, cfg.hidden_size)
    spec = {"target": zipf_load(16, 1.0).tolist(), "seed": 0, "warmup": 0, "iters": 1}
    fit, bias_E, overhead = bench_eplb.statistics_overhead(lambda eplb: MoELayer(cfg, eplb=eplb), spec, x_TH)
    assert calls == [(True, False), (True, True), (True, "stats")] * bench_eplb.OVERHEAD_ROUNDS
    assert overhead == {
        "t_layer_graph_us_plain": 100.0,
        "t_layer_graph_us_eplb": 101.0,
        "t_stats_graph_us": 0.5,
        "eplb_overhead": pytest.approx(0.01),
        "stats_share": pytest.approx(0.005),
    }
    assert set(overhead) == set(bench_eplb.OVERHEAD_FIELDS)
    assert fit.reached > 0.9 and bias_E.shape == (16,)


# ---- plan --load / --skew ------------------------------------------------------------------------


def test_plan_skew_prints_the_balance_table_and_writes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    out = tmp_path / "plan.json"
    assert main(["plan", "--skew", "zipf:1", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("verdict: ")
    start = next(i for i, line in enumerate(lines) if "Expert load balance, deepseek-v3: max/mean rank load" in line)
    assert "the load: zipf:1, 256 experts, the hottest 41.80x the mean" in lines
    table = [line.split() for line in lines[start + 3 : start + 12]]
    assert [(row[0], row[1], row[2]) for row in table] == [
        (ep, n, nodes) for ep, nodes in (("8", "1"), ("32", "4"), ("64", "8")) for n in ("0", "1", "2")
    ]
    assert all(line.split()[-1].endswith("x") for line in lines[start + 3 : start + 12])
    doc = json.loads(out.read_text())["load_balance"]
    assert doc["source"] == "zipf:1" and len(doc["rows"]) == 9 and doc["rows"][0]["ep"] == 8


# ---- demo --eplb ---------------------------------------------------------------------------------


def test_demo_eplb_rebalances_and_still_matches_the_reference(capsys):
    argv = ["demo", "--eplb", "--device", "cpu", "--ranks", "2", "--dispatcher", "alltoall", "--iters", "1"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "1/1 dispatcher x overlap runs match the single-rank reference; 1/1 equal overlap none bitwise"
    start = next(i for i, line in enumerate(lines) if "expert load balancing: rank load max/mean" in line)
    dispatcher, overlap, before, after, moved, _, rel, ok = lines[start + 3].split()
    assert (dispatcher, overlap, ok) == ("alltoall", "none", "yes")
    assert float(before) > 1.1 and float(after) < float(before) and int(moved) > 0 and float(rel) < 1e-5


def test_demo_eplb_fits_100_columns(in_process, capsys):
    argv = ["demo", "--eplb", "--ranks", "1", "--dispatcher", "local", "--tokens", "8", "--iters", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    assert _fits(capsys.readouterr().out)[-1].startswith("1/1 dispatcher x overlap runs match")


# ---- refused before any rank starts --------------------------------------------------------------

BENCH = ["bench", "--device", "cpu", "--ranks", "2"]
EPLB = ["bench", "eplb", "--device", "cpu", "--ranks", "2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [*EPLB, "--skew", "zipf:x"],
            "--skew zipf:S needs an exponent S >= 0, got 'zipf:x'; e.g. --skew zipf:1.2 (zipf:0 is an even load)",
        ),
        (
            [*EPLB, "--redundant", "-1"],
            "--redundant must be >= 0 (extra expert slots per rank), got -1; e.g. --redundant 0 1 2",
        ),
        (
            [*EPLB, "--experts", "16", "8", "--record-load", "load.json"],
            "--record-load writes the load of one expert count, got --experts 16 8; give one --experts value",
        ),
        (
            [*EPLB, "--policy", "trivial", "--redundant", "1"],
            "--redundant 1 with --policy trivial on 2 ranks and 16 experts cannot be placed: policy 'trivial' places "
            "no redundant experts",
        ),
        (
            [*EPLB, "--redundant", "9"],
            "--redundant 9 with --policy global on 2 ranks and 16 experts cannot be placed: redundant_per_rank=9 "
            "asks for 18 extra replicas",
        ),
        (
            ["demo", "--device", "cpu", "--eplb", "--tbo"],
            "--eplb and --tbo are separate demos, got both; run one, then the other",
        ),
        (
            ["demo", "--device", "cpu", "--ranks", "2", "--eplb", "--dispatcher", "local"],
            "--eplb moves experts between ranks, but --dispatcher local holds every expert on each of the 2 ranks; "
            "choose another --dispatcher, or --ranks 1",
        ),
        (
            ["demo", "--device", "cpu", "--eplb", "--checkpoint", "model"],
            "--eplb runs --preset's random weights skewed to a Zipf load, got --checkpoint; leave one of them out",
        ),
        (["plan", "--skew", "zipf:-1"], "--skew zipf:S needs an exponent S >= 0, got 'zipf:-1'"),
        (["plan", "--load", "zipf:1"], "--load must be a load file, got 'zipf:1'; use --skew zipf:1 for a Zipf load"),
        (
            ["plan", "--eplb-ep", "8"],
            "--eplb-ep sizes the load-balance table, which needs a load, got --eplb-ep without one; add --load FILE "
            "or --skew zipf:S, or leave it out",
        ),
        (
            ["plan", "--skew", "zipf:1", "--eplb-ep", "6"],
            "--eplb-ep must be EP sizes that divide the 256 routed experts of deepseek-v3, got [6]; choose among",
        ),
        (["plan", "--skew", "zipf:1", "--redundant", "-1"], "--redundant must be counts >= 0"),
        ([*BENCH, "--expert-dtype", "fp8"], "--expert-dtype fp8 needs hidden_size and moe_intermediate_size that"),
    ],
)
def test_bad_eplb_input_is_refused_in_one_line(argv, message, capsys, no_ranks):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-sbo {argv[0]}: error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, option",
    [
        ([*EPLB, "--tbo"], "--tbo"),
        ([*BENCH, "--redundant", "1"], "--redundant"),
        ([*EPLB, "--timeline", "t.png"], "--timeline"),
        ([*EPLB, "--overlap", "split"], "--overlap"),
    ],
)
def test_an_option_of_another_bench_mode_is_a_usage_error(argv, option, capsys, no_ranks):
    """Each mode has its own parser: what another mode takes is refused, not ignored."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"error: unrecognized arguments: {option}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_a_load_file_of_another_model_is_refused_naming_both(command, tmp_path, capsys, no_ranks):
    skew = _load_file(tmp_path / "v3.json", [1.0] * 256, preset="deepseek-v3")
    flag = "--skew" if command == "bench" else "--load"
    argv = [*EPLB] if command == "bench" else ["plan", "--model", "tiny"]
    assert main([*argv, flag, skew]) == 2
    assert capsys.readouterr().err == (
        f"moe-sbo {command}: error: {flag} {skew} must hold one load per expert of tiny (16), got 256 "
        "(recorded on deepseek-v3); use a load recorded with the same model and expert count, or zipf:S\n"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "--skew must be zipf:S or a load file, got '{path}', which does not exist; record one with"),
        ("not json", "--skew {path} must be a JSON load file, but it cannot be read: "),
        ('{"load": "x"}', '--skew {path} must hold {{"load": [one number per expert], ...}}, got no such list'),
        (json.dumps({"load": [0.0] * 16}), "--skew {path} must hold finite loads >= 0, not all 0; record it again"),
    ],
)
def test_a_bad_load_file_is_refused(content, message, tmp_path, capsys, no_ranks):
    path = tmp_path / "load.json"
    if content is not None:
        path.write_text(content)
    assert main([*EPLB, "--skew", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-sbo bench: error: " + message.format(path=path)), err

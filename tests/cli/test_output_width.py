"""What every subcommand prints fits the terminal without a name cut: at 80 columns (a common
terminal, an 80x60 tmux pane) no table cuts a name (no ``…``, no two rows alike) and notes wrap; at
100, or laid out for a wider terminal, no line is longer than 100 (``plan``'s prose columns wrap).
Every command ends with its verdict or result line. The commands run in this process on one rank
(``InProcess``): their own printing, no start-up."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hf_blocks import make_hf_model, write_published_v3
from in_process import InProcess
from moe_sbo.cli import demo_report, generate
from moe_sbo.cli.main import main
from moe_sbo.measure import options, progress, run

WIDTH = 100


@pytest.fixture
def narrow(monkeypatch):
    """A terminal wider than the output must be (rich folds nothing); the ranks in this process."""
    monkeypatch.setenv("COLUMNS", str(2 * WIDTH))
    in_process(monkeypatch)


def in_process(monkeypatch):
    monkeypatch.setattr(run, "LocalRanks", InProcess)
    monkeypatch.setattr(run, "RankPool", InProcess)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The tiny random Qwen3-MoE checkpoint of docs/CHECKPOINTS.md (2 layers, 8 experts)."""
    path = tmp_path_factory.mktemp("qwen3")
    make_hf_model("qwen3_moe", seed=3).save_pretrained(path)
    return path


def _fits(text: str, path=None, width: int = WIDTH) -> list[str]:
    """``text``'s lines, each <= ``width`` columns but for one naming ``path`` (printed whole, never broken)."""
    lines = text.splitlines()
    measured = [line for line in lines if path is None or str(path) not in line]
    assert measured and max(len(line) for line in measured) <= width, max(measured, key=len)
    return lines


def table_rows(lines: list[str]) -> list[list[str]]:
    """Each table's body rows: the lines after a header rule, as wide as the rule."""
    tables, rows, rule = [], None, 0
    for line in lines:
        if line.strip() and set(line.strip()) == {"─"}:
            rows, rule = [], len(line)
            tables.append(rows)
        elif rows is not None and len(line) == rule and line.strip():
            rows.append(line)
        else:
            rows = None
    return tables


def _no_name_cut(text: str, path=None, width: int = 80) -> list[str]:
    """``_fits`` 100 columns, every table ``width``, with no ellipsis anywhere and no two rows of a
    table alike (the verdict line is one line of up to 100, for scripts to read)."""
    assert "…" not in text, text
    lines = _fits(text, path)
    tables = table_rows(lines)
    assert tables, text
    for rows in tables:
        starts = [row for row in rows if not row.startswith(" " * 8)]  # not a wrapped prose cell's next line
        assert len(set(starts)) == len(starts) and len(rows[0]) <= width, rows
    return lines


COMMANDS_AT = {
    "demo": ["demo", "--ranks", "1", "--overlap", "all", "--tokens", "4", "--iters", "1", "--device", "cpu"],
    "bench": [
        *["bench", "--ranks", "1", "--dispatcher", "all", "--overlap", "all", "--tokens", "4"],
        *["--iters", "1", "--warmup", "0", "--no-graph", "--device", "cpu"],
    ],
    "plan": ["plan"],
    "plan --detail": ["plan", "--detail"],
    "plan --node-aware-ep": ["plan", "--node-aware-ep", "16", "32", "64", "--batch", "4096"],
    "plan --skew": ["plan", "--skew", "zipf:1", "--memory-ep", "8", "16"],
}
LAST_LINE = {
    "demo": "30/30 dispatcher x overlap runs match",
    "bench": "",  # its closing lines are its own (a row count, a summary): the rows are counted below
    "check": "1/1 dispatchers match",
    "generate": "40 new tokens for 1 prompt(s) on 1 ranks",
    "plan": "verdict: ",
}


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("command", [*COMMANDS_AT, "check", "generate"])
def test_no_name_is_cut_at_80_columns_and_no_line_passes_100(command, columns, monkeypatch, capsys, qwen3_dir):
    """The newcomer's 80x60 pane: every table readable, its names whole (``combine`` and ``combine_sm``
    never both ``combi…``); at 100 columns no line longer."""
    monkeypatch.setenv("COLUMNS", str(columns))
    in_process(monkeypatch)
    argv = COMMANDS_AT.get(command)
    if command == "check":
        argv = ["check", "--checkpoint", str(qwen3_dir), "--ranks", "1", "--tokens", "4", "--device", "cpu"]
    elif command == "generate":
        argv = ["generate", "--checkpoint", str(qwen3_dir), "--prompt-ids", "1,2,3", "--max-new-tokens", "40"]
        argv += ["--ranks", "1", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = _no_name_cut(out, qwen3_dir, columns)
    assert lines[-1].startswith(LAST_LINE[command.split()[0]]), lines[-1]
    assert command != "bench" or "30 rows, 0 errors" in out


def test_a_narrow_table_keeps_names_whole_and_says_what_it_changed():
    """Each narrowing step, only as far as needed: one-value columns become a line, header words
    shorten (a legend), then columns go (named); names and numbers stay whole."""
    table = options.make_table(
        "t", [("dispatcher", "left"), ("overlap", "left"), ("ok", "left"), ("dispatch", "right")]
    )
    table.add_row("low_latency", "combine", "yes", "12.3k")
    table.add_row("low_latency", "combine_sm", "yes", "9")

    def render(width: int) -> str:
        out = io.StringIO()
        Console(file=out, width=width).print(table)
        text = out.getvalue()
        assert "combine_sm" in text and "combine " in text and "…" not in text
        assert max(len(line) for line in text.splitlines() if not line.startswith(("every", "disp:", "left"))) <= width
        return " ".join(text.split())

    assert "every row" not in render(40)  # 11 + 10 + 3 + 8 + 3 separators = 35
    folded = render(33)  # "ok" holds one value: a line (the rows' name, "dispatcher", stays)
    assert "every row: ok yes" in folded and "disp:" not in folded and "12.3k" in folded
    shortened = render(30)  # and "dispatch" shortened to "disp"
    assert "every row: ok yes" in shortened and "disp: dispatch" in shortened and "12.3k" in shortened
    left_out = render(27)  # and the last number column left out, named
    assert "left out at 27 columns: dispatch" in left_out and "12.3k" not in left_out


def test_an_optional_column_is_left_out_first_and_named():
    table = options.make_table("t", [("name", "left"), ("route", "right"), ("layer", "right")], optional=("route",))
    table.add_row("combine_sm", "123456", "7")
    table.add_row("combine", "1", "654321")
    out = io.StringIO()
    Console(file=out, width=18).print(table)
    text = " ".join(out.getvalue().split())
    assert "left out at 18 columns: route (a wider terminal shows them)" in text and "123456" not in text
    assert "combine_sm" in text and "654321" in text and "…" not in text


def test_make_table_refuses_an_unknown_column():
    with pytest.raises(ValueError, match="wrap and optional must name columns of"):
        options.make_table("t", [("name", "left")], wrap=("why",))


def test_demo_overlap_all_fits_100_columns(narrow, capsys):
    argv = ["demo", "--ranks", "1", "--dispatcher", "local", "--overlap", "all", "--tokens", "4", "--iters", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out)
    assert lines[-1].startswith("6/6 dispatcher x overlap runs match the single-rank reference")


def test_check_fits_100_columns(narrow, capsys, tmp_path):
    path, _ = write_published_v3(tmp_path, fp8=False)
    assert main(["check", "--checkpoint", str(path), "--ranks", "1", "--tokens", "4", "--device", "cpu"]) == 0
    assert _fits(capsys.readouterr().out, path)[-1].startswith("1/1 dispatchers match transformers' module")


def test_bench_fits_100_columns(narrow, capsys):
    argv = ["bench", "--ranks", "1", "--dispatcher", "local", "--overlap", "none", "split", "--tokens", "4"]
    assert main([*argv, "--iters", "1", "--no-graph", "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out)
    assert lines[-2].startswith("2 rows, 0 errors; not written") and lines[-1].startswith("best: 4 tokens local/")


def test_generate_fits_100_columns(narrow, capsys, tmp_path):
    make_hf_model("qwen3_moe", seed=3).save_pretrained(tmp_path)
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    assert main([*argv, "--ranks", "1", "--device", "cpu"]) == 0
    lines = _fits(capsys.readouterr().out, tmp_path)
    assert lines[0] == f"moe-sbo generate: {tmp_path} (qwen3_moe)" and lines[1].startswith("  1 cpu ranks, alltoall")


@pytest.mark.parametrize("argv", [[], ["--batch", "4096"], ["--model", "qwen3-30b-a3b", "--ep", "4"], ["--detail"]])
def test_plan_fits_100_columns_and_ends_with_its_verdict(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # its verdicts' "why" column wraps to the terminal, by design
    assert main(["plan", *argv]) == 0
    last = _fits(capsys.readouterr().out)[-1]
    assert last.startswith("verdict: ")


def test_plan_verdict_names_what_fits_and_what_misses(capsys):
    """The worked example (DeepSeek-V3 decode, batch 256, 20 ms): compute alone, 58 MoE layers x
    (320 + 120) us, is 25.5 ms, so no overlap can meet the TPOT, whatever each would hide."""
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "verdict: no overlap fits: compute alone is 25.5 ms (58 x 440 us) > 20 ms TPOT"
    assert "overlaps that fit" not in out
    assert main(["plan", "--tpot-ms", "40"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "verdict: serial a2a fits the 40 ms TPOT; overlaps that fit: sbo-dispatch, sbo-combine, tbo"
    )
    assert main(["plan", "--batch", "4096", "--tpot-ms", "40"]) == 0
    assert capsys.readouterr().out.endswith("overlaps that fit: sbo-dispatch, sbo-combine\n")


def test_plan_is_short_by_default_the_table_asked_for_first_and_its_detail_behind_a_flag(capsys):
    assert main(["plan"]) == 0
    short = capsys.readouterr().out.splitlines()
    assert len(short) <= 40 and short[0].lstrip().startswith("Byte model: deepseek-v3")
    assert not any("Published DeepSeek-V3 decode budget" in line for line in short)
    assert main(["plan", "--detail"]) == 0
    detail = capsys.readouterr().out
    assert "Published DeepSeek-V3 decode budget, line by line" in detail.splitlines()[0]
    assert "allgather vs alltoall" in detail and "Weight memory per GPU" in detail
    for argv, title in (
        (["--node-aware-ep", "16", "32"], "Flat vs node-aware dispatch"),
        (["--skew", "zipf:1"], "Expert load balance"),
        (["--memory-ep", "8", "16"], "Weight memory per GPU"),
    ):
        assert main(["plan", *argv]) == 0
        assert capsys.readouterr().out.splitlines()[0].lstrip().startswith(title), argv


def test_plan_node_verdict_accounts_for_the_node_table(capsys):
    """With --node-aware-ep the verdict says where node-aware dispatch wins and what fits there;
    still before the closing verdict, which stays last."""
    assert main(["plan", "--node-aware-ep", "16", "32", "64", "--tpot-ms", "40", "--batch", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("verdict across nodes: node-aware ") and "serial a2a fits at" in lines[-2]
    assert lines[-1].startswith("verdict: serial a2a fits the 40 ms TPOT")
    assert main(["plan", "--node-aware-ep", "16", "32"]) == 0  # 20 ms: compute alone exceeds it
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].endswith("; compute alone exceeds the TPOT") and lines[-1].startswith("verdict: no overlap fits")


def test_demo_and_check_show_progress_on_stderr_and_keep_stdout(narrow, monkeypatch, capsys, tmp_path):
    """On a terminal: a spinner while the ranks start, then rank 0's bar per dispatcher (x overlap),
    on stderr; stdout still ends with the verdict line."""
    drawn = io.StringIO()
    terminal = Console(file=drawn, force_terminal=True, width=WIDTH)
    monkeypatch.setattr(progress, "progress_console", lambda: terminal)
    argv = ["demo", "--ranks", "1", "--dispatcher", "local", "--overlap", "split", "--tokens", "4", "--iters", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("2/2 dispatcher x overlap runs match") and "starting" not in out
    assert "starting 1 cpu ranks" in drawn.getvalue() and "demo local / split" in drawn.getvalue()
    path, _ = write_published_v3(tmp_path, fp8=False)
    assert main(["check", "--checkpoint", str(path), "--ranks", "1", "--tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("1/1 dispatchers match")
    assert "check local" in drawn.getvalue()


def test_progress_draws_nothing_off_a_terminal(capsys):
    assert progress.rank_progress(0, 3, "demo") is None  # pytest captures stderr: not a terminal
    with progress.starting_ranks(2, "cpu"):
        pass
    assert capsys.readouterr() == ("", "")


def test_generate_wraps_ids_after_a_comma_never_inside_one():
    ids = [7, 123, 45, 6789, 0, 12, 345]
    lines = generate.wrap_ids(ids, 10)
    assert (
        lines == ["7,123,45,", "6789,0,12,", "345"] and ",".join(lines).replace(",,", ",") == "7,123,45,6789,0,12,345"
    )
    assert generate.wrap_ids([1, 2], 80) == ["1,2"]


def test_the_cpu_note_fits_100_columns(monkeypatch, capsys, caplog):
    """The one line a CPU run of overlap combine logs (no side stream on CPU) fits 100 columns."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    in_process(monkeypatch)
    argv = ["demo", "--ranks", "1", "--dispatcher", "local", "--overlap", "combine", "--tokens", "4", "--iters", "1"]
    with caplog.at_level("WARNING", logger="moe_sbo"):
        assert main([*argv, "--device", "cpu"]) == 0
    notes = [r.getMessage() for r in caplog.records if "side stream" in r.getMessage()]
    assert all(len(note) <= WIDTH for note in notes)


def _demo_row(dispatcher: str, nodes: int, per_node: int, inter: int) -> dict:
    times = dict.fromkeys(("t_route_us", "t_dispatch_us", "t_experts_us", "t_combine_us", "t_layer_us"), 1.0)
    return {
        "dispatcher": dispatcher,
        "overlap": "none",
        "max_abs_err": 0.0,
        "rel_err": 0.0,
        "ok": True,
        "same_as_none": True,
        "bytes_sent": 3536,
        "inter_node_bytes": inter,
        "nodes": nodes,
        "ranks_per_node": per_node,
        **times,
    }


def test_the_node_aware_demo_names_its_nodes_and_the_bytes_that_crossed():
    rows = [_demo_row("local", 1, 1, 0), _demo_row("node_aware", 2, 1, 1768)]
    assert (
        demo_report.nodes_note(rows, 2)
        == "nodes: 2 of 1 rank each (MOE_SBO_RANKS_PER_NODE or torchrun's LOCAL_WORLD_SIZE)"
    )
    out = io.StringIO()
    Console(file=out, width=WIDTH).print(demo_report.demo_table(rows))
    assert "inter B" in out.getvalue() and "1768" in out.getvalue()
    one_node = [_demo_row("local", 1, 1, 0), _demo_row("node_aware", 1, 2, 0)]
    assert demo_report.nodes_note(one_node, 2).startswith("nodes: 1 of 2 ranks, no byte crosses nodes; ")
    out = io.StringIO()
    Console(file=out, width=WIDTH).print(demo_report.demo_table(one_node))
    assert "inter B" not in out.getvalue()
    assert (
        demo_report.nodes_note([_demo_row("alltoall", 1, 2, 0)], 2) is None
    )  # no node_aware, one node: nothing to say

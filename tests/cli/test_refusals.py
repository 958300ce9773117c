"""What a user gets wrong on a first run, refused in one line (exit 2) before any work, or made to
work: output paths in folders that do not exist, models too large for the machine, a checkpoint
without a tokenizer, ids outside the vocabulary, bad values named, options that would be ignored."""

from __future__ import annotations

import json

import pytest

from hf_blocks import make_hf_model, write_published_v3
from in_process import InProcess
from moe_sbo.cli.main import main
from moe_sbo.dispatch import DISPATCHERS
from moe_sbo.measure import memory, run

COMMANDS = ("demo", "bench", "check", "generate", "plan")
OUTPUT_FLAG = {"demo": "--json", "bench": "--out", "check": "--json", "generate": "--json", "plan": "--json"}


@pytest.fixture
def no_ranks(monkeypatch):
    """Bad input must be refused before any rank (and so any collective) starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were started for bad input")

    monkeypatch.setattr(run, "LocalRanks", refuse)
    monkeypatch.setattr(run, "RankPool", refuse)


def _required(command: str, tmp_path) -> list[str]:
    return ["--checkpoint", str(tmp_path / "no-model")] if command in ("check", "generate") else []


def _prompt(command: str) -> list[str]:
    return ["--prompt-ids", "1,2"] if command == "generate" else []


# ---- output paths --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_path_that_cannot_be_made_is_refused_before_any_work(command, tmp_path, capsys, no_ranks):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "rows.json"  # its folder would be a file
    argv = [command, OUTPUT_FLAG[command], str(out), *_required(command, tmp_path), *_prompt(command)]
    assert main([*argv, *(["--device", "cpu"] if command != "plan" else [])]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"moe-sbo {command}: error: {OUTPUT_FLAG[command]} must be in a folder that can be made, got {out}: "
        f"{tmp_path / 'a-file'} is a file; choose another path\n"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_path_naming_a_folder_is_refused(command, tmp_path, capsys, no_ranks):
    argv = [command, OUTPUT_FLAG[command], str(tmp_path), *_required(command, tmp_path), *_prompt(command)]
    assert main([*argv, *(["--device", "cpu"] if command != "plan" else [])]) == 2
    assert capsys.readouterr().err.startswith(
        f"moe-sbo {command}: error: {OUTPUT_FLAG[command]} must name a file, got the folder {tmp_path}; "
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_refused_for_bad_input_makes_no_output_folder(command, tmp_path, monkeypatch, capsys):
    """The output path is checked first, but nothing is made before the work: a command refused at
    once (a missing checkpoint, a bad size) leaves no folder behind."""
    out = tmp_path / "new" / "folder" / "rows.json"
    bad = {"demo": ["--tokens", "-1"], "bench": ["--iters", "0"], "plan": ["--batch", "0"]}.get(command, [])
    argv = [command, OUTPUT_FLAG[command], str(out), *_required(command, tmp_path), *_prompt(command), *bad]
    assert main([*argv, *(["--device", "cpu"] if command != "plan" else [])]) == 2
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(command, capsys, no_ranks, tmp_path):
    """Found before any rank starts, in one line, whoever runs it (root included: the check writes
    a file there and removes it, not only reads permission bits); /proc takes no new file."""
    out = "/proc/moe-sbo-test/rows.json"
    argv = [command, OUTPUT_FLAG[command], out, *_required(command, tmp_path), *_prompt(command)]
    assert main([*argv, *(["--device", "cpu"] if command != "plan" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-sbo {command}: error: {OUTPUT_FLAG[command]} must be a path this user can write, ")
    assert err.endswith(" in /proc; choose another path\n") and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--plot", "--timeline", "--trace", "--record-load"])
def test_standard_output_is_for_json_only(flag, capsys, no_ranks):
    argv = ["plan"] if flag == "--plot" else ["bench", "eplb" if flag == "--record-load" else "sbo", "--device", "cpu"]
    assert main([*argv, flag, "-"]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: {flag} must name a file, got -; standard output takes JSON only (--json -, --out -)\n"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_dash_writes_the_json_to_standard_output_and_the_rest_to_stderr(command, qwen3_dir, monkeypatch, capsys):
    """``--json -`` (``bench --out -``): standard output holds the JSON document alone, for a pipe;
    tables and the verdict go to stderr; no file named ``-`` is made."""
    monkeypatch.setattr(run, "LocalRanks", InProcess)
    monkeypatch.setattr(run, "RankPool", InProcess)
    monkeypatch.chdir(qwen3_dir.parent)
    argv = {
        "demo": ["demo", "--ranks", "1", "--dispatcher", "local", "--tokens", "4", "--iters", "1"],
        "bench": ["bench", "--ranks", "1", "--dispatcher", "local", "--overlap", "none", "--tokens", "4"],
        "check": ["check", "--checkpoint", str(qwen3_dir), "--ranks", "1", "--tokens", "4"],
        "generate": ["generate", "--checkpoint", str(qwen3_dir), "--prompt-ids", "1,2", "--max-new-tokens", "2"],
        "plan": ["plan"],
    }[command]
    extra = ["--iters", "1", "--no-graph"] if command == "bench" else []
    extra += ["--ranks", "1"] if command == "generate" else []
    assert main([*argv, *extra, OUTPUT_FLAG[command], "-", *(["--device", "cpu"] if command != "plan" else [])]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["meta"] and ("rows" in doc or command == "plan")
    assert "written to standard output" in err
    assert err.splitlines()[-1].startswith(("verdict", "best", "1 ", "2 ", "1/1"))
    assert not (qwen3_dir.parent / "-").exists()


def test_demo_writes_its_json_into_a_new_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run, "LocalRanks", InProcess)
    out = tmp_path / "new" / "rows.json"
    argv = ["demo", "--ranks", "1", "--dispatcher", "local", "--tokens", "4", "--iters", "1", "--json", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0
    assert [row["dispatcher"] for row in json.loads(out.read_text())["rows"]] == ["local"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("1/1 dispatcher x overlap runs match")


def test_plan_writes_its_json_into_a_new_folder(tmp_path, capsys):
    out = tmp_path / "new" / "plan.json"
    assert main(["plan", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]


# ---- memory --------------------------------------------------------------------------------------


@pytest.fixture
def little_memory(monkeypatch, tmp_path):
    """A machine with 1 kB available: every model built here is too large for it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2048 kB\nMemAvailable: 1 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", meminfo)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint, without tokenizer files."""
    path = tmp_path_factory.mktemp("qwen3")
    make_hf_model("qwen3_moe", seed=3).save_pretrained(path)
    return path


def test_demo_of_a_model_too_large_is_refused_in_one_line(capsys, no_ranks):
    """deepseek-v3's layer on CPU ranks: the same estimate as bench, before any allocation."""
    meminfo = memory.available_bytes("cpu", 2)
    assert meminfo is not None and meminfo[0] < 60e9  # this machine: less than deepseek-v3's layer per rank
    assert main(["demo", "--preset", "deepseek-v3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-sbo demo: error: the memory per rank must be <= the ") and err.count("\n") == 1
    assert "(128 local experts + 256 in the reference, shared experts, router; float32)" in err
    assert err.endswith("use --preset tiny, a smaller --checkpoint or fewer --tokens, or a GPU\n")


def test_check_of_a_model_too_large_is_refused_in_one_line(tmp_path, capsys, no_ranks, little_memory):
    path, _ = write_published_v3(tmp_path, fp8=False)
    assert main(["check", "--checkpoint", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-sbo check: error: the memory per rank must be <= the 512 B available")
    layers = len(DISPATCHERS) - 1  # every EP dispatcher (check's default), each a copy of the layer
    assert f"({layers} copies of the layer, one per dispatcher, x 4 local experts + 8 in the reference, " in err
    assert err.count("\n") == 1
    assert err.endswith("use one --dispatcher or fewer --tokens, or a GPU\n")


def test_generate_of_a_model_too_large_is_refused_in_one_line(qwen3_dir, capsys, no_ranks, little_memory):
    assert main(["generate", "--checkpoint", str(qwen3_dir), "--prompt-ids", "1,2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-sbo generate: error: the memory per rank must be <= the 512 B available")
    assert err.count("\n") == 1 and err.endswith("use a smaller model or more --ranks, or a GPU\n")


# ---- prompts -------------------------------------------------------------------------------------


def test_generate_text_on_a_checkpoint_whose_tokenizer_encodes_nothing_is_refused(qwen3_dir, capsys, no_ranks):
    """Without tokenizer files transformers gives Qwen3 an empty tokenizer ("Hello" -> no ids):
    that is no tokenizer, as for a DeepSeek directory, which gets none."""
    assert main(["generate", "--checkpoint", str(qwen3_dir), "--prompt", "Hello", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        f"moe-sbo generate: error: {qwen3_dir} has no tokenizer, so text prompts cannot be encoded; "
        "pass token ids with --prompt-ids 1,2,3 instead\n"
    )


@pytest.mark.parametrize("ids, bad", [("1,2,100000", 100000), ("3,-1", -1)])
def test_generate_ids_outside_the_vocabulary_are_named(qwen3_dir, capsys, no_ranks, ids, bad):
    vocab = json.loads((qwen3_dir / "config.json").read_text())["vocab_size"]
    assert main(["generate", "--checkpoint", str(qwen3_dir), "--prompt-ids", ids, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        f"moe-sbo generate: error: --prompt-ids must hold ids in [0, {vocab}) (the model's vocab_size), "
        f"got {bad} in prompt 0; use ids of the model's tokenizer\n"
    )


# ---- environment variables -----------------------------------------------------------------------

RANKS_PER_NODE_LINE = (
    "MOE_SBO_RANKS_PER_NODE must be a whole number that divides the 4 ranks (1, 2 or 4), got {!r}; "
    "set it to the ranks of one node, or unset it (one node holds every rank)"
)


@pytest.mark.parametrize("value", ["3", "0", "abc"])
@pytest.mark.parametrize("command", ["demo", "bench", "check", "generate"])
def test_a_bad_ranks_per_node_is_refused_with_the_options(command, value, qwen3_dir, monkeypatch, capsys, no_ranks):
    """Found with the options (exit 2, one line), not inside every rank."""
    monkeypatch.setenv("MOE_SBO_RANKS_PER_NODE", value)
    model = {"check": ["--checkpoint", str(qwen3_dir)], "generate": ["--checkpoint", str(qwen3_dir)]}
    argv = [command, "--device", "cpu", "--ranks", "4", *model.get(command, []), *_prompt(command)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"moe-sbo {command}: error: {RANKS_PER_NODE_LINE.format(value)}\n"


def test_every_bad_variable_is_named_in_one_line(monkeypatch, capsys, no_ranks):
    monkeypatch.setenv("MOE_SBO_TIMEOUT_S", "soon")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    assert main(["demo", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "moe-sbo demo: error: MOE_SBO_TIMEOUT_S must be a finite number of seconds > 0, got 'soon'; set it "
        "to e.g. 25, or unset it for the default (25 s); and LOCAL_WORLD_SIZE must be a whole number >= 1, "
        "got 'two'; torchrun sets it; outside torchrun, unset it\n"
    )


# ---- values named, options not ignored -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, line",
    [
        (["sbo", "--tokens", "-1"], "--tokens must be >= 1, got -1; leave --tokens out for its default"),
        (["eplb", "--tokens", "16", "0", "64"], "--tokens must be >= 1, got 0; leave --tokens out for its default"),
        (["sbo", "--iters", "0"], "--iters must be >= 1, got 0; leave --iters out for its default"),
        (["tbo", "--warmup", "-2"], "--warmup must be >= 0, got -2; leave --warmup out for its default"),
        (
            ["tbo", "--decode-seqs", "4", "-3"],
            "--decode-seqs must be >= 1, got -3; leave --decode-seqs out for its default",
        ),
    ],
)
def test_bench_names_the_wrong_value(argv, line, capsys, no_ranks):
    mode, *options = argv
    assert main(["bench", mode, "--device", "cpu", *options]) == 2
    assert capsys.readouterr().err == f"moe-sbo bench: error: {line}\n"


def test_demo_layer_without_a_checkpoint_is_refused(capsys, no_ranks):
    assert main(["demo", "--layer", "1", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "moe-sbo demo: error: --layer picks a layer of --checkpoint, got --layer 1 without one; "
        "add --checkpoint DIR or leave --layer out (--preset has one layer)\n"
    )


@pytest.mark.parametrize(
    "gpus, ranks, asked, expected",
    [
        (1, 4, [0], (250, "free on the emptiest of the ranks' GPUs / 4 ranks sharing it")),
        (2, 3, [0, 1], (400, "free on the emptiest of the ranks' GPUs / 2 ranks sharing it")),
        (4, 2, [0, 1], (800, "free on the emptiest of the ranks' GPUs")),
    ],
)
def test_gpu_memory_per_rank_counts_only_the_gpus_the_ranks_use_and_divides_a_shared_one(
    monkeypatch, gpus, ranks, asked, expected
):
    """Ranks placed round-robin: only their GPUs are asked, and a GPU's free memory is split among
    the ranks on it (4 ranks on one GPU: a quarter each)."""
    free = {0: 1000, 1: 800, 2: 10, 3: 10}  # GPUs 2 and 3 are nearly full but hold no rank of 2
    seen = []
    monkeypatch.setattr(memory.torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(memory.torch.cuda, "mem_get_info", lambda gpu: (seen.append(gpu), (free[gpu], 2000))[1])
    assert memory.available_bytes("cuda", ranks) == expected
    assert seen == asked

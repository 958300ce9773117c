"""``moe-sbo check`` and ``moe-sbo demo --checkpoint`` on checkpoints written by transformers and by hand,
with dense and FP8 (``--expert-dtype fp8``) routed experts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from hf_blocks import make_hf_model, write_broken_v3, write_checkpoint, write_published_v3
from moe_sbo.cli import check as check_cli
from moe_sbo.cli import demo as demo_cli
from moe_sbo.cli.main import main
from moe_sbo.config import PRESETS
from moe_sbo.hf.checkpoint import Checkpoint
from moe_sbo.launch import ranks as launch_ranks
from moe_sbo.layer import MoELayer
from moe_sbo.measure import run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> directory from save_pretrained (DeepSeek-V3 sharded, the others single-file)."""
    out = {}
    for family in ("deepseek_v3", "deepseek_v2", "qwen3_moe"):
        path = tmp_path_factory.mktemp(family)
        make_hf_model(family, seed=5).save_pretrained(path, max_shard_size="40KB" if family == "deepseek_v3" else "1GB")
        out[family] = path
    out["deepseek_v3_fp8"], _ = write_published_v3(tmp_path_factory.mktemp("fp8"), fp8=True)
    # Sizes FP8 experts accept (multiples of 128), stored as FP8 and dense.
    for stored in ("fp8", "dense"):
        out[f"deepseek_v3_{stored}_128"], _ = write_published_v3(
            tmp_path_factory.mktemp(f"{stored}_128"), fp8=stored == "fp8", hidden=256, inter=128, experts=4
        )
    return out


def _check(path, *extra, tmp_path):
    out = tmp_path / "check.json"
    code = main(
        [
            "check",
            "--checkpoint",
            str(path),
            "--ranks",
            "2",
            "--device",
            "cpu",
            "--tokens",
            "24",
            "--json",
            str(out),
            *extra,
        ]
    )
    return code, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "qwen3_moe", "deepseek_v3_fp8"])
def test_check_passes_on_every_family(checkpoints, family, tmp_path, capsys):
    code, result = _check(checkpoints[family], tmp_path=tmp_path)
    assert code == 0, capsys.readouterr()
    rows = result["rows"]
    assert {r["dispatcher"] for r in rows} == set(check_cli.check_dispatchers("all", 2)) and len(rows) >= 2
    assert all(r["ok"] and r["rel_err"] <= 1e-5 and r["tolerance"] == 1e-5 for r in rows)
    assert all(r["bytes_sent"] > 0 and r["bytes_read"] > 0 for r in rows)
    assert result["meta"]["layer"] == 1
    printed = capsys.readouterr().out
    assert "rank 1 read experts 8..15" in printed or "rank 1 read experts 4..7" in printed
    n = len(rows)
    assert printed.splitlines()[-1] == f"{n}/{n} dispatchers match transformers' module on every rank (rel L2 <= 1e-05)"


def test_the_tiny_checkpoint_recipe_of_the_docs_prints_what_they_show(tmp_path, monkeypatch, capsys):
    """docs/CHECKPOINTS.md's recipe, run as written: its Python writes the model, its ``check`` line
    checks it, and the output ends with the lines the page shows (the dispatcher count included)."""
    text = (Path(__file__).parents[2] / "docs" / "CHECKPOINTS.md").read_text()
    script = text.split("python - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    (command,) = [line for line in text.splitlines() if line.startswith("moe-sbo check --checkpoint tiny-qwen3")]
    shown = text.split("`check` ends with", 1)[1].split("```\n", 2)[1].splitlines()
    monkeypatch.chdir(tmp_path)
    exec(compile(script, "CHECKPOINTS.md", "exec"), {})
    assert main(shlex.split(command.split("#")[0])[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-len(shown) :] == shown
    n = len(check_cli.check_dispatchers("all", 2))
    assert f"# {n}/{n} dispatchers match" in command


def test_check_in_bfloat16_uses_the_bf16_tolerance(checkpoints, tmp_path, capsys):
    code, result = _check(
        checkpoints["deepseek_v3_fp8"], "--dtype", "bfloat16", "--dispatcher", "alltoall", tmp_path=tmp_path
    )
    assert code == 0, capsys.readouterr()
    (row,) = result["rows"]
    assert row["tolerance"] == 2e-2 and 0 < row["rel_err"] <= 2e-2


def test_check_fails_with_exit_1_beyond_tolerance(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(check_cli.TOLERANCE, "float32", -1.0)  # nothing can pass
    code, result = _check(checkpoints["qwen3_moe"], "--dispatcher", "allgather", tmp_path=tmp_path)
    assert code == 1 and not result["rows"][0]["ok"]


def test_demo_runs_a_checkpoint_layer(checkpoints, tmp_path):
    out = tmp_path / "demo.json"
    code = main(
        [
            "demo",
            "--checkpoint",
            str(checkpoints["deepseek_v3_fp8"]),
            "--layer",
            "1",
            "--ranks",
            "2",
            "--device",
            "cpu",
            "--tokens",
            "8",
            "--iters",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {"local", "alltoall"} <= {r["dispatcher"] for r in rows} and all(r["ok"] for r in rows)


@pytest.fixture
def no_ranks(monkeypatch):
    """Bad input must be refused before any rank (and so any collective) starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank pool was started for bad input")

    monkeypatch.setattr(launch_ranks, "LocalRanks", refuse)
    monkeypatch.setattr(run, "LocalRanks", refuse)  # the name the commands call


P = "model.layers.1.mlp."


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_config", "config.json is missing"),
        (
            "mixtral",
            "model must be one of the supported families (model_type deepseek_v2, deepseek_v3, kimi_k2, qwen3_moe",
        ),
        ("dense", "layer must be an MoE layer, got dense layer 0"),
        ("out_of_range", "layer must be in [0, 2) (num_hidden_layers=2), got 7"),
        ("missing_expert", f"model.safetensors: tensor {P}experts.3.down_proj.weight (expert 3 of layer 1) is missing"),
        ("missing_scale", f"{P}shared_experts.up_proj.weight_scale_inv is missing"),
        ("bad_shape", f"model.safetensors: tensor {P}gate.weight must have shape (8, 160), got (8, 64)"),
        ("ranks", "divisible by the EP size, got 8 experts on 3 ranks"),
        ("truncated", "model.safetensors must be a complete safetensors file, got an error reading it: "),
        ("truncated_shard", "model-00002-of-00003.safetensors must be a complete safetensors file"),
        ("garbage_shard", "model-00003-of-00003.safetensors must be a complete safetensors file"),
    ],
)
def test_check_bad_input_exits_2_before_any_rank(tmp_path, capsys, no_ranks, case, message):
    layer, ranks = "1", "2"
    if case == "no_config":
        path = tmp_path
    elif case == "mixtral":
        path = write_checkpoint(
            tmp_path, {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, {"x": torch.zeros(1)}
        )
    elif case == "missing_expert":
        path = write_broken_v3(tmp_path, drop=[f"{P}experts.3.down_proj.weight"])
    elif case == "missing_scale":
        path = write_broken_v3(tmp_path, fp8=True, drop=[f"{P}shared_experts.up_proj.weight_scale_inv"])
    elif case == "bad_shape":
        path = write_broken_v3(tmp_path, replace={f"{P}gate.weight": torch.zeros(8, 64)})
    elif case == "truncated":  # single file: its header is read when the checkpoint is opened
        path = write_broken_v3(tmp_path)
        _truncate(path / "model.safetensors")
    elif case.endswith("_shard"):  # a shard: read when the layer is checked, before any rank starts
        path, _ = write_published_v3(tmp_path, fp8=False)
        if case == "truncated_shard":
            _truncate(path / "model-00002-of-00003.safetensors")
        else:
            (path / "model-00003-of-00003.safetensors").write_bytes(b"\xff" * 64)
    else:
        path, _ = write_published_v3(tmp_path, fp8=False)
        layer = {"dense": "0", "out_of_range": "7"}.get(case, layer)
        ranks = "3" if case == "ranks" else ranks
    code = main(["check", "--checkpoint", str(path), "--layer", layer, "--ranks", ranks, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("moe-sbo check: error: ")
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line


def _truncate(path) -> None:
    """Cut a file to half its size, as an interrupted download leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_file_names_the_fix(tmp_path):
    path = write_broken_v3(tmp_path)
    _truncate(path / "model.safetensors")
    with pytest.raises(ValueError, match=r"truncated or corrupt .*: download or save it again$"):
        Checkpoint(path)


def test_demo_checkpoint_bad_layer_exits_2(tmp_path, capsys, no_ranks):
    path, _ = write_published_v3(tmp_path, fp8=False)
    assert main(["demo", "--checkpoint", str(path), "--layer", "0", "--ranks", "2", "--device", "cpu"]) == 2
    assert "got dense layer 0 (MoE iff layer >= first_k_dense_replace=1" in capsys.readouterr().err


# ---- --expert-dtype fp8 -------------------------------------------------------------------------


@pytest.mark.parametrize("stored", ["deepseek_v3_fp8_128", "deepseek_v3_dense_128"])
def test_check_with_fp8_experts_uses_the_fp8_tolerance(checkpoints, stored, tmp_path, capsys):
    """FP8 experts, kept as stored or quantised on load, against transformers on the same e4m3
    weights dequantised: within 6e-2, and not within float32's 1e-5 (the experts really are FP8)."""
    code, result = _check(checkpoints[stored], "--expert-dtype", "fp8", tmp_path=tmp_path)
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = result["rows"]
    assert len(rows) == len(check_cli.check_dispatchers("all", 2))
    assert all(r["ok"] and r["tolerance"] == 6e-2 and 1e-3 < r["rel_err"] <= 6e-2 for r in rows)
    assert result["meta"]["expert_dtype"] == "fp8"
    assert "routed experts fp8 (e4m3, 128x128 block scales)" in printed
    assert "fp8 experts: the reference runs on the dequantised e4m3 weights" in printed
    assert printed.splitlines()[-1].endswith("on every rank (rel L2 <= 0.06)")


def test_check_expert_dtype_bf16_is_the_layer_dtype(checkpoints, tmp_path, capsys):
    code, result = _check(
        checkpoints["deepseek_v3_fp8_128"], "--expert-dtype", "bf16", "--dispatcher", "alltoall", tmp_path=tmp_path
    )
    assert code == 0, capsys.readouterr()
    (row,) = result["rows"]
    assert row["tolerance"] == 1e-5 and row["rel_err"] <= 1e-5 and result["meta"]["expert_dtype"] == "float32"


def test_demo_runs_a_checkpoint_layer_with_fp8_experts(checkpoints, tmp_path, capsys):
    out = tmp_path / "demo.json"
    args = ["--layer", "1", "--ranks", "2", "--device", "cpu", "--tokens", "8", "--iters", "1", "--json", str(out)]
    code = main(["demo", "--checkpoint", str(checkpoints["deepseek_v3_fp8_128"]), "--expert-dtype", "fp8", *args])
    assert code == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["meta"]["expert_dtype"] == "fp8"
    assert {"local", "alltoall", "low_latency"} <= {r["dispatcher"] for r in result["rows"]}
    assert all(r["ok"] for r in result["rows"])
    assert ", fp8 experts" in capsys.readouterr().out


def _demo_rank_with_fp8_experts(device):
    """On each rank: the demo's random-weight path on a small FP8-sized preset (none of the shipped
    ones is both: tiny's hidden size is 64), and whether every layer it built, the reference's too,
    had FP8 experts."""
    built = []

    class RecordingLayer(MoELayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append((self.dispatcher.name, self.experts.fp8))

    PRESETS["fp8-small"] = PRESETS["tiny"].replace(name="fp8-small", hidden_size=128, moe_intermediate_size=128)
    demo_cli.MoELayer = RecordingLayer  # type: ignore[misc]
    try:
        names = ["alltoall", "low_latency"]
        rows = demo_cli.run_demo_rank(device, "fp8-small", names, 8, 0, "float32", 1, expert_dtype="fp8")
    finally:  # the rank processes serve later tests
        del PRESETS["fp8-small"]
        demo_cli.MoELayer = MoELayer  # type: ignore[misc]
    return built, rows


def test_demo_random_weights_with_fp8_experts(ranks2):
    for built, rows in ranks2.run(_demo_rank_with_fp8_experts):
        assert built == [("local", True), ("alltoall", True), ("low_latency", True)]
        assert [r["dispatcher"] for r in rows] == ["alltoall", "low_latency"] and all(r["ok"] for r in rows)


@pytest.mark.parametrize("command", ["check", "demo"])
def test_fp8_experts_on_a_model_not_in_128_blocks_exit_2_before_any_rank(checkpoints, command, capsys, no_ranks):
    """hidden_size 64 (the transformers-saved Qwen3 model; demo: the tiny preset)."""
    source = ["--checkpoint", str(checkpoints["qwen3_moe"])] if command == "check" else ["--preset", "tiny"]
    code = main([command, *source, "--expert-dtype", "fp8", "--ranks", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"moe-sbo {command}: error: --expert-dtype fp8 needs hidden_size and ")
    assert "multiples of 128 (one weight scale per 128x128 block), got {'hidden_size': 64, " in err
    assert err.rstrip().endswith("leave out --expert-dtype (experts in --dtype) for this model")
    assert err.count("\n") == 1 and "Traceback" not in err

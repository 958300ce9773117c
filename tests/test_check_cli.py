"""``moe-sbo check`` and ``moe-sbo demo --checkpoint`` on checkpoints written by transformers and by hand."""

from __future__ import annotations

import json

import pytest
import torch

from hf_blocks import make_hf_model, write_broken_v3, write_checkpoint, write_published_v3
from moe_sbo import runtime
from moe_sbo.cli import check as check_cli
from moe_sbo.cli import demo as demo_cli
from moe_sbo.cli.main import main
from moe_sbo.hf.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> directory from save_pretrained (DeepSeek-V3 sharded, the others single-file)."""
    out = {}
    for family in ("deepseek_v3", "deepseek_v2", "qwen3_moe"):
        path = tmp_path_factory.mktemp(family)
        make_hf_model(family, seed=5).save_pretrained(path, max_shard_size="40KB" if family == "deepseek_v3" else "1GB")
        out[family] = path
    out["deepseek_v3_fp8"], _ = write_published_v3(tmp_path_factory.mktemp("fp8"), fp8=True)
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

    monkeypatch.setattr(runtime, "LocalRanks", refuse)
    monkeypatch.setattr(check_cli, "LocalRanks", refuse)  # the name the command calls
    monkeypatch.setattr(demo_cli, "LocalRanks", refuse)


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

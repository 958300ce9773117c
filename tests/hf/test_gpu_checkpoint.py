"""``moe-sbo check`` and ``demo --checkpoint`` on the GPU (NCCL ranks, every visible GPU): a
``save_pretrained`` DeepSeek-V3 and a hand-written FP8 one. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest

from gpu_ranks import gpu_world
from hf_blocks import make_hf_model, write_published_v3
from moe_sbo.cli.main import main

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    v3 = tmp_path_factory.mktemp("v3")
    make_hf_model("deepseek_v3", seed=5).save_pretrained(v3, max_shard_size="40KB")
    fp8, _ = write_published_v3(tmp_path_factory.mktemp("fp8"), fp8=True)
    return {"deepseek_v3": v3, "deepseek_v3_fp8": fp8}


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_fp8"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_check_on_gpus(checkpoints, family, dtype, tolerance, tmp_path):
    out = tmp_path / "check.json"
    ranks = str(gpu_world())
    code = main(
        [
            "check",
            "--checkpoint",
            str(checkpoints[family]),
            "--device",
            "cuda",
            "--ranks",
            ranks,
            "--dtype",
            dtype,
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert code == 0, rows
    assert all(r["ok"] and r["rel_err"] <= tolerance for r in rows)


def test_demo_on_a_checkpoint_layer_on_gpus(checkpoints, tmp_path):
    out = tmp_path / "demo.json"
    code = main(
        [
            "demo",
            "--checkpoint",
            str(checkpoints["deepseek_v3"]),
            "--device",
            "cuda",
            "--tokens",
            "40",
            "--iters",
            "1",
            "--overlap",
            "all",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    assert all(r["ok"] for r in json.loads(out.read_text())["rows"])

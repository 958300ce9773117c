"""Whole models: a ``transformers`` causal LM whose MoE blocks are expert-parallel over gloo ranks
generates token for token what ``transformers`` ``generate`` does on one process, for each family,
at EP2 and EP4, with skewed and empty ranks (checkpoints written by ``transformers`` itself)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hf_blocks import make_hf_model

from moe_sbo.hf.model import ExpertParallelMoE, generate, load_model

FAMILIES = ["deepseek_v3", "deepseek_v2", "qwen3_moe"]
NEW_TOKENS = 8
# Rank r's prompts: different counts and lengths per rank (left-padded into one batch on each).
PROMPTS_EP2 = [[[1, 5, 9, 3], [7, 2]], [[4, 4, 4, 4, 4, 4]]]
PROMPTS_EP4 = [[[11, 3, 2]], [[9, 9], [2, 30, 41, 5, 6], [8]], [], [[60, 61, 62, 63, 1, 2, 3]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        make_hf_model(family, seed=3).save_pretrained(path)
        paths[family] = str(path)
    return paths


def reference_ids(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """``transformers``' own greedy ``generate`` on one process, padded rows cut after end-of-sequence."""
    from transformers import AutoModelForCausalLM

    if not prompts:
        return []
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def _generate_rank(device, path, prompts_per_rank, dispatcher, options):
    model = load_model(path, dispatcher=dispatcher, dispatcher_options=options)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    result = generate(model, prompts_per_rank[dist.get_rank()], NEW_TOKENS)
    local = [b.moe.experts.gate_up_proj.shape[0] for b in blocks]
    return result.token_ids, result.forwards, [b.calls for b in blocks], local


def _check(results, path, prompts_per_rank, world):
    for rank, (token_ids, forwards, calls, local) in enumerate(results):
        assert token_ids == reference_ids(path, prompts_per_rank[rank]), f"rank {rank}"
        assert forwards == NEW_TOKENS and all(c == NEW_TOKENS for c in calls)  # in step, empty rank too
        assert all(n == 16 // world for n in local)  # each rank holds only its share of the 16 experts


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_generates_what_transformers_generates(ranks2, checkpoints, family):
    results = ranks2.run(_generate_rank, checkpoints[family], PROMPTS_EP2, "alltoall", None)
    _check(results, checkpoints[family], PROMPTS_EP2, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_ep4_with_an_empty_rank_generates_what_transformers_generates(ranks4, checkpoints, family):
    results = ranks4.run(_generate_rank, checkpoints[family], PROMPTS_EP4, "alltoall", None)
    _check(results, checkpoints[family], PROMPTS_EP4, 4)


def test_low_latency_dispatcher_generates_the_same(ranks2, checkpoints):
    options = {"max_tokens_per_rank": 16, "kernels": "torch"}
    results = ranks2.run(_generate_rank, checkpoints["deepseek_v3"], PROMPTS_EP2, "low_latency", options)
    _check(results, checkpoints["deepseek_v3"], PROMPTS_EP2, 2)


def test_one_rank_reads_only_its_experts_and_no_whole_model(checkpoints, monkeypatch):
    from moe_sbo.hf import checkpoint as checkpoint_module

    reads = []
    original = checkpoint_module.Checkpoint.read_moe_weights

    def spy(self, layer, expert_ids=None, dtype=None, **kw):
        reads.append(expert_ids)
        return original(self, layer, expert_ids, dtype, **kw)

    monkeypatch.setattr(checkpoint_module.Checkpoint, "read_moe_weights", spy)
    model = load_model(checkpoints["qwen3_moe"], dispatcher="local")
    assert reads == [range(0, 16)]  # one MoE layer, one read (a one-rank group owns every expert)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_bad_input_is_refused(checkpoints, tmp_path):
    model = load_model(checkpoints["deepseek_v3"], dispatcher="local")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, [[1, 2]], 0)
    with pytest.raises(ValueError, match="at least one token id"):
        generate(model, [[1, 2], []], 2)
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["deepseek_v3"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the files hold 2 layers
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_model(broken, dispatcher="local")

"""Whole models on GPUs in bf16: the expert-parallel model (one NCCL rank per GPU, up to 2) against
``transformers`` on one GPU with the same checkpoint (a DeepSeek-V3-family model written by
``transformers``): logits within a stated tolerance on the same tokens, and greedy generation with the
same ids for every step up to the reference's first near-tie; and decode steps replayed from CUDA
graphs give exactly the tokens of the same fixed-shape loop run eagerly, with a rank that has no
prompts.

bf16 on different kernels (grouped GEMM vs ``transformers``' experts, another reduction order)
moves the logits by about a percent of their spread, so a step whose top two logits are closer than
that can flip either way and every later token then differs: the id comparison stops at the first
step where the reference's own margin is under ``TIE_MARGIN`` of its logits' spread. A random
model's logits are nearly flat (half its steps are such near-ties), so the checkpoint's output rows
are scaled by seeded log-normal factors, as a trained model's vocabulary is not uniform. Skipped
without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_blocks import make_hf_model
from moe_sbo.hf.generate import generate
from moe_sbo.hf.model import load_model

pytestmark = pytest.mark.gpu
NEW_TOKENS = 16
PROMPTS = [[[1, 5, 9, 3, 17, 22, 40, 2], [7, 2, 11]], [[4, 4, 4, 4, 4, 4], [33], [8, 9, 10, 11, 12]]]
LOGIT_TOL = 2e-2  # relative Frobenius error of one forward's logits, bf16 vs bf16 on other kernels
TIE_MARGIN = 0.1  # a step is a near-tie when top-1 - top-2 < this x the std of that step's logits


def _padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _reference(path: str, prompts: list[list[int]]) -> dict:
    """``transformers`` on this rank's GPU, bf16: greedy ids, each step's margin, and the logits of
    one forward over prompt + generated ids."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", torch.cuda.current_device())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    model.generation_config.eos_token_id = None  # always NEW_TOKENS steps
    ids, mask = _padded(prompts, device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        full = out.sequences
        logits = model(full, attention_mask=torch.cat([mask, torch.ones_like(full[:, ids.shape[1] :])], 1)).logits
    scores = torch.stack(out.scores, 1).float()  # [B, steps, V]
    top2 = scores.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]) / scores.std(dim=-1)
    return {"ids": full[:, ids.shape[1] :].tolist(), "margin": margin.tolist(), "full": full, "logits": logits}


def _compare_rank(device, path):
    rank = dist.get_rank()
    prompts = PROMPTS[rank]
    ref = _reference(path, prompts)
    model = load_model(path, dispatcher="alltoall", device=device)
    result = generate(model, prompts, NEW_TOKENS, eos_token_id=[])
    # The same tokens through the expert-parallel model: one forward on every rank.
    width = max(len(p) for p in prompts)
    _, mask = _padded(prompts, device)
    full_mask = torch.cat([mask, torch.ones(len(prompts), NEW_TOKENS, dtype=mask.dtype, device=device)], 1)
    with torch.no_grad():
        logits = model(ref["full"], attention_mask=full_mask).logits
    real = full_mask.bool()  # left padding's logits are not compared
    got, want = logits[real].float(), ref["logits"][real].float()
    rel = ((got - want).norm() / want.norm()).item()
    steps = []
    for row, (ours, theirs, margins) in enumerate(zip(result.token_ids, ref["ids"], ref["margin"])):
        clear = next((i for i, m in enumerate(margins) if m < TIE_MARGIN), NEW_TOKENS)
        steps.append({"row": row, "clear_steps": clear, "same": ours[:clear] == theirs[:clear]})
    return {"rel": rel, "steps": steps, "width": width}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_gpu")
    model = make_hf_model("deepseek_v3", seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        rows = model.lm_head.weight.shape[0]
        model.lm_head.weight.mul_(torch.exp(torch.randn(rows, 1, generator=generator)))
    model.save_pretrained(path)
    return str(path)


def test_bf16_logits_and_greedy_ids_match_transformers(checkpoint):
    from moe_sbo.launch.ranks import LocalRanks

    with LocalRanks(2, device="cuda") as ranks:
        results = ranks.run(_compare_rank, checkpoint)
    for r in results:
        assert r["rel"] <= LOGIT_TOL, r
        assert all(s["same"] for s in r["steps"]), r
    # The comparison must not be vacuous: most rows run many steps before any near-tie.
    clear = [s["clear_steps"] for r in results for s in r["steps"]]
    assert sum(clear) >= len(clear) * NEW_TOKENS // 2, clear


def _graph_rank(device, path, prompts_per_rank):
    prompts = prompts_per_rank[dist.get_rank()]
    ref = _reference(path, prompts) if prompts else None
    options = {"max_tokens_per_rank": 5}
    model = load_model(
        path, dispatcher="alltoall", device=device, decode_dispatcher="low_latency", decode_dispatcher_options=options
    )
    runs = {}
    for decode in ("static", "cuda_graph", "cuda_graph"):  # the second graph run replays the kept graph
        runs.setdefault(decode, []).append(generate(model, prompts, NEW_TOKENS, eos_token_id=[], decode=decode))
    same_as_reference = []
    if ref is not None:
        for ours, theirs, margins in zip(runs["static"][0].token_ids, ref["ids"], ref["margin"]):
            clear = next((i for i, m in enumerate(margins) if m < TIE_MARGIN), NEW_TOKENS)
            same_as_reference.append(ours[:clear] == theirs[:clear])
    return {
        "static": runs["static"][0].token_ids,
        "graph": [r.token_ids for r in runs["cuda_graph"]],
        "forwards": [r.forwards for r in runs["static"] + runs["cuda_graph"]],
        "same_as_reference": same_as_reference,
    }


@pytest.mark.parametrize("prompts", [PROMPTS, [PROMPTS[0] + PROMPTS[1], []]], ids=["skewed", "idle-rank"])
def test_cuda_graph_decode_replays_exactly_the_static_loop(checkpoint, prompts):
    from moe_sbo.launch.ranks import LocalRanks

    with LocalRanks(2, device="cuda") as ranks:
        results = ranks.run(_graph_rank, checkpoint, prompts)
    for r in results:
        assert all(g == r["static"] for g in r["graph"]), r
        assert set(r["forwards"]) == {NEW_TOKENS}, r
        assert all(r["same_as_reference"]), r

"""The fused routing kernel (``routing/kernel.py``, Triton's interpreter on CPU) against the torch
router (``routing.select_experts``, itself held to the Hugging Face gates in ``test_hf_parity``): the
same set of experts per token and the same weights (float32, 1e-6), for every preset's routing, with
token counts that are not a power of two, zero tokens, NaN logits and a kept router bias."""

from __future__ import annotations

import pytest
import torch

from moe_sbo.config import PRESETS, get_preset
from moe_sbo.layer import MoELayer
from moe_sbo.routing import kernel as routing_kernels
from moe_sbo.routing.kernel import select_experts_fused
from moe_sbo.routing.router import Router, select_experts


def _by_id(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids_TK.argsort(dim=-1)
    return ids_TK.gather(1, order), weights_TK.gather(1, order)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_selection_equals_the_torch_router(preset, tokens):
    cfg = get_preset(preset)
    generator = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, cfg.num_experts, generator=generator) * 3
    bias = torch.randn(cfg.num_experts, generator=generator) * 0.3 if cfg.topk_method == "noaux_tc" else None
    want = select_experts(logits, cfg, bias)
    ids, weights = select_experts_fused(logits, cfg, bias)
    want_ids, want_weights = _by_id(want.topk_ids_TK, want.topk_weights_TK)
    got_ids, got_weights = _by_id(ids, weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)
    # Descending by the choice score (the biased one for noaux_tc), as documented.
    choice = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
    if bias is not None:
        choice = choice + bias
    ranked = choice.gather(1, ids)
    assert bool((ranked[:, :-1] >= ranked[:, 1:]).all())


def _selection_case(preset: str, top_k: int, tokens: int, device: str):
    """A preset's routing with ``top_k`` experts per token, random logits (and bias), and both paths'
    picks sorted by expert id: ``(fused ids, fused weights, torch ids, torch weights)``."""
    cfg = get_preset(preset).replace(num_experts_per_tok=top_k)
    generator = torch.Generator().manual_seed(1000 * top_k + tokens)
    logits = (torch.randn(tokens, cfg.num_experts, generator=generator) * 3).to(device)
    bias = None
    if cfg.topk_method == "noaux_tc":
        bias = (torch.randn(cfg.num_experts, generator=generator) * 0.3).to(device)
    want = select_experts(logits, cfg, bias)
    ids, weights = select_experts_fused(logits, cfg, bias)
    return (*_by_id(ids, weights), *_by_id(want.topk_ids_TK, want.topk_weights_TK))


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2-lite"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_fused_selection_equals_the_torch_router_for_small_top_k(preset, top_k):
    """Top-1 to top-3 (no preset ships them; the size-1 and odd axes are where a kernel goes wrong)."""
    ids, weights, want_ids, want_weights = _selection_case(preset, top_k, 37, "cpu")
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b"])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_compiled_selection_equals_the_torch_router_for_every_top_k(preset, top_k, tokens):
    ids, weights, want_ids, want_weights = _selection_case(preset, top_k, tokens, "cuda")
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_zero_tokens_and_nan_logits():
    cfg = get_preset("deepseek-v3")
    ids, weights = select_experts_fused(torch.empty(0, cfg.num_experts), cfg)
    assert ids.shape == (0, cfg.num_experts_per_tok) and weights.shape == ids.shape
    logits = torch.randn(3, cfg.num_experts)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    ids, weights = select_experts_fused(logits, cfg, torch.zeros(cfg.num_experts))
    assert bool(((ids >= 0) & (ids < cfg.num_experts)).all())  # real experts, whatever the logits
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in ids.tolist())  # no expert twice
    assert not weights[0].isnan().any() and weights[2].isnan().all()
    want = select_experts(logits[:1], cfg).topk_weights_TK[0]
    torch.testing.assert_close(weights[0], want.sort(descending=True).values)


def test_a_router_with_the_triton_kernel_gives_the_layer_the_same_output():
    layer = MoELayer(get_preset("tiny"), dispatcher="local", seed=3)
    x = torch.randn(29, layer.cfg.hidden_size)
    want = layer(x)
    layer.router.kernels = "triton"
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


def test_the_default_router_kernel_runs_torch_on_cpu_even_under_the_interpreter(monkeypatch):
    """``auto`` picks the Triton kernel for CUDA tensors only: on CPU the interpreter would be slow."""

    def refuse(*args, **kwargs):
        raise AssertionError("auto ran the Triton kernel on a CPU tensor")

    monkeypatch.setattr(routing_kernels, "select_experts_fused", refuse)
    router = Router(get_preset("tiny"))
    assert router.kernels == "auto"
    with torch.no_grad():
        router.weight.normal_()
    out = router(torch.randn(5, router.cfg.hidden_size))
    assert out.topk_ids_TK.shape == (5, router.cfg.num_experts_per_tok)


def test_an_unknown_router_kernel_is_refused():
    with pytest.raises(ValueError, match="kernels must be one of"):
        Router(get_preset("tiny"), kernels="cuda")


def test_the_former_kernel_keyword_still_chooses_the_router_kernel():
    with pytest.warns(DeprecationWarning, match="kernels="):
        router = Router(get_preset("tiny"), kernel="torch")
    assert router.kernels == "torch"


def test_the_triton_router_kernel_is_refused_where_triton_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    router = Router(get_preset("tiny"), kernels="triton")
    with pytest.raises(ValueError, match="kernels='triton' needs Triton and CUDA tensors"):
        router(torch.randn(2, router.cfg.hidden_size))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b"])
def test_fused_selection_on_cuda_equals_the_torch_router_and_replays_from_a_graph(preset, monkeypatch):
    from moe_sbo.streams import capture_graph

    cfg = get_preset(preset)
    router = Router(cfg, device="cuda")
    with torch.no_grad():
        router.weight.normal_(0, 0.02)
        router.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(4096, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    calls = []
    fused = routing_kernels.select_experts_fused
    monkeypatch.setattr(routing_kernels, "select_experts_fused", lambda *a: calls.append(1) or fused(*a))
    with torch.inference_mode():
        router.kernels = "torch"
        want = router(x)
        router.kernels = "auto"  # the default: the Triton kernel on CUDA
        got = router(x)
        assert calls == [1]
        out: list = []
        graph, _ = capture_graph(lambda: out.append(router(x)))
        x.copy_(torch.randn_like(x))
        graph.replay()
        again = router(x)
    ids, weights = _by_id(got.topk_ids_TK, got.topk_weights_TK)
    want_ids, want_weights = _by_id(want.topk_ids_TK, want.topk_weights_TK)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[-1].topk_ids_TK, again.topk_ids_TK)
    assert torch.equal(out[-1].topk_weights_TK, again.topk_weights_TK)

"""The absorbed MLA decode step (``moe_sbo.hf.mla``) against ``transformers``' own DeepSeek-V2/V3
attention, which expands the cached latents every step: the same logits at every decode step (float32,
within 1e-4 relative), with left padding, with a static and a growing cache, with and without a query
LoRA and with V3's interleaved rotary layout; prefill and uncached calls keep ``transformers``' path."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_blocks import make_hf_model
from moe_sbo.hf import mla

REL_TOL = 1e-4


def _model(family: str, q_lora_rank: int | None, rope_interleave: bool):
    base = make_hf_model(family, seed=3)
    config = copy.deepcopy(base.config)
    config.q_lora_rank = q_lora_rank
    if family == "deepseek_v3":
        config.rope_interleave = rope_interleave
    torch.manual_seed(4)
    model = type(base)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _cache(kind: str, model, max_len: int):
    from transformers import DynamicCache, StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len) if kind == "static" else DynamicCache()


def _decode_logits(model, cache_kind: str, steps: int = 4) -> list[torch.Tensor]:
    """Prefill two left-padded prompts, then ``steps`` greedy one-token steps; each step's logits."""
    ids = torch.tensor([[0, 0, 5, 9, 3], [7, 2, 11, 4, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cache = _cache(cache_kind, model, ids.shape[1] + steps)
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return out


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize(
    "family, q_lora_rank, rope_interleave",
    [("deepseek_v3", None, True), ("deepseek_v3", 12, False), ("deepseek_v2", None, False), ("deepseek_v2", 12, False)],
)
def test_absorbed_decode_steps_give_transformers_logits(family, q_lora_rank, rope_interleave, cache_kind, monkeypatch):
    reference = _model(family, q_lora_rank, rope_interleave)
    absorbed = copy.deepcopy(reference)
    assert mla.absorb_mla_decode(absorbed) == reference.config.num_hidden_layers
    assert mla.absorb_mla_decode(absorbed) == reference.config.num_hidden_layers  # once is enough
    calls = []
    latent_attention = mla.latent_attention
    monkeypatch.setattr(mla, "latent_attention", lambda *a: calls.append(a[2].shape) or latent_attention(*a))

    for want, got in zip(_decode_logits(reference, cache_kind), _decode_logits(absorbed, cache_kind), strict=True):
        assert (got - want).norm() <= REL_TOL * want.norm(), (got - want).abs().max()
    # Only the decode steps took the absorbed path (prefill ran transformers' own), each layer each step.
    assert len(calls) == 4 * reference.config.num_hidden_layers


def test_models_without_mla_are_left_alone():
    model = make_hf_model("qwen3_moe", seed=1)
    assert mla.absorb_mla_decode(model) == 0


def test_latent_attention_equals_expanded_attention_with_a_boolean_mask():
    """The bare function against SDPA over the explicitly expanded keys and values."""
    torch.manual_seed(0)
    batch, heads, length, nope, rot, rank, value = 3, 4, 7, 8, 4, 16, 6
    q_nope, q_rot = torch.randn(batch, heads, 1, nope), torch.randn(batch, heads, 1, rot)
    c, k_rot = torch.randn(batch, length, rank), torch.randn(batch, length, rot)
    w_kb, w_vb = torch.randn(heads, nope, rank), torch.randn(heads, value, rank)
    mask = torch.rand(batch, 1, 1, length + 2) > 0.3
    mask[..., 0] = True
    keys = torch.cat([torch.einsum("hdr,blr->bhld", w_kb, c), k_rot[:, None].expand(-1, heads, -1, -1)], -1)
    values = torch.einsum("hvr,blr->bhlv", w_vb, c)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q_nope, q_rot], -1), keys, values, attn_mask=mask[..., :length], scale=0.3
    )
    got = mla.latent_attention(q_nope, q_rot, c, k_rot, w_kb, w_vb, mask, 0.3)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_in_bf16_at_deepseek_v3_dims_the_absorbed_step_is_as_precise_as_transformers():
    """One decode step of a DeepSeek-V3-sized attention layer (128 heads, latent rank 512) in bf16,
    each path against float32 arithmetic on the same bf16-rounded weights and inputs: the absorbed
    step's error is transformers' own (measured: 5.5e-3 both), not larger."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, StaticCache

    config = DeepseekV3Config(
        hidden_size=7168, intermediate_size=64, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        vocab_size=64, num_hidden_layers=1, first_k_dense_replace=1,
    )  # fmt: skip
    torch.manual_seed(0)
    weights = DeepseekV3ForCausalLM(config).bfloat16().state_dict()
    batch, length = 2, 96
    prompt = torch.randn(batch, length - 1, config.hidden_size).bfloat16()
    token = torch.randn(batch, 1, config.hidden_size).bfloat16()

    def step(dtype: torch.dtype, absorb: bool) -> torch.Tensor:
        model = DeepseekV3ForCausalLM(config).to(dtype).eval()
        model.load_state_dict(weights)
        if absorb:
            mla.absorb_mla_decode(model)
        attn, rope = model.model.layers[0].self_attn, model.model.rotary_emb
        cache = StaticCache(config=config, max_cache_len=length)
        positions = torch.arange(length)[None].expand(batch, -1)
        with torch.no_grad():
            x = prompt.to(dtype)
            attn(
                hidden_states=x,
                attention_mask=None,
                position_embeddings=rope(x, positions[:, :-1]),
                past_key_values=cache,
            )
            x = token.to(dtype)
            mask = torch.zeros(batch, 1, 1, length, dtype=dtype)
            out, _ = attn(
                hidden_states=x,
                attention_mask=mask,
                position_embeddings=rope(x, positions[:, -1:]),
                past_key_values=cache,
            )
        return out.float()

    exact = step(torch.float32, absorb=False)
    error = {absorb: ((step(torch.bfloat16, absorb) - exact).norm() / exact.norm()).item() for absorb in (False, True)}
    assert error[True] <= 1.1 * error[False], error

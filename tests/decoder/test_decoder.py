"""The decoder layer's attention against Hugging Face ``LlamaAttention`` (same weights, same rotary
convention): packed prefill, a cut sequence attending to its cached first part, and decode steps."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from moe_sbo.config import get_preset
from moe_sbo.decoder.attention import Attention, AttentionConfig, Batch, KVCache, attend_after_prefix
from moe_sbo.decoder.decoder_layer import DecoderLayer
from moe_sbo.layer import MoELayer

ATTN = AttentionConfig(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    """Our attention and HF's, sharing random weights."""
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=ATTN.rope_theta,
        attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = LlamaAttention(cfg, layer_idx=0).float()
    ours = Attention(ATTN, dtype=torch.float32)
    with torch.no_grad():
        ours.qkv_proj.copy_(torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight]))
        ours.o_proj.copy_(hf.o_proj.weight)
    return ours, hf, LlamaRotaryEmbedding(cfg)


def _hf_sequence(hf, rope, x_TH):
    """HF attention over one whole sequence (causal)."""
    length = x_TH.shape[0]
    cos, sin = rope(x_TH[None], torch.arange(length)[None])
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    return hf(x_TH[None], position_embeddings=(cos, sin), attention_mask=mask)[0][0]


def test_packed_prefill_matches_hf_per_sequence(pair):
    ours, hf, rope = pair
    lengths = [5, 1, 17, 9]
    x = torch.randn(sum(lengths), 64)
    with torch.no_grad():
        y = ours(x, Batch.prefill(lengths), KVCache(ATTN, 4, 32, dtype=torch.float32, device="cpu"))
        for seq, part in zip(torch.split(x, lengths), torch.split(y, lengths)):
            torch.testing.assert_close(part, _hf_sequence(hf, rope, seq), **TOL)


def test_cut_sequence_and_decode_match_hf(pair):
    ours, hf, rope = pair
    x = torch.randn(20, 64)
    cache = KVCache(ATTN, 2, 32, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expected = _hf_sequence(hf, rope, x)
        first = ours(x[:12], Batch.prefill([12]), cache)  # slot 0, positions 0..11
        second = ours(x[12:19], Batch.prefill([7], starts=[12]), cache)  # attends to the cached 12
        last = ours(x[19:], Batch.decode_step(0, torch.tensor([19])), cache)  # one decode step
    torch.testing.assert_close(torch.cat([first, second, last]), expected, **TOL)


def test_decode_batch_of_sequences_with_different_lengths(pair):
    ours, hf, rope = pair
    lengths = [6, 3, 10]
    xs = [torch.randn(n + 1, 64) for n in lengths]
    cache = KVCache(ATTN, 3, 16, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        ours(torch.cat([x[:-1] for x in xs]), Batch.prefill(lengths), cache)
        step = ours(torch.stack([x[-1] for x in xs]), Batch.decode_step(0, torch.tensor(lengths)), cache)
        for i, x in enumerate(xs):
            torch.testing.assert_close(step[i], _hf_sequence(hf, rope, x)[-1], **TOL)


def test_decoder_layer_is_attention_then_moe_with_residuals():
    moe = MoELayer(get_preset("tiny"), dtype=torch.float32)
    layer = DecoderLayer(ATTN, moe, seed=2)
    x = torch.randn(10, 64)
    batch = Batch.prefill([4, 6])
    with torch.no_grad():
        y = layer(x, batch, layer.make_cache(2, 16))
        h = x + layer.attention(layer.input_norm(x), batch, layer.make_cache(2, 16))
        expected = h + moe(layer.post_attention_norm(h))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Batch.prefill([4, 40]), "needs 40 positions, the KV cache holds 32"),
        (lambda: Batch.prefill([4], slots=[5]), "cache slot 5 is outside the 2 slots"),
        (lambda: Batch.prefill([0]), "segment lengths must be >= 1"),
    ],
)
def test_bad_batches_are_named(make, message):
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dtype=torch.float32))
    with pytest.raises(ValueError, match=message), torch.no_grad():
        batch = make()
        layer(torch.randn(batch.num_tokens, 64), batch, layer.make_cache(2, 32))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="num_heads .8. must be a multiple of num_kv_heads .3."):
        AttentionConfig(64, 8, 3, 16)
    layer = DecoderLayer(ATTN, MoELayer(get_preset("tiny"), dtype=torch.float32))
    with pytest.raises(ValueError, match="x has 5 tokens but the batch describes 4"), torch.no_grad():
        layer(torch.randn(5, 64), Batch.prefill([4]), layer.make_cache(1, 8))


def _after_prefix_case(start: int, length: int, device: str, dtype: torch.dtype):
    """Random GQA queries, keys and values of a cut sequence's second part, and the explicit
    bottom-right mask's attention of them (the reference every way must give)."""
    generator = torch.Generator().manual_seed(start * 1000 + length)
    q = torch.randn(8, length, 128, generator=generator).to(device, dtype)
    k, v = torch.randn(2, 2, start + length, 128, generator=generator).to(device, dtype)
    mask = (
        torch.arange(start + length, device=device)[None, :] <= (start + torch.arange(length, device=device))[:, None]
    )
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
    return q, k, v, want[0]


@pytest.mark.parametrize("way", ["auto", "merge", "padded", "lower_right"])
@pytest.mark.parametrize("start, length", [(12, 7), (30, 7), (1, 1), (5, 40)])
def test_every_way_of_attending_after_a_prefix_equals_the_explicit_mask(way, start, length):
    """``attend_after_prefix`` (what CUDA runs for a cut sequence's second part) against the explicit
    bottom-right mask of the CPU path, GQA included, on CPU tensors."""
    q, k, v, want = _after_prefix_case(start, length, "cpu", torch.float32)
    torch.testing.assert_close(attend_after_prefix(q, k, v, start, gqa=True, way=way), want, rtol=1e-5, atol=1e-5)


def test_an_unknown_way_is_refused():
    with pytest.raises(ValueError, match="way must be one of"):
        attend_after_prefix(torch.zeros(2, 1, 4), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4), 1, False, way="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("way", ["auto", "merge", "padded", "lower_right"])
@pytest.mark.parametrize("start, length", [(300, 400), (600, 100), (1, 1), (2048, 2048)])
def test_every_way_of_attending_after_a_prefix_on_cuda(way, start, length):
    """Compiled kernels (cuDNN, FlashAttention-2), bf16, GQA: each way within bf16 tolerance of the
    explicit mask on the same GPU."""
    q, k, v, want = _after_prefix_case(start, length, "cuda", torch.bfloat16)
    torch.testing.assert_close(attend_after_prefix(q, k, v, start, gqa=True, way=way), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cut", [300, 600])
def test_a_cut_sequence_on_cuda_matches_the_whole_sequence(cut):
    """On CUDA the second part of a cut sequence runs ``attend_after_prefix`` with GQA and a head dim
    the fused kernels take: the same output as the uncut sequence within bf16 tolerance, as on CPU
    against Hugging Face."""
    cfg = AttentionConfig(hidden_size=512, num_heads=16, num_kv_heads=4, head_dim=128)
    torch.manual_seed(0)
    attn = Attention(cfg, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        attn.qkv_proj.normal_(0, 0.05)
        attn.o_proj.normal_(0, 0.05)
    x = torch.randn(700, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        whole = attn(x, Batch.prefill([700], device="cuda"), KVCache(cfg, 1, 704, dtype=torch.bfloat16, device="cuda"))
        cache = KVCache(cfg, 1, 704, dtype=torch.bfloat16, device="cuda")
        first = attn(x[:cut], Batch.prefill([cut], device="cuda"), cache)
        second = attn(x[cut:], Batch.prefill([700 - cut], starts=[cut], device="cuda"), cache)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=2e-2, atol=2e-2)


def test_auto_merges_only_where_it_was_measured(monkeypatch):
    """``auto`` takes ``merge`` on CPU and on compute-capability-9 GPUs for head dims cuDNN takes;
    ``lower_right`` (PyTorch's own path) on other GPUs and head dims."""
    from moe_sbo.decoder import attention

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(attention, "compute_capability", lambda device: (9, 0))
    assert attention._merge_measured(torch.device("cpu"), 256)
    assert attention._merge_measured(cuda, 128) and attention._merge_measured(cuda, 64)
    assert not attention._merge_measured(cuda, 192) and not attention._merge_measured(cuda, 100)
    monkeypatch.setattr(attention, "compute_capability", lambda device: (8, 0))
    assert not attention._merge_measured(cuda, 128)
    monkeypatch.setattr(attention, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert not attention._merge_measured(cuda, 128)

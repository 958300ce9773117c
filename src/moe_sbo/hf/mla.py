"""DeepSeek's multi-head latent attention (MLA) at decode steps, attending in the compressed latent
space instead of expanding the whole cache every step.

Legend: see ``moe_sbo/__init__.py``; here B is a batch, S query positions (1 at a decode step), L
cached positions, R the latent rank (``kv_lora_rank``), P the rotary dims, D and V a head's key
(no rotary) and value dims.

``transformers``' DeepSeek-V2/V3 attention caches the compressed latent ``c [B, 1, L, R]`` and the
shared rotary key ``k_rot [B, 1, L, P]`` (576 values per position for V3, not 128 heads x 448), and
then at every step expands the whole cache back: ``kv_b_proj`` over all L positions, and a copy into
a ``[B, H, L, D + P]`` key. At a decode step on an H200 that is about 175 us per layer for a
DeepSeek-V3 layer with B = 4 and L = 288 (a ~60 us GEMM, ~70 us of copies, ~45 us of attention),
a fifth of a whole graph-replayed step at EP2.

The expansion is linear, so it can be moved onto the few query rows instead (the "absorbed" form of
DeepSeek-V2's paper, as SGLang and vLLM decode). With ``W_kb[h] [D, R]`` and ``W_vb[h] [V, R]`` the
two halves of ``kv_b_proj``'s weight for head h::

    score[b, h, l] = scaling * ((q_nope[b, h] @ W_kb[h]) . c[b, l] + q_rot[b, h] . k_rot[b, l])
    out[b, h]      = (softmax_l(score + mask) @ c[b]) @ W_vb[h]^T

which reads the cache once (L x 576 values per sequence) and ``kv_b_proj``'s weight once. The
projections, norms, rotary embedding and cache update are the model's own modules and functions,
called as its forward calls them; only the attention over the cache is replaced. The scores and
softmax are float32 (the latent query and output are rounded to the weights' dtype once each).

``absorb_mla_decode(model)`` installs this on every MLA attention module of a loaded model: calls
with one query position and a cache take it; every other call (prefill, no cache, training, a 2-D
mask) runs ``transformers``' own forward unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


def absorb_mla_decode(model: nn.Module) -> int:
    """Give every MLA attention module of ``model`` the absorbed decode step; returns how many.

    A module is left as it is when its ``kv_b_proj`` is not a plain ``nn.Linear`` (a quantised
    layer has no weight to absorb) or its family is not one of ``MLA_FAMILIES``."""
    family = getattr(model.config, "model_type", None)
    if family not in MLA_FAMILIES:
        return 0
    count = 0
    for module in model.modules():
        if not hasattr(module, "kv_b_proj") or type(module.kv_b_proj) is not nn.Linear:
            continue
        if getattr(module.forward, "func", None) is _attention_forward:  # installed already
            count += 1
            continue
        rope = _rope_of(module, family)
        module.forward = functools.partial(_attention_forward, module, module.forward, rope)
        count += 1
    return count


def _rope_of(attention: nn.Module, family: str) -> Callable:
    """``(q_rot, k_rot, position_embeddings) -> (q_rot, k_rot)``: the model file's own rotary
    function, called as its attention forward calls it."""
    source = sys.modules[type(attention).__module__]
    if family == "deepseek_v2":
        return lambda q, k, freqs: source.apply_rotary_emb(q, k, freqs.to(q.device))
    interleave = getattr(attention.config, "rope_interleave", False)
    rotate = source.apply_rotary_pos_emb_interleave if interleave else source.apply_rotary_pos_emb
    return lambda q, k, cos_sin: rotate(q, k, *cos_sin)


def _attention_forward(
    attn: Any,
    transformers_forward: Callable,
    rope: Callable,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The module's forward: the absorbed step for one query position over a cache, else its own."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    batch, queries = hidden_states.shape[:2]
    if queries != 1 or cache is None or attn.training or (attention_mask is not None and attention_mask.dim() != 4):
        return transformers_forward(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    nope, rot, rank = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q_BHSX = q.view(batch, queries, -1, nope + rot).transpose(1, 2)
    q_nope_BHSD, q_rot_BHSP = torch.split(q_BHSX, [nope, rot], dim=-1)
    c, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [rank, rot], dim=-1)
    c_B1SR = attn.kv_a_layernorm(c).view(batch, 1, queries, rank)
    k_rot_B1SP = k_rot.view(batch, 1, queries, rot)
    q_rot_BHSP, k_rot_B1SP = rope(q_rot_BHSP, k_rot_B1SP, position_embeddings)
    c_B1LR, k_rot_B1LP = cache.update(c_B1SR, k_rot_B1SP, attn.layer_idx)
    weight_HXR = attn.kv_b_proj.weight.view(q_BHSX.shape[1], nope + attn.v_head_dim, rank)
    out_BSHV = latent_attention(
        q_nope_BHSD,
        q_rot_BHSP,
        c_B1LR[:, 0],
        k_rot_B1LP[:, 0],
        weight_HXR[:, :nope],
        weight_HXR[:, nope:],
        attention_mask,
        attn.scaling,
    )
    return attn.o_proj(out_BSHV.reshape(batch, queries, -1)), None


def latent_attention(
    q_nope_BHSD: torch.Tensor,
    q_rot_BHSP: torch.Tensor,
    c_BLR: torch.Tensor,
    k_rot_BLP: torch.Tensor,
    w_kb_HDR: torch.Tensor,
    w_vb_HVR: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of S query rows over L cached latents, ``kv_b_proj`` absorbed -> ``[B, S, H, V]``
    in the query's dtype (the layout ``transformers``' attention functions return).

    ``mask``: None (every position), or ``[B, 1, S, >= L]`` boolean (True: attend) or additive, as
    ``transformers`` builds it for SDPA; its first L positions are used."""
    batch, heads, queries, _ = q_nope_BHSD.shape
    length = c_BLR.shape[1]
    # q_nope[b, h] @ W_kb[h] for every head at once: [H, B*S, D] @ [H, D, R].
    q_nope_HND = q_nope_BHSD.permute(1, 0, 2, 3).reshape(heads, batch * queries, -1)
    q_lat_BNR = torch.bmm(q_nope_HND, w_kb_HDR).view(heads, batch, queries, -1).transpose(0, 1)
    q_lat_BNR = q_lat_BNR.reshape(batch, heads * queries, -1).float()
    c_BLR32 = c_BLR.float()
    scores_BNL = torch.bmm(q_lat_BNR, c_BLR32.transpose(1, 2))
    q_rot_BNP = q_rot_BHSP.reshape(batch, heads * queries, -1).float()
    scores_BNL = torch.baddbmm(scores_BNL, q_rot_BNP, k_rot_BLP.float().transpose(1, 2)).mul_(scaling)
    scores_BHSL = scores_BNL.view(batch, heads, queries, length)
    if mask is not None:
        mask = mask[..., :length]
        if mask.dtype == torch.bool:
            scores_BHSL = scores_BHSL.masked_fill(~mask, float("-inf"))
        else:
            scores_BHSL = scores_BHSL + mask
    probs_BNL = torch.softmax(scores_BHSL, dim=-1).view(batch, heads * queries, length)
    out_lat = torch.bmm(probs_BNL, c_BLR32).to(q_nope_BHSD.dtype)  # [B, H*S, R]
    out_lat_HNR = out_lat.view(batch, heads, queries, -1).permute(1, 0, 2, 3).reshape(heads, batch * queries, -1)
    out_HNV = torch.bmm(out_lat_HNR, w_vb_HVR.transpose(1, 2))
    return out_HNV.view(heads, batch, queries, -1).permute(1, 2, 0, 3)

"""The router's expert selection as one Triton kernel: gate logits -> top-k ids and weights.

Legend: see ``moe_sbo/__init__.py``; G groups of ``experts_per_group`` experts, padded to GP.

``routing.router.select_experts`` is 12-16 small torch ops (scores, bias, group scores, group top-k, a mask,
expert top-k, gather, normalise, scale): at decode sizes each is a launch of a few microseconds on
the device and ~15 us of host time in an eager forward, about 250 us of host time for DeepSeek-V3's
router. Here one program owns a token: it loads the token's E logits as a [G, GP] tile and does the
whole selection in registers, for every routing the presets use (``greedy``,
``group_limited_greedy``, ``noaux_tc``; softmax or sigmoid scores):

- group scores: the best (``group_limited_greedy``) or the two best (``noaux_tc``) choice scores of
  each group; the ``topk_group`` best groups are kept;
- experts: ``num_experts_per_tok`` rounds of "take the best remaining kept expert", so the ids come
  out in descending order of their choice score (``torch.topk(sorted=False)``'s order is
  unspecified: the two paths pick the same set, and the combine's sum is over the set);
- weights: the *unbiased* scores of the chosen experts, renormalised when ``norm_topk_prob``, times
  ``routed_scaling_factor``, float32, as ``select_experts``.

Ties between equal scores go to the lower index (torch's choice among ties is unspecified). A NaN
logit gives a NaN weight, as the torch path does; the chosen ids stay real experts (a NaN choice
score is ranked below every number, the padding below that), so a NaN never becomes an id the
dispatcher would reject. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (the tests hold it to
``select_experts``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import MoEConfig
from ..kernel_choice import lanes

_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
# Below every finite score, above the padding's -inf; a constexpr, as a compiled kernel reads no plain global.
_NAN_RANK = tl.constexpr(-3.0e38)


@triton.jit
def _select_experts_kernel(
    logits_ptr,  # [T, E] float32
    bias_ptr,  # [E] float32 (read when HAS_BIAS)
    ids_ptr,  # [T, K] int64
    weights_ptr,  # [T, K] float32
    stride_t,
    scale,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    PER_GROUP_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    METHOD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALISE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_PAD)[:, None]
    j = tl.arange(0, PER_GROUP_PAD)[None, :]
    valid = (g < GROUPS) & (j < PER_GROUP)
    expert = g * PER_GROUP + j  # [GP_G, GP] expert ids (meaningful where valid)
    x = tl.load(logits_ptr + token * stride_t + expert, mask=valid, other=float("-inf"))
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        shifted = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        shifted = tl.where(valid, shifted, 0.0)
        scores = shifted / tl.sum(tl.sum(shifted, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(choice != choice, _NAN_RANK, choice)  # NaN: ranked low, still a real expert
    choice = tl.where(valid, choice, float("-inf"))

    if METHOD != 0:  # group-limited: keep the TOPK_GROUP best groups
        best = tl.max(choice, axis=1)  # [GROUPS_PAD]
        if METHOD == 2:  # noaux_tc: a group's score is its two best choices
            first = tl.argmax(choice, axis=1)
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
            best = best + second
        group_ids = tl.arange(0, GROUPS_PAD)
        best = tl.where(group_ids < GROUPS, best, float("-inf"))
        best = tl.where(best != best, _NAN_RANK, best)
        kept = group_ids < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.argmax(best, axis=0)
            kept = kept | (group_ids == top)
            best = tl.where(group_ids == top, float("-inf"), best)
        choice = tl.where(kept[:, None], choice, float("-inf"))

    # K picks on the [groups, per group] tile itself: the best choice, the lowest expert id among ties
    # (as an argmax over the experts in order). No reshape to one axis: picks made on reshaped flat
    # copies of the tile gave permuted expert ids for top-1 under DeepSeek-V3's routing, compiled on an
    # H200 (the interpreter was right).
    picks = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for i in tl.static_range(K):
        best_choice = tl.max(tl.max(choice, axis=1), axis=0)
        top = tl.min(tl.min(tl.where(valid & (choice == best_choice), expert, GROUPS * PER_GROUP), axis=1), axis=0)
        hit = expert == top
        ids = tl.where(picks == i, top.to(tl.int64), ids)
        weights = tl.where(picks == i, tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0), weights)
        choice = tl.where(hit, float("-inf"), choice)
    if NORMALISE:  # the epsilon keeps an all-zero row finite (the reference models' own)
        weights = weights / (tl.sum(tl.where(picks < K, weights, 0.0), axis=0) + 1e-20)
    out = token * K + picks
    tl.store(ids_ptr + out, ids, mask=picks < K)
    tl.store(weights_ptr + out, weights * scale, mask=picks < K)


def select_experts_fused(
    logits_TE: torch.Tensor, cfg: MoEConfig, e_score_correction_bias_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.router.select_experts`` in one launch: ``(topk_ids_TK int64, topk_weights_TK float32)``."""
    logits_TE = logits_TE.float().contiguous()
    tokens, experts = logits_TE.shape
    k = cfg.num_experts_per_tok
    method = _METHODS[cfg.topk_method]
    groups = cfg.n_group if method else 1
    per_group = experts // groups
    if groups * per_group != experts or (method and cfg.topk_group > groups):
        raise ValueError(f"{experts} experts do not split into {groups} groups keeping {cfg.topk_group}")
    ids_TK = torch.empty(tokens, k, dtype=torch.int64, device=logits_TE.device)
    weights_TK = torch.empty(tokens, k, dtype=torch.float32, device=logits_TE.device)
    if tokens == 0:
        return ids_TK, weights_TK
    has_bias = method == 2 and e_score_correction_bias_E is not None
    bias_E = logits_TE  # unread without a bias
    if has_bias and e_score_correction_bias_E is not None:
        bias_E = e_score_correction_bias_E.float().contiguous()
    _select_experts_kernel[(tokens,)](
        logits_TE,
        bias_E,
        ids_TK,
        weights_TK,
        logits_TE.stride(0),
        float(cfg.routed_scaling_factor),
        GROUPS=groups,
        PER_GROUP=per_group,
        GROUPS_PAD=lanes(groups),
        PER_GROUP_PAD=lanes(per_group),
        TOPK_GROUP=cfg.topk_group if method else 1,
        K=k,
        K_PAD=lanes(k),
        SIGMOID=cfg.scoring_func == "sigmoid",
        METHOD=method,
        HAS_BIAS=has_bias,
        NORMALISE=bool(cfg.norm_topk_prob),
        num_warps=4,
    )
    return ids_TK, weights_TK

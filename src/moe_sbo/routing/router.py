"""The router: gate logits -> top-k expert ids and weights, for every routing the presets use.

Legend: see ``moe_sbo/__init__.py``.

The hard part is the group limit. DeepSeek-V2 ``group_limited_greedy`` scores a group by its best
expert's softmax score; DeepSeek-V3 ``noaux_tc`` scores it by the sum of its two best *biased* sigmoid
scores, and the ``e_score_correction_bias`` decides the selection only: the weights come from the
unbiased scores. Getting that last point wrong gives plausible-looking but different outputs.
All scoring is done in float32 whatever the activation dtype, as the reference models do.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..kernel_choice import HAS_TRITON, check_kernels, use_triton
from ..profiling import annotate

if HAS_TRITON:
    from . import kernel as routing_kernels


@dataclass(frozen=True)
class TopkOutput:
    """``topk_ids_TK`` int64 expert ids in [0, E); ``topk_weights_TK`` float32, scaling applied."""

    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor


def select_experts(
    logits_TE: torch.Tensor, cfg: MoEConfig, e_score_correction_bias_E: torch.Tensor | None = None
) -> TopkOutput:
    """Pick ``cfg.num_experts_per_tok`` experts per token from float32 gate logits ``[T, E]``.

    Weights are the chosen experts' scores (softmax or sigmoid), renormalised to sum 1 when
    ``cfg.norm_topk_prob``, then multiplied by ``cfg.routed_scaling_factor``. NaN logits give NaN
    weights (carried through to the output), never an error.
    """
    logits_TE = logits_TE.float()
    num_tokens = logits_TE.shape[0]
    k = cfg.num_experts_per_tok
    scores_TE = logits_TE.sigmoid() if cfg.scoring_func == "sigmoid" else logits_TE.softmax(dim=-1)

    if cfg.topk_method == "greedy":
        topk_ids_TK = torch.topk(scores_TE, k, dim=-1, sorted=False).indices
    else:
        if cfg.topk_method == "noaux_tc":
            bias_E = e_score_correction_bias_E
            choice_TE = scores_TE + bias_E.float() if bias_E is not None else scores_TE
            group_scores_TG = (
                choice_TE.view(num_tokens, cfg.n_group, cfg.experts_per_group).topk(2, dim=-1).values.sum(dim=-1)
            )
        else:  # group_limited_greedy
            choice_TE = scores_TE
            group_scores_TG = choice_TE.view(num_tokens, cfg.n_group, cfg.experts_per_group).amax(dim=-1)
        kept_groups = torch.topk(group_scores_TG, cfg.topk_group, dim=-1, sorted=False).indices
        # Dropped groups' experts can never be chosen. A broadcast over the group's experts, not an
        # expanded [T, E] mask: each small op is a kernel launch and host time at decode sizes.
        dropped_TG = torch.ones_like(group_scores_TG, dtype=torch.bool).scatter_(1, kept_groups, False)
        choice_TGX = choice_TE.view(num_tokens, cfg.n_group, cfg.experts_per_group)
        choice_TE = choice_TGX.masked_fill(dropped_TG[:, :, None], float("-inf")).view(num_tokens, cfg.num_experts)
        topk_ids_TK = torch.topk(choice_TE, k, dim=-1, sorted=False).indices

    topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    if cfg.norm_topk_prob:
        # The epsilon keeps an all-zero row finite (it is the reference models' own).
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights_TK = topk_weights_TK * cfg.routed_scaling_factor
    return TopkOutput(topk_ids_TK=topk_ids_TK, topk_weights_TK=topk_weights_TK)


class Router(nn.Module):
    """Gate ``weight [E, H]`` (float32) and, for ``noaux_tc``, ``e_score_correction_bias [E]``.

    ``logit_bias`` [E] float32 or None (default): added to the gate logits before scoring, under every
    routing method, so it changes the weights as well as the choice. No checkpoint has one (it is not
    in the state dict); it is the knob a synthetic load skew turns (``routing.skew``).

    ``kernels`` (``kernel_choice``'s vocabulary): ``"torch"`` selects the experts with
    ``select_experts`` (a dozen small ops); ``"triton"`` with ``kernel.select_experts_fused`` (one
    launch, the same experts and weights; on CPU under ``TRITON_INTERPRET=1``); ``"auto"`` (default)
    with the Triton kernel on CUDA tensors when Triton is installed and with ``select_experts``
    otherwise: for grouped routing one launch costs the host and the device less than a dozen
    (docs/BENCHMARKS.md, "Router"). Settable after construction (``router.kernels``), checked either
    way; ``kernel=`` is the keyword's former spelling, still taken (with a ``DeprecationWarning``). The
    kernel is held to the torch ops for top-1 to top-8 under each shipped preset's routing, compiled on
    the GPU and under the interpreter on CPU (``tests/routing/test_routing_kernels.py``)."""

    e_score_correction_bias: torch.Tensor  # a registered buffer (nn.Module types it Tensor | Module)
    logit_bias: torch.Tensor | None  # a registered buffer, outside the state dict

    def __init__(
        self,
        cfg: MoEConfig,
        device: torch.device | str | None = None,
        kernels: str = "auto",
        *,
        kernel: str | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        if kernel is not None:
            warnings.warn("Router(kernel=) is now spelled Router(kernels=)", DeprecationWarning, stacklevel=2)
            kernels = kernel
        self.kernels = kernels
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32, device=device))
        self.register_buffer(
            "e_score_correction_bias",
            torch.zeros(cfg.num_experts, dtype=torch.float32, device=device),
        )
        self.register_buffer("logit_bias", None, persistent=False)

    @property
    def kernels(self) -> str:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: str) -> None:
        check_kernels(kernels)
        if kernels == "triton" and not HAS_TRITON:
            raise ValueError("the router's kernels='triton' needs triton installed; use kernels='torch'")
        self._kernels = kernels

    def forward(self, x_TH: torch.Tensor) -> TopkOutput:
        with annotate("router"):
            logits_TE = F.linear(x_TH.float(), self.weight, self.logit_bias)
            bias_E = self.e_score_correction_bias if self.cfg.topk_method == "noaux_tc" else None
            if use_triton(self._kernels, logits_TE.device):
                ids_TK, weights_TK = routing_kernels.select_experts_fused(logits_TE, self.cfg, bias_E)
                return TopkOutput(topk_ids_TK=ids_TK, topk_weights_TK=weights_TK)
            return select_experts(logits_TE, self.cfg, bias_E)

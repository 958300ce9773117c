"""A skewed expert load through the real router: a per-expert gate-logit bias, calibrated so that the
router's tokens per expert on a sample batch follow a target load (e.g. ``eplb.zipf_load``).

Which bias: ``e_score_correction_bias`` takes part in the choice only under ``noaux_tc``
(DeepSeek-V3, Kimi-K2, ``tiny``); ``greedy`` (DeepSeek-V2-Lite, Qwen3-30B-A3B) and
``group_limited_greedy`` (DeepSeek-V2) never read it. So the skew is ``Router.logit_bias``, added
to the gate logits before scoring: under every routing method a larger logit ranks the expert higher,
in the group scores as well. It changes the chosen experts' weights too (a checkpoint's
``e_score_correction_bias`` is left as it is).

The hard part is what no bias can reach. An expert is picked at most once per token, so its share of
the picks is at most 1/K; under a group limit (DeepSeek-V3: the best 4 of 8 groups) it is picked only
with its group, so a hot expert drags its group-mates along. The calibration is a damped fixed point,
``bias += step * (log target_share - log measured_share)``, run on the device with no host read, that
keeps the best bias it met (the smallest L1 distance between the shares); ``SkewFit`` reports how
close the router came, measured through ``Router.forward`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .router import Router, select_experts


@dataclass(frozen=True)
class SkewFit:
    """How close a calibrated router's routing came to its target, on the calibration batch.

    ``target_share_E`` and ``measured_share_E``: [E] float64 on the CPU, each summing to 1 (the share
    of the T x K picks each expert drew). ``reached`` = sum over experts of min(measured, target): the
    share of the picks that land as the target puts them (1.0: exactly; 1 - the total variation
    distance). ``target_max_over_mean`` and ``measured_max_over_mean``: the hottest expert's share over
    the mean share, 1/E. ``most_reachable_share``: 1/K, one pick per token."""

    target_share_E: torch.Tensor
    measured_share_E: torch.Tensor
    reached: float
    target_max_over_mean: float
    measured_max_over_mean: float
    most_reachable_share: float
    steps: int


def pick_shares(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` float32 on the ids' device: each expert's share of the picks in ``topk_ids_TK`` [T, K]
    (ids < 0 are no pick). A scatter, not ``bincount``: no host read of the ids' maximum."""
    ids = topk_ids_TK.reshape(-1)
    valid = (ids >= 0).to(torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(0, ids.clamp(min=0), valid)
    return counts_E.float() / valid.sum().clamp(min=1).float()


@torch.no_grad()
def skew_router(
    router: Router, x_TH: torch.Tensor, target_E: torch.Tensor, *, steps: int = 40, step: float = 0.5
) -> SkewFit:
    """Set ``router.logit_bias`` so that the router's picks on ``x_TH`` [T, H] follow ``target_E`` [E]
    (any non-negative loads: tokens per expert, or ``zipf_load``); returns how close they came.

    ``steps`` fixed-point steps of ``step`` x the log-share error each (clamped to +-1 a step, and the
    shares smoothed by half a pick so that an expert with no pick gets a finite push); the bias with
    the smallest L1 share error wins. Deterministic: integer counts, a fixed number of steps. Every
    rank that calls it with the same router weights and the same ``x_TH`` gets the same bias.
    """
    cfg = router.cfg
    num_experts = cfg.num_experts
    target = _checked_target(target_E, num_experts)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not step > 0:
        raise ValueError(f"step must be > 0, got {step!r}")
    if x_TH.dim() != 2 or x_TH.shape[0] == 0 or x_TH.shape[1] != cfg.hidden_size:
        raise ValueError(
            f"x_TH must be [T, {cfg.hidden_size}] with T >= 1 tokens to calibrate on, got {tuple(x_TH.shape)}"
        )
    device = router.weight.device
    target_share_E = (target / target.sum()).to(device=device, dtype=torch.float32)
    picks = x_TH.shape[0] * cfg.num_experts_per_tok
    smooth = 0.5 / picks  # half a pick: log of a share that is 0 would be -inf
    log_target_E = (target_share_E + smooth).log()
    correction_E = router.e_score_correction_bias if cfg.topk_method == "noaux_tc" else None
    logits_TE = F.linear(x_TH.to(device).float(), router.weight)  # the bias only shifts them: computed once

    bias_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    best_bias_E = bias_E.clone()
    best_error = torch.full((), float("inf"), device=device)
    for _ in range(steps):
        ids_TK = select_experts(logits_TE + bias_E, cfg, correction_E).topk_ids_TK
        share_E = pick_shares(ids_TK, num_experts)
        error = (share_E - target_share_E).abs().sum()
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_bias_E = torch.where(better, bias_E, best_bias_E)
        bias_E = bias_E + (step * (log_target_E - (share_E + smooth).log())).clamp(-1.0, 1.0)

    if router.logit_bias is None:
        router.logit_bias = best_bias_E
    else:  # written in place: a CUDA graph captured over the router reads the new bias
        router.logit_bias.copy_(best_bias_E)
    measured_share_E = pick_shares(router(x_TH).topk_ids_TK, num_experts).double().cpu()
    target_cpu_E = target_share_E.double().cpu()
    target_cpu_E = target_cpu_E / target_cpu_E.sum()
    return SkewFit(
        target_share_E=target_cpu_E,
        measured_share_E=measured_share_E,
        reached=float(torch.minimum(measured_share_E, target_cpu_E).sum()),
        target_max_over_mean=float(target_cpu_E.max()) * num_experts,
        measured_max_over_mean=float(measured_share_E.max()) * num_experts,
        most_reachable_share=1.0 / cfg.num_experts_per_tok,
        steps=steps,
    )


def _checked_target(target_E: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``target_E`` as float64 on the CPU, after checking its shape and values."""
    if not isinstance(target_E, torch.Tensor) or target_E.dim() != 1 or target_E.numel() != num_experts:
        shape = tuple(target_E.shape) if isinstance(target_E, torch.Tensor) else type(target_E).__name__
        raise ValueError(
            f"the target load must be a [{num_experts}] tensor (one load per expert of the router), got {shape}; "
            "record it with the same model, or use eplb.zipf_load(num_experts, s)"
        )
    target = target_E.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(target).all()) or bool((target < 0).any()) or float(target.sum()) <= 0:
        raise ValueError("the target load must be finite, >= 0 and not all 0 (tokens per expert); check the load file")
    return target

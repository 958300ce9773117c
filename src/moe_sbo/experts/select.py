"""The rule table of the routed experts: which route (``routes.py``) runs their MLP for a device, the
rows' dtype, the rows per expert to expect and whether a CUDA graph is being captured.

Legend: see ``moe_sbo/__init__.py``.

``RoutedExperts.kernels`` (``kernel_choice``'s vocabulary, plus the route names) and the rules, r
being the real rows to expect per expert (padding excluded: ``DispatchOutput.expected_rows``):

- ``"auto"``, dense weights on CUDA with Triton: ``gemv`` for r <= ``GEMV_MAX_ROWS_PER_EXPERT``;
  ``tiled`` for r <= ``TILED_MAX_ROWS_PER_EXPERT``, or at any r for rows read through an index
  (``grouped_mm`` would need them copied first), where ``grouped_mm`` runs (bf16 on sm90+, the
  sizes its tiles were chosen for); else ``grouped_mm`` where it runs, ``expert_loop`` elsewhere.
  Off CUDA or without Triton: ``grouped_mm`` where it runs, else ``expert_loop``.
- ``"auto"``, FP8 weights on CUDA: ``fp8_sm90`` where it runs (sm90 with Gluon) for
  r > ``SM90_MIN_ROWS_PER_EXPERT`` (from ``SM90_CAPTURED_MIN_ROWS_PER_EXPERT`` under capture, where
  its host cost is paid once); ``scaled_mm`` where ``fp8_sm90`` does not run but cuBLAS's block-wise
  FP8 does, eagerly, for r >= ``SCALED_MM_MIN_ROWS_PER_EXPERT`` (below, its per-expert calls' host
  cost shows); else ``fp8_triton``. Off CUDA: ``fp8_torch``.
- ``"triton"``: the Triton routes by the same rules (dense: ``gemv``, else ``tiled`` at any size;
  FP8: ``fp8_sm90`` or ``fp8_triton``). ``"torch"``: ``grouped_mm`` or ``expert_loop`` with torch's
  SwiGLU, or ``fp8_torch``. A route's name forces that route.

The thresholds come from ``moe-sbo bench dense-experts`` and ``moe-sbo bench fp8-experts``
(docs/BENCHMARKS.md, "Dense routed experts"; docs/FP8.md). The hard part is that a forward must not
pay for the choice: ``choose`` is cached on ``Conditions``, whose rows enter only as the thresholds
they pass (``Rows``), so it is evaluated once per (device, dtype, rows bucket, capture).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..kernel_choice import check_kernels
from .conditions import Conditions
from .routes import (
    EXPERT_LOOP,
    FP8_SM90,
    FP8_TORCH,
    FP8_TRITON,
    GEMV,
    GROUPED_MM,
    ROUTES,
    SCALED_MM,
    TILED,
    Route,
)

DENSE_KERNELS = ("auto", "torch", "triton", "gemv", "tiled", "grouped_mm", "expert_loop")
FP8_KERNELS = ("auto", "torch", "triton", "fp8_triton", "fp8_sm90", "scaled_mm", "fp8_torch")


def _torch_dense(c: Conditions, swiglu: str) -> Route:
    route = GROUPED_MM if GROUPED_MM.supports(c) is None else EXPERT_LOOP
    return route if swiglu == "auto" else replace(route, swiglu=swiglu)


def _rule(c: Conditions, kernels: str) -> Route:
    """The route ``kernels`` asks for under ``c`` (the rule table; ``choose`` checks it runs)."""
    if kernels in ROUTES:
        return ROUTES[kernels]
    if not c.fp8:
        if kernels == "torch":
            return _torch_dense(c, "torch")
        if kernels == "auto" and (c.device_type != "cuda" or not c.triton):
            return _torch_dense(c, "auto")
        if c.rows.gemv:
            return GEMV
        if kernels == "triton":
            return TILED
        if (c.indexed or c.rows.tiled) and GROUPED_MM.supports(c) is None:
            return TILED
        return _torch_dense(c, "auto")
    if kernels == "torch" or (kernels == "auto" and c.device_type != "cuda"):
        return FP8_TORCH
    sm90 = FP8_SM90.supports(c) is None
    if kernels == "auto" and not sm90 and c.rows.scaled_mm and SCALED_MM.supports(c) is None:
        return SCALED_MM
    if sm90 and (c.rows.sm90 or (c.capture and c.rows.sm90_captured)):
        return FP8_SM90
    return FP8_TRITON


@functools.cache
def choose(c: Conditions, kernels: str) -> Route:
    """The route the experts run under ``c`` for ``kernels``; ``ValueError`` for a value outside the
    vocabulary (``DENSE_KERNELS`` / ``FP8_KERNELS``) or a route that cannot run here, with the reason."""
    check_kernels(kernels, backends=tuple(ROUTES))
    route = _rule(c, kernels)
    reason = route.supports(c)
    if reason is not None:
        weights = "FP8" if c.fp8 else "dense"
        raise ValueError(
            f"kernels={kernels!r} runs the {route.name!r} route for {weights} experts, which {reason}; "
            f"use one of {FP8_KERNELS if c.fp8 else DENSE_KERNELS} that runs here, e.g. 'auto'"
        )
    return route

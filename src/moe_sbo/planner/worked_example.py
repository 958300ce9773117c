"""The worked example, reproduced: its six figures from their formulas, beside what it printed.

The published back-of-envelope decode budget for DeepSeek-V3 (a worked example from a public analysis of
SGLang's overlap with DeepEP): a token is "7 KB", one all-to-all of 256 tokens is "1.78 MB", dispatch +
combine "3.56 MB" per layer, 61 layers "218 MB" per decode step, "10.9 GB/s" per GPU at TPOT 20 ms, and
each all-to-all must finish in (T - t) / 2 = 100 us when two micro-batches overlap attention with MoE
(its inputs: ``inputs.SEED_INPUTS``). Here it is evaluated exactly in **its convention** --
``hidden_size`` bytes per token, one send per token, the same bytes for dispatch and combine -- so each
figure can be checked (they agree within 1 %); ``bytes`` holds what an all-to-all really moves.

What is hard: **units.** The example mixes conventions: 1 KB = 1024 B (7168 B = "7 KB") but 1 MB = 1000
KB (256 x 7 KB = 1792 KB = "1.78 MB") and 1 GB = 1000 MB. Judged in SI units "1.78 MB" is 3.0 % below
1.835 MB; judged in its own units it is 0.7 % below 1.792. Everything in the planner is kept in bytes;
the worked example's units appear only in ``seed_figures`` and in the ``seed_*`` fields of the JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .inputs import ELEMENT_B, PlanInputs

# The worked example's own arithmetic: KB = 1024 B, then MB = 1000 KB and GB = 1000 MB (see module docstring).
SEED_KB_B = 1024
SEED_MB_B = 1000 * SEED_KB_B
SEED_GB_B = 1000 * SEED_MB_B

# The figures exactly as the worked example prints them: key -> (value, its unit). These are the reference
# the planner is checked against, not results: every exact value is computed by ``seed_figures``.
SEED_PRINTED = {
    "bytes_per_token": (7.0, "KB"),
    "bytes_per_a2a": (1.78, "MB"),
    "bytes_per_layer": (3.56, "MB"),
    "bytes_per_step": (218.0, "MB"),
    "required_GBps_per_gpu": (10.9, "GB/s"),
    "a2a_budget_us": (100.0, "us"),
}


@dataclass(frozen=True)
class SeedFigure:
    """One figure of the worked example: its formula, the exact value, and the worked example's rounding.

    ``exact``: in bytes, bytes/s or us (``exact_unit``); ``exact_seed_units``: the same in the worked example's
    units (KB = 1024 B, MB = 1000 KB, GB = 1000 MB); ``seed_rounded``: that to 3 significant figures;
    ``seed_printed``: what it printed (only for the worked example's own inputs); ``agreement``:
    seed_printed / exact_seed_units - 1; ``exact_si``: the exact value in SI units.
    """

    key: str
    label: str
    formula: str
    exact: float
    exact_unit: str
    seed_unit: str
    exact_seed_units: float
    seed_rounded: float
    seed_printed: float | None
    agreement: float | None
    exact_si: float
    si_unit: str


def round_sig(value: float, digits: int = 3) -> float:
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def seed_figures(inp: PlanInputs) -> list[SeedFigure]:
    """The worked example's six figures, each from its formula on ``inp`` in the worked example's convention.

    The worked example's convention: a token is H elements of the dispatch dtype (FP8: H bytes), sent once, the same
    bytes for dispatch and combine, every layer counted, the whole batch in one all-to-all.
    """
    cfg = inp.model
    h, elem = cfg.hidden_size, ELEMENT_B[inp.dispatch_dtype]
    token_B = h * elem
    a2a_B = inp.batch * token_B
    layer_B = 2 * a2a_B
    step_B = inp.seed_layers * layer_B
    per_second_Bps = step_B * 1000.0 / inp.tpot_ms
    budget_us = (inp.attn_us - inp.moe_us) / 2
    rows = [
        (
            "bytes_per_token",
            "token on the wire",
            f"hidden_size x {elem} B = {h} x {elem}",
            token_B,
            "B",
            SEED_KB_B,
            "KB",
            1e3,
            "kB",
        ),
        (
            "bytes_per_a2a",
            "one all-to-all",
            f"batch x token = {inp.batch} x {token_B} B",
            a2a_B,
            "B",
            SEED_MB_B,
            "MB",
            1e6,
            "MB",
        ),
        (
            "bytes_per_layer",
            "dispatch + combine per layer",
            f"2 x a2a = 2 x {a2a_B} B",
            layer_B,
            "B",
            SEED_MB_B,
            "MB",
            1e6,
            "MB",
        ),
        (
            "bytes_per_step",
            "all layers per decode step",
            f"layers x layer = {inp.seed_layers} x {layer_B} B",
            step_B,
            "B",
            SEED_MB_B,
            "MB",
            1e6,
            "MB",
        ),
        (
            "required_GBps_per_gpu",
            "per-GPU bandwidth at TPOT",
            f"step / TPOT = {step_B} B x (1000 / {inp.tpot_ms:g} ms)",
            per_second_Bps,
            "B/s",
            SEED_GB_B,
            "GB/s",
            1e9,
            "GB/s",
        ),
        (
            "a2a_budget_us",
            "TBO per-all-to-all budget",
            f"(T - t) / 2 = ({inp.attn_us:g} - {inp.moe_us:g}) / 2",
            budget_us,
            "us",
            1,
            "us",
            1,
            "us",
        ),
    ]
    figures = []
    for key, label, formula, exact, unit, seed_div, seed_unit, si_div, si_unit in rows:
        in_seed_units = exact / seed_div
        printed = SEED_PRINTED[key][0] if inp.is_seed_example else None
        agreement = None
        if printed is not None:
            agreement = printed / in_seed_units - 1 if in_seed_units else 0.0
        figures.append(
            SeedFigure(
                key=key,
                label=label,
                formula=formula,
                exact=exact,
                exact_unit=unit,
                seed_unit=seed_unit,
                exact_seed_units=in_seed_units,
                seed_rounded=round_sig(in_seed_units),
                seed_printed=printed,
                agreement=agreement,
                exact_si=exact / si_div,
                si_unit=si_unit,
            )
        )
    return figures

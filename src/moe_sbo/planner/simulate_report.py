"""The simulator against the measurements: calibration, rows as setups, held-out validation.

``calibrate`` fits every stage (``simulate_fit``) and then the attention's fixed cost per regime,
with the simulator itself: the residual of the decoder rows without TBO and without overlap.
``validate`` predicts every layer row of the result files that names its setup (MoE layers per
overlap mode, decoder layers with and without TBO, eager forwards issued back to back) from a
calibration fitted **without that row's group** — all modes and delays of one setup, so no
measurement of the setup itself (its floors, its references, its phase spans) is used for it.
The predictions at scale are ``simulate_scale``'s.
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..config import MoEConfig
from ..experts.routed import GEMV_MAX_ROWS_PER_EXPERT, TILED_MAX_ROWS_PER_EXPERT
from .simulate import (
    AttentionShape,
    Setup,
    back_to_back_us,
    predict,
)
from .simulate_fit import (
    GEMV,
    GEMV_MAX_ROWS,
    TILED,
    TILED_TMA,
    TMA_MIN_ROWS_PER_EXPERT,
    StageCosts,
    curve,
    fit_stage_costs,
)
from .simulate_rows import DEFAULT_KERNELS, MOE_LAYER_BENCHES, DispatchPath, ResultRow, dtype_name, path_of

# Where the model may be off: the bar for the EP1/EP2 rows.
VALIDATION_TOLERANCE = 0.15
# Cross-validation folds over setups: each row is predicted by a calibration without its fold.
VALIDATION_FOLDS = 10


def calibrate_simulator(rows: Sequence[ResultRow], keep: Callable[[str], bool] = lambda group: True) -> StageCosts:
    """Stage fits; then the eager host overhead per path (an eager ``none`` layer's time minus its
    CUDA-graph schedule); then the attention's fixed cost per regime (median residual of the decoder
    rows without TBO and without overlap; 0 when there are none). Only rows ``keep`` accepts count."""
    cal = fit_stage_costs(rows, keep)
    kept = [(r, s) for r in rows if keep(r.group) and (s := setup_of(r)) is not None and s.overlap == "none"]
    overhead: dict[DispatchPath, list[tuple[float, float]]] = {}
    for r, s in kept:
        if not s.graph and s.regime is None:
            gpu = predict(replace(s, graph=True), cal).t_layer_us
            for p in s.path.own_keys():
                overhead.setdefault(p, []).append((s.tokens, float(r.get("t_layer_us")) - gpu))
    cal = replace(cal, host={p: c for p, pts in overhead.items() if (c := curve(pts, trend=True)) is not None})
    residuals: dict[str, list[float]] = {}
    for r, s in kept:
        if s.regime is not None and not s.tbo:
            residuals.setdefault(s.regime, []).append(float(r.get("t_layer_us")) - predict(s, cal).t_layer_us)
    return replace(cal, attention_us={regime: statistics.median(v) for regime, v in residuals.items()})


# ---- rows as setups -------------------------------------------------------------------------------


def _attention(text: str | None) -> AttentionShape:
    """``"128x128 heads, 8 kv heads"`` (a TBO row's ``attention``) as a shape."""
    if not text:
        return AttentionShape()
    heads, rest = text.split("x", 1)
    head_dim = rest.split(" ", 1)[0]
    kv_heads = rest.split(",", 1)[1].strip().split(" ", 1)[0]
    return AttentionShape(int(heads), int(kv_heads), int(head_dim))


def setup_of(r: ResultRow) -> Setup | None:
    """The setup a row measured, or None for rows that are not a whole layer."""
    bench = r.get("bench")
    if bench not in (*MOE_LAYER_BENCHES, "tbo") or r.get("t_layer_us") is None:
        return None
    if r.get("tbo_policy") == "auto":  # AutoTbo's row repeats the setup of the fixed row it chose
        return None
    cfg: MoEConfig = r.cfg
    ep = r.ep
    experts_dtype = dtype_name(r.get("experts_dtype"))
    if bench == "fp8_layer":  # EP1 low_latency layer over ``experts`` routed experts, on the default path
        cfg = cfg.with_num_experts(int(r.get("experts")))
        row = {"dispatcher": "low_latency", "kernels": DEFAULT_KERNELS, "dispatch_dtype": r.get("dispatch_dtype")}
        return Setup(
            cfg,
            1,
            r.tokens,
            path_of(row, 1),
            graph=True,
            expert_dtype=experts_dtype,
            bytes_scheme="blocks",
            dense_rule=r.dense_rule,
            expert_path=r.expert_path,
        )
    dispatcher = str(r.get("dispatcher"))
    measured = None
    if r.get("dispatch_bytes_sent") is not None:
        measured = (float(r.get("dispatch_bytes_sent")), float(r.get("combine_bytes_sent", 0)))
    elif r.get("bytes_sent") is not None:
        measured = (float(r.get("bytes_sent")) / 2, float(r.get("bytes_sent")) / 2)
    default_scheme = {"low_latency": "blocks", "allgather": "allgather"}.get(dispatcher, "alltoall")
    setup = Setup(
        cfg,
        ep,
        r.tokens,
        r.path,
        wire=r.wire if ep > 1 else "nvlink",
        graph=r.graph,
        overlap=str(r.get("overlap", "none")),
        expert_dtype=experts_dtype,
        bytes_scheme="measured" if measured else default_scheme,
        capacity=r.get("capacity"),
        measured_bytes=measured,
        dense_rule=r.dense_rule,
        expert_path=r.expert_path,
    )
    if bench != "tbo":
        return setup
    if r.get("tbo") and dispatcher == "low_latency":
        # A TBO row's recorded bytes are its physical reference's: the whole batch through the layer's
        # own dispatcher (what ``t_wire_us`` moved). Each micro-batch sends capacity-sized blocks of its
        # own dispatcher, sized for its half: the blocks of ``capacity`` below.
        setup = replace(setup, bytes_scheme="blocks", measured_bytes=None)
    regime = str(r.get("regime"))
    return replace(
        setup,
        tbo=bool(r.get("tbo")),
        delay=int(r.get("delay", 0)),
        regime=regime,
        sequences=int(r.get("sequences_per_rank", r.tokens)),
        kv_len=int(r.get("kv_len", 0)),
        gemm_sm_budget=r.get("tbo_gemm_sm_budget"),
        attention=_attention(r.get("attention")),
        # Rows that record it: the capacity each forward's dispatcher had (TBO rows: one micro-batch's).
        capacity=int(r.get("capacity", r.tokens if regime == "prefill" else r.get("sequences_per_rank", r.tokens))),
    )


# ---- validation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """One measured row beside its prediction (``metric``: ``layer``, or ``b2b`` for eager forwards
    issued back to back); ``error`` = predicted / measured - 1."""

    file: str
    group: str
    label: str
    metric: str
    measured_us: float
    predicted_us: float

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1

    @property
    def within(self) -> bool:
        return abs(self.error) <= VALIDATION_TOLERANCE


def _label(r: ResultRow, s: Setup) -> str:
    parts = [f"EP{s.ep}", s.path.dispatcher or "", f"{s.experts_per_gpu}e/GPU"]
    if s.path.dispatcher == "low_latency":
        one_rank = s.path.transport in (None, "none")
        parts.append(str(s.path.kernels) if one_rank else f"{s.path.kernels}/{s.path.transport}")
    if s.path.dispatch_dtype == "fp8" or s.expert_dtype == "fp8":
        parts.append(f"fp8 {'experts' if s.expert_dtype == 'fp8' else 'dispatch'}")
    if r.get("expert_kernels") is not None:  # rows that set RoutedExperts.kernels: the setting, the path run
        ran = f": {s.expert_path}" if s.expert_path else ""
        parts.append(f"experts {r.get('expert_kernels')}{ran}")
    parts.append(f"{s.regime + ' ' if s.regime else ''}{r.tokens} tok")
    parts.append("graph" if s.graph else "eager")
    parts.append(s.overlap)
    if s.tbo:
        parts.append(f"TBO d{s.delay}")
    if s.wire not in ("nvlink",):
        parts.append(s.wire)
    return " ".join(p for p in parts if p)


def fold_of(group: str, folds: int) -> int:
    """A setup's fold: a stable hash of its group, so a run repeats exactly."""
    return zlib.crc32(group.encode()) % folds


def validate(rows: Sequence[ResultRow], folds: int = VALIDATION_FOLDS) -> list[Checked]:
    """Every layer row, predicted from a calibration that never saw its setup: ``folds``-fold cross
    validation over setups (each setup's fold is left out of the calibration that predicts it), or,
    with ``folds=0``, leave one setup out (one calibration per setup: slower, same idea)."""
    by_group: dict[str, list[tuple[ResultRow, Setup]]] = {}
    for r in rows:
        setup = setup_of(r)
        if setup is not None:
            by_group.setdefault(r.group, []).append((r, setup))
    held_out: dict[object, list[str]] = {}
    for group in by_group:
        held_out.setdefault(fold_of(group, folds) if folds else group, []).append(group)
    checked = []
    for groups in held_out.values():
        left_out = set(groups)
        cal = calibrate_simulator(rows, keep=lambda g: g not in left_out)
        for r, setup in (member for group in groups for member in by_group[group]):
            label = _label(r, setup)
            measured = float(r.get("t_layer_us"))
            checked.append(Checked(r.file, r.group, label, "layer", measured, predict(setup, cal).t_layer_us))
            if not setup.graph and r.get("t_layer_b2b_us"):
                b2b = back_to_back_us(setup, cal)
                checked.append(Checked(r.file, r.group, label, "b2b", float(r.get("t_layer_b2b_us")), b2b))
    return sorted(checked, key=lambda c: (c.file, c.group, c.metric, c.label))


def validation_summary(checked: Sequence[Checked]) -> list[tuple[str, ...]]:
    """Per file and metric: rows, median and max |error|, rows within the tolerance."""
    by_file: dict[tuple[str, str], list[Checked]] = {}
    for c in checked:
        by_file.setdefault((c.file, c.metric), []).append(c)
    lines: list[tuple[str, ...]] = []
    for (file, metric), group in sorted(by_file.items()):
        errors = [abs(c.error) for c in group]
        within = sum(c.within for c in group)
        lines.append(
            (
                file,
                metric,
                str(len(group)),
                f"{statistics.median(errors):.1%}",
                f"{max(errors):.1%}",
                f"{within}/{len(group)}",
            )
        )
    errors = [abs(c.error) for c in checked]
    if errors:
        within = sum(c.within for c in checked)
        lines.append(
            (
                "all",
                "",
                str(len(checked)),
                f"{statistics.median(errors):.1%}",
                f"{max(errors):.1%}",
                f"{within}/{len(checked)}",
            )
        )
    return lines


def repeatability(checked: Sequence[Checked]) -> dict[str, list[float]]:
    """How far two result files that measured the same setup disagree, by timing (``eager``/``graph``):
    max / min - 1 over the files, per setup: the floor under any prediction's error."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    for c in checked:
        values.setdefault((c.label, c.metric), {})[c.file] = c.measured_us
    spread: dict[str, list[float]] = {"eager": [], "graph": []}
    for (label, _), by_file in values.items():
        if len(by_file) >= 2:
            spread["graph" if " graph " in f" {label} " else "eager"].append(
                max(by_file.values()) / min(by_file.values()) - 1
            )
    return spread


def _gemm_stage(key: str) -> str:
    """What a ``StageCosts.gemm`` fit costs, and where layers run it (``simulate.dense_path``)."""
    if key == GEMV:
        return f"Triton GEMV, bf16 <= {GEMV_MAX_ROWS_PER_EXPERT} rows/expert (older code: <= {GEMV_MAX_ROWS} rows)"
    if key == TILED:
        return f"Triton tiled GEMM, bf16 > {GEMV_MAX_ROWS_PER_EXPERT}, < {TMA_MIN_ROWS_PER_EXPERT} rows/expert"
    if key == TILED_TMA:
        return (
            f"Triton tiled GEMM, descriptor loads, bf16 {TMA_MIN_ROWS_PER_EXPERT}-{TILED_MAX_ROWS_PER_EXPERT} "
            "rows/expert (any above with rows read in place)"
        )
    return f"grouped GEMM, {key} experts"


def calibration_lines(cal: StageCosts) -> list[tuple[str, str]]:
    """What the simulator fitted, one (stage, fit) line each, for the command line."""
    lines = []
    for key, fit in sorted(cal.gemm.items()):
        lines.append(
            (
                _gemm_stage(key),
                f"weights {fit.weight_GBps:,.0f} GB/s, {fit.TFLOPs:.0f} TFLOP/s, "
                f"knee {fit.knee:g} ({fit.samples} rows)",
            )
        )
    if cal.extra_tile:
        shares = ", ".join(f"{tile}-row tiles {share:.2f}" for tile, share in sorted(cal.extra_tile.items()))
        lines.append(("Triton tiled GEMM, each row tile past an expert's first", f"{shares} of a weight pass"))
    if cal.grouped_mm is not None:
        knots = cal.grouped_mm.knots
        shown = sorted({0, len(knots) // 2, len(knots) - 1})  # the ends and the middle of the counts
        rates = ", ".join(f"{knots[i][1]:,.0f} GB/s over {2 ** knots[i][0]:.0f}" for i in shown)
        lines.append(
            (
                "torch._grouped_mm weight stream, bf16",
                f"by experts with rows: {rates} ({len(knots)} counts, {cal.grouped_mm.samples} rows)",
            )
        )
    for name, gpu in (("router (GPU)", cal.route_gpu), ("shared experts (GPU)", cal.shared_gpu)):
        lines.append((name, ", ".join(f"{x:.0f} tok {y:.0f} us" for x, y in gpu.knots)))
    if cal.route_by_version:
        lines.append(("router (GPU), per code version", f"{len(cal.route_by_version)} curves, used where they span"))
    for wire, link in sorted(cal.links.items()):
        lines.append(
            (
                f"wire: {wire}",
                f"{link.latency_us:.1f} us + bytes / {link.GBps:.0f} GB/s ({link.source}, {link.samples} refs)",
            )
        )
    lines.append(
        ("dispatcher kernels", f"{len(cal.kernel)} graph curves, {len(cal.kernel_eager)} eager (per path, phase)")
    )
    lines.append(("eager host overhead", f"{len(cal.host)} curves (per path)"))
    c = cal.contention
    lines.append(
        (
            "contention",
            f"SM budget x{c.sm_budget_slowdown:.2f}, overlap efficiency {c.overlap_efficiency:.2f} ({c.source})",
        )
    )
    attention = ", ".join(f"{r} {v:+.0f} us" for r, v in sorted(cal.attention_us.items())) or "no TBO rows"
    lines.append(("attention fixed cost", attention))
    return lines

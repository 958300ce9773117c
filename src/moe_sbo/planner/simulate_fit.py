"""The simulator's calibration: per-stage costs fitted to this project's own result files.

Every number the simulator predicts with comes from ``{"meta", "rows"}`` files read at run time
(``simulate_rows.load_rows``), except the named constants below, which stand where no file measured the thing:

- grouped GEMM: a smooth roofline per expert weight dtype, ``max(weight read, rows x FLOPs)`` with a
  fitted knee, from the GEMM-only rows (``grouped_gemm``, ``fp8_experts``), and per dispatcher path a
  factor on the rows the layer's GEMM runs (routing imbalance, padded rows: more FLOPs, the same
  weight stream), fitted where the layer's routed span is FLOP-bound; bf16 ``torch._grouped_mm``
  streams the weights of the experts with rows only, at the rate ``bench_gemv`` measured it at for
  that many experts (``GroupedMmRate``, ``t_grouped_mm_us``; the roofline's rate without those
  rows); and the bf16 experts' two
  Triton kernels (``TRITON_FITS``), each the same roofline over the weights of the experts that have
  rows only (they skip the others), from the ``gemv`` rows' times of that kernel: the grouped GEMV
  (``GEMV``, ``t_gemv_us``, every size timed; it streams an expert's weights once per
  ``GEMV_BLOCK_ROWS`` of its rows, ``weight_passes`` over ``RowDraw``: bench_gemv's uniform draw of
  rows for its samples, the router's for layers) and the tiled grouped GEMM, ``t_tiled_us`` where
  layers run it (``simulate.dense_path`` says which ran): ``TILED`` over ``GEMV_MAX_ROWS_PER_EXPERT``
  and below ``TMA_MIN_ROWS_PER_EXPERT`` rows per expert (per-thread loads), ``TILED_TMA`` from there
  (descriptor loads, since ``simulate_rows.TILED_TMA_SINCE``; layers run the tiled GEMM that large
  when they read the received rows through the index, ``low_latency``'s ``index_rows``);
- router and shared experts: GPU time vs tokens, piecewise linear through the least time the rows
  that timed them alone measured at each size (``t_floor_*``, CUDA-graph ``t_shared_us``; some files
  timed them eagerly); the router also per code version (its code changed what it costs several
  times), used for that version's rows where its floors span the tokens (``StageCosts.router_us``);
- wire: ``latency + bytes / bandwidth`` per link class, least squares in relative error over the raw
  NCCL ``all_to_all_single`` references (``ref_t_dispatch_us``, ``ref_t_combine_us``) on that wire;
  a wire without references takes its files' measured ``meta.wire_all_to_all_GBps``;
- dispatcher kernels: each phase's CUDA-graph time minus the wire's, vs tokens, per dispatcher path;
- eager host overhead: a layer measured eagerly minus its CUDA-graph schedule, vs tokens, per path
  (``simulate_report.calibrate_simulator``, which needs the simulator);
- contention: the SM-budget slowdown and the overlap efficiency of a transfer launched before a GEMM,
  from the contention probe (``contention_*.json``).

What is hard is **honest validation**: the fits are functions of the rows they are given, so the
validator refits them without the rows it predicts (``keep``: a predicate on a row's ``group``).
Units: ``_us`` microseconds, ``_B`` bytes, ``_GBps`` 1e9 bytes/s; T = tokens per rank.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..config import MoEConfig, get_preset
from ..experts.routed import kernel_by_rows
from .links import positive_field
from .simulate_rows import (
    BY_ROWS_PER_EXPERT,
    BY_ROWS_TILED_TO_128,
    DEFAULT_PRESET,
    MOE_LAYER_BENCHES,
    TILED_MAX_BEFORE,
    TILED_TMA_BELOW_256,
    TILED_TMA_SINCE,
    DispatchPath,
    ResultRow,
    dtype_name,
    measured_since,
)

# ---- assumptions: named constants where no result file measures the thing -------------------------

# RDMA between nodes: ConnectX-7 400 Gb/s per GPU = 50 GB/s per direction (DeepEP reports 40-58 GB/s
# internode); latency an estimate (the planner's cx7 entry). No result file measures RDMA yet.
RDMA_GBPS = 50.0
RDMA_LATENCY_US = 20.0
# NCCL with NCCL_P2P_DISABLE=1 on 2x H200 (traffic through host memory): the all-to-all bandwidth
# measured at 236 MB per rank (sbo_wire_emulated-internode_h200x2.json, meta wire_all_to_all_GBps).
# Used only where the files given hold neither raw references on that wire (then it is fitted) nor
# a file meta's wire_all_to_all_GBps for it (then that measurement is used).
EMULATED_INTERNODE_GBPS = 24.1
# Fallbacks when no contention probe is among the files: no SM-budget slowdown, no overlap loss.
NO_CONTENTION_SLOWDOWN = 1.0
NO_CONTENTION_EFFICIENCY = 1.0
# The GPU's SMs when no contention probe names them: an H200's, the GPU every result file here ran on.
H200_SMS = 132
# Transports whose transfer runs on SMs (NCCL kernels, symmetric-memory stores); copy engines do not.
SM_TRANSPORTS = ("nccl", "symm_mem", "rdma")
# Knees tried for the grouped GEMM's smooth roofline (w^p + c^p)^(1/p); inf is a hard max.
KNEES = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, math.inf)
# ``StageCosts.gemm``'s keys for the Triton kernels of bf16 experts, beside the dtype keys of the
# grouped GEMMs: the grouped GEMV (``gemv_kernels``) and the tiled grouped GEMM (``grouped_gemm_kernels``),
# by the name of the path that runs each (``RoutedExperts.dense_path``, a row's ``expert_path``).
GEMV = "bf16-gemv"
TILED = "bf16-tiled"
TILED_TMA = "bf16-tiled-tma"
TRITON_FITS = {"gemv": GEMV, "tiled": TILED}
# ``bench_gemv``'s reference times of the same MLP through ``torch._grouped_mm``: the samples of its
# weight rate by experts with rows (``GroupedMmRate``).
GROUPED_MM = "bf16-grouped_mm"
# Each kernel's time in ``bench_gemv``'s rows (the calibration samples of its fit).
BENCH_GEMV_TIMES = {GEMV: "t_gemv_us", TILED: "t_tiled_us", TILED_TMA: "t_tiled_us", GROUPED_MM: "t_grouped_mm_us"}
# From this many rows per expert the tiled GEMM loads through tensor descriptors, another rate
# (``grouped_gemm_kernels.TMA_MIN_ROWS_PER_EXPERT``, not imported: that module imports Triton).
TMA_MIN_ROWS_PER_EXPERT = 256
# The rule of the code between ``simulate_rows.GEMV_SINCE`` and ``TILED_SINCE``: bf16 experts ran the
# GEMV up to this many rows handed to them in all, padding included.
GEMV_MAX_ROWS = 256
# The Triton GEMV's rows per ``tl.dot`` block (``gemv_kernels.BLOCK_M``, not imported: that module
# imports Triton, which the planner runs without). Each of its programs (one expert, 64 output
# columns) re-reads its [64, K] weight slice for every block of the expert's rows, and those slices
# together (0.26-0.9 MB each at DeepSeek-V3's dims, 64-112 programs per expert) far exceed an
# H200's 50 MB L2, so every block is another stream of the expert's weights from HBM.
GEMV_BLOCK_ROWS = 16
# Rows per weight pass of each Triton kernel that reads an expert's weights once per block of its rows
# (``weight_passes``): the GEMV's 16-row blocks, the tiled GEMM's row tiles (``grouped_gemm_kernels``:
# 64 rows up to 64 rows per expert on average, 128 above; constants, not imported: that module imports
# Triton). Every row tile is another tile's K loop and another place in the grid's waves: the same MLP
# on 8 experts at 128 rows per expert took 297-301 µs with the rows on random experts (about half the
# experts past one tile) against 221-230 µs with 128 on each (``gemv_{eager,graph}_{random,equal}8_
# h200x1.json``), so one pass per expert predicted the replayed EP1 layers with 8 experts per GPU at
# 128 tokens (128 rows on each) 25-31 % too slow. But a tile past an expert's first costs less than a
# whole pass: the tiles of one expert and column group run side by side (the grid sweeps the columns
# in groups of GROUP_M = 8) and a later one finds much of the weights in L2. What a further tile costs
# the per-thread loads' kernel is fitted per tile size from bench_gemv's two draws of the same rows
# (``fit_extra_tile``; pairs on one H200: 0.15-0.28 of a pass for 64-row tiles, 0.38-0.75 for 128-row
# tiles). The descriptor loads' kernel (``TILED_TMA``) keeps a whole pass per tile: its pairs are
# FLOP-bound from 512 rows per expert, where the ratio of the two draws says nothing of a tile's cost.
WEIGHT_PASS_ROWS = {GEMV: GEMV_BLOCK_ROWS}
TILED_TILE_ROWS = ((64, 64), (math.inf, 128))  # (up to this many rows per expert on average, tile rows)
EXTRA_TILE_MIN_PASSES = 0.1  # a pair's draws must differ by this many passes to say what a tile costs


# ---- fit primitives -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """y vs x, piecewise linear through the median y at each measured x (``knots``). Outside them, by
    default the end segment's line, rising with x (flat where the segment falls: GPU work does not
    shrink with more tokens); with ``trend`` the end segment's line either way (host overhead does
    shrink as the GPU work that hides it grows); never below 0."""

    knots: tuple[tuple[float, float], ...]
    trend: bool = False

    def __call__(self, x: float) -> float:
        pts = self.knots
        if len(pts) == 1:
            return pts[0][1]
        if x <= pts[0][0]:
            (x0, y0), (x1, y1) = pts[0], pts[1]
        elif x >= pts[-1][0]:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
        else:
            (x0, y0), (x1, y1) = next(seg for seg in zip(pts, pts[1:]) if seg[0][0] <= x <= seg[1][0])
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        slope = (y1 - y0) / (x1 - x0)
        slope = slope if self.trend else max(0.0, slope)
        return max(0.0, (y0 if x <= x0 else y1) + slope * (x - (x0 if x <= x0 else x1)))

    def covers(self, x: float) -> bool:
        return self.knots[0][0] <= x <= self.knots[-1][0]


def first_fit(table: dict, keys: Iterable, x: float) -> Curve | None:
    """The first of ``keys`` in ``table`` whose curve spans ``x``, else the first there at all: a fit is
    used inside its measured range before another's, however specific, is stretched beyond its own."""
    found = [table[k] for k in keys if k in table]
    return next((c for c in found if c.covers(x)), found[0] if found else None)


def curve(
    points: Iterable[tuple[float, float]],
    pick: Callable[[list[float]], float] = statistics.median,
    trend: bool = False,
) -> Curve | None:
    """The ``Curve`` through ``pick`` (the median, or ``min`` for a GPU time that eager timings of the
    same work can only lengthen) of the y measured at each x; ``trend``: see ``Curve``."""
    by_x: dict[float, list[float]] = defaultdict(list)
    for x, y in points:
        if math.isfinite(x) and math.isfinite(y):
            by_x[float(x)].append(float(y))
    if not by_x:
        return None
    return Curve(tuple((x, pick(ys)) for x, ys in sorted(by_x.items())), trend)


@dataclass(frozen=True)
class LinkFit:
    """One all-to-all on a link class: ``latency_us + bytes / (GBps * 1e3)`` per rank."""

    latency_us: float
    GBps: float
    samples: int
    source: str

    def time_us(self, bytes_B: float) -> float:
        return 0.0 if bytes_B <= 0 else self.latency_us + bytes_B / (self.GBps * 1e3)


def fit_link(points: Sequence[tuple[float, float]], source: str) -> LinkFit | None:
    """Least squares of ``t = a + b * bytes`` weighted by 1/t^2 (relative error, so the small
    messages that set the latency count as much as the large ones that set the bandwidth)."""
    pts = [(b, t) for b, t in points if b > 0 and t > 0]
    if len({b for b, _ in pts}) < 2:
        return None
    w = [1.0 / t**2 for _, t in pts]
    sw = sum(w)
    mx = sum(wi * b for wi, (b, _) in zip(w, pts)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, pts)) / sw
    sxx = sum(wi * (b - mx) ** 2 for wi, (b, _) in zip(w, pts))
    slope = sum(wi * (b - mx) * (t - my) for wi, (b, t) in zip(w, pts)) / sxx
    if slope <= 0:
        return None
    return LinkFit(max(0.0, my - slope * mx), 1.0 / (slope * 1e3), len(pts), source)


@dataclass(frozen=True)
class GemmFit:
    """The grouped GEMM of routed experts (gate_up, SiLU-mul, down) as a smooth roofline:
    ``(w^p + c^p)^(1/p)`` with w = L experts' weight bytes / ``weight_GBps`` and c = the rows' FLOPs /
    ``TFLOPs``; ``knee`` p (inf: a hard max). ``experts`` may be an expected, fractional count (the
    GEMV's experts with rows)."""

    weight_GBps: float
    TFLOPs: float
    knee: float
    samples: int

    def parts_us(
        self, experts: float, rows_per_expert: float, hidden: int, inter: int, weight_B: float
    ) -> tuple[float, float]:
        """(weight stream, FLOPs) in µs: the roofline's two bounds."""
        w = experts * 3 * hidden * inter * weight_B / (self.weight_GBps * 1e3)
        c = experts * rows_per_expert * 6 * hidden * inter / (self.TFLOPs * 1e6)
        return w, c

    def time_us(self, experts: float, rows_per_expert: float, hidden: int, inter: int, weight_B: float) -> float:
        if experts <= 0:
            return 0.0
        w, c = self.parts_us(experts, rows_per_expert, hidden, inter, weight_B)
        return smooth_max(w, c, self.knee)

    def rows_factor(self, t_us: float, weights_us: float, flops_us: float) -> float:
        """The factor f on the rows for which ``smooth_max(weights, f x flops)`` is ``t_us`` (inverse of
        ``time_us`` in the rows; 1 where ``t_us`` does not exceed the weight stream)."""
        if t_us <= weights_us or flops_us <= 0:
            return 1.0
        if math.isinf(self.knee):
            return t_us / flops_us
        return (t_us**self.knee - weights_us**self.knee) ** (1 / self.knee) / flops_us


def smooth_max(a: float, b: float, p: float) -> float:
    if math.isinf(p):
        return max(a, b)
    top = max(a, b)
    return 0.0 if top <= 0 else top * ((a / top) ** p + (b / top) ** p) ** (1 / p)


def clamped_line(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear through ``points`` (sorted by x), flat beyond the first and the last."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    (x0, y0), (x1, y1) = next(seg for seg in zip(points, points[1:]) if seg[0][0] <= x <= seg[1][0])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class GroupedMmRate:
    """The rate ``torch._grouped_mm`` (bf16) streams its weights at, by how many experts have rows:
    ``bench_gemv``'s weight-bound times of the routed MLP through it (its FLOPs under a quarter of
    the weight read: at most 32 rows per expert, one row tile each), over the weights of the experts
    that had rows (it skips the empty ones). One rate misses it both ways: on one H200 it streamed
    2.3-2.4 TB/s over 6-8 experts, 2.9 over 32 and 3.2 over 256 (more experts, more tiles in flight),
    where the roofline's one rate (fitted on larger GEMMs) says 3.0.

    ``knots``: (log2 experts with rows, GB/s), the median at each count measured; ``GBps``
    interpolates linearly in log2 of the count, flat beyond the counts measured. The FLOP-bound side
    keeps the roofline's rate: ``bench_gemv`` puts each row on a random expert, so at 64 rows per
    expert and more some experts get a row tile more than the router's draw gives them
    (``dense_gemm_config_tma_h200x1.json``: 8 experts with 128 rows each took 236 µs through
    torch._grouped_mm, ``gemv_h200x1.json``: 128 rows per expert drawn at random 436 µs), so those
    times describe its draw, not a layer's."""

    knots: tuple[tuple[float, float], ...]
    samples: int

    def GBps(self, experts: float) -> float:
        return clamped_line(self.knots, math.log2(max(experts, 1.0)))


def fit_grouped_mm_rate(samples: Sequence[tuple[float, float, float]], fit: GemmFit) -> GroupedMmRate | None:
    """``samples``: (experts with rows, rows per expert with rows, µs) of ``torch._grouped_mm``, bf16,
    DeepSeek-V3's dims; ``fit``: the bf16 roofline, whose rates say which samples are weight-bound."""
    v3 = get_preset(DEFAULT_PRESET)
    by_count: dict[float, list[float]] = defaultdict(list)
    for touched, per_expert, t_us in samples:
        w, c = fit.parts_us(touched, per_expert, v3.hidden_size, v3.moe_intermediate_size, WEIGHT_B["bf16"])
        if c < 0.25 * w:
            by_count[math.log2(touched)].append(
                touched * 3 * v3.hidden_size * v3.moe_intermediate_size * 2 / (t_us * 1e3)
            )
    if not by_count:
        return None
    knots = tuple((x, statistics.median(v)) for x, v in sorted(by_count.items()))
    return GroupedMmRate(knots, sum(len(v) for v in by_count.values()))


WEIGHT_B = {"bf16": 2.0, "fp8": 1.0}  # bytes per weight element (fp8 block scales: 0.006 %, left out)


class RowDraw(NamedTuple):
    """How R rows land on L local experts: each expert's rows n ~ Binomial(``trials``, ``p``), the
    experts alike. The Triton kernels read only the experts with rows, the GEMV once per 16 of an
    expert's rows, so their cost is an expectation over this draw. Two draws, each R / L rows per
    expert on average, are used where each is how the rows were drawn:

    - ``uniform``: each of the R rows lands on one of the L experts (trials R, p = 1 / L). How
      ``bench_gemv`` draws its rows (``torch.randint`` over L), so its rows, the GEMV's and the tiled
      GEMM's calibration samples, are read over it (its ``--draw equal`` rows over ``even``: R / L on
      each);
    - ``routing``: each token that reaches the rank (T per rank from each of P ranks) picks top-k
      distinct experts of the model's N, each with probability k / N, so an expert gets n ~
      Binomial(T P, k / N). How a layer's router draws them, so layer predictions use it. Less spread
      than the uniform draw (top-8 of 8 experts: exactly T P rows on each)."""

    trials: float
    p: float

    @classmethod
    def uniform(cls, experts: int, rows: float) -> RowDraw:
        """``rows`` rows, each on one of ``experts`` experts at random (``bench_gemv``)."""
        return cls(rows, 1.0 / experts if experts > 0 else 0.0)

    @classmethod
    def even(cls, experts: int, rows: float) -> RowDraw:
        """``rows`` rows, R / L on every one of ``experts`` experts (``bench_gemv --draw equal``)."""
        return cls(rows / experts if experts > 0 else 0.0, 1.0)

    @classmethod
    def routing(cls, cfg: MoEConfig, experts: int, rows: float) -> RowDraw:
        """``rows`` real (token, expert) rows on a rank's ``experts`` of the model's N, routed top-k:
        T P = rows N / (k L) tokens reach the rank, each on a given expert with probability k / N."""
        n, k = cfg.num_experts, cfg.num_experts_per_tok
        return cls(rows * n / (k * experts) if experts > 0 else 0.0, k / n)

    def some_rows(self) -> float:
        """P(n > 0) = 1 - (1 - p)^trials: 1 at p = 1, 0 without trials or at p = 0."""
        if self.trials <= 0 or self.p <= 0:
            return 0.0
        return 1.0 if self.p >= 1 else -math.expm1(self.trials * math.log1p(-self.p))


def expected_experts_with_rows(experts: int, draw: RowDraw) -> float:
    """Of ``experts`` L local experts, how many get at least one row under ``draw``: L P(n > 0)."""
    return max(0, experts) * draw.some_rows()


@functools.lru_cache(maxsize=4096)
def expected_weight_passes(draw: RowDraw, block_rows: int) -> float:
    """How many times a kernel that reads an expert's weights once per ``block_rows`` of its rows reads
    them, on average over the experts that have rows: E[ceil(n / block_rows) | n > 0], n ~
    Binomial(trials, p) (``draw``). Exact, summed over the binomial's pmf; 1 while no expert can get
    more than a block (and as p -> 0: an expert with rows then has one); ceil(trials / block_rows)
    at p = 1 (every expert gets every trial)."""
    trials, p = round(draw.trials), draw.p
    if trials <= block_rows or p <= 0:
        return 1.0
    if p >= 1:
        return float(math.ceil(trials / block_rows))
    log_p, log_q, log_all = math.log(p), math.log1p(-p), math.lgamma(trials + 1)

    def pmf(n: int) -> float:
        return math.exp(log_all - math.lgamma(n + 1) - math.lgamma(trials - n + 1) + n * log_p + (trials - n) * log_q)

    passes = sum(pmf(n) * math.ceil(n / block_rows) for n in range(1, trials + 1))
    return passes / RowDraw(trials, p).some_rows()


def tile_rows(draw: RowDraw) -> int:
    """The row tile the tiled GEMM's config takes for ``draw``'s mean rows per expert (``TILED_TILE_ROWS``)."""
    return next(rows for up_to, rows in TILED_TILE_ROWS if draw.trials * draw.p <= up_to)


def weight_passes(key: str, draw: RowDraw, extra_tile: Mapping[int, float] | None = None) -> float:
    """Expected weight streams per expert with rows of the Triton kernel ``key`` (``GEMV``, ``TILED``,
    ``TILED_TMA``) under ``draw``: ``expected_weight_passes`` at the kernel's rows per pass (the GEMV's
    ``WEIGHT_PASS_ROWS``; the tiled GEMM's row tile, ``tile_rows``), 1 for a kernel that reads each
    expert's weights once. ``extra_tile``: tile rows -> what each tile past an expert's first costs the
    tiled GEMM with per-thread loads, as a fraction of a pass (``fit_extra_tile``; a whole pass where
    it has no value), so its passes are 1 + fraction x (tiles - 1)."""
    if key in (TILED, TILED_TMA):
        tile = tile_rows(draw)
        tiles = expected_weight_passes(draw, tile)
        fraction = extra_tile.get(tile, 1.0) if key == TILED and extra_tile else 1.0
        return 1.0 + fraction * (tiles - 1.0)
    block_rows = WEIGHT_PASS_ROWS.get(key)
    return 1.0 if block_rows is None else expected_weight_passes(draw, block_rows)


def fit_extra_tile(rows: Sequence[ResultRow]) -> dict[int, float]:
    """Tile rows -> what a row tile past an expert's first costs the tiled GEMM with per-thread loads,
    as a fraction of a weight pass, from ``bench_gemv`` rows that timed the same experts and rows with
    both draws (``--draw random`` and ``--draw equal``, the same timer): weight-bound, the time is
    proportional to 1 + a (tiles - 1) per expert, so the ratio rho of the two draws' median times, with
    tiles P_r (random) and P_e (equal) per expert, gives a = (rho - 1) / (P_r - 1 - rho (P_e - 1)).
    The median over the pairs of each tile size, within [0, 1]; pairs whose draws differ by less than
    ``EXTRA_TILE_MIN_PASSES`` tiles say nothing and are skipped."""
    times: dict[tuple[int, float, bool], dict[str, list[float]]] = defaultdict(lambda: {"random": [], "equal": []})
    for r in rows:
        draw, t, total = r.get("draw"), _positive(r, BENCH_GEMV_TIMES[TILED]), _positive(r, "rows")
        experts = int(r.get("experts", 0) or 0)
        if r.get("bench") != "gemv" or draw not in ("random", "equal") or not (t and total and experts > 0):
            continue  # rows before the ``draw`` field have no equal-draw partner in their run
        if _tiled_per_thread(r, total, experts):
            times[(experts, total, bool(r.get("graph")))][draw].append(t)
    by_tile: dict[int, list[float]] = defaultdict(list)
    for (experts, total, _), drawn in times.items():
        if not drawn["random"] or not drawn["equal"]:
            continue
        random_draw, even_draw = RowDraw.uniform(experts, total), RowDraw.even(experts, total)
        tile = tile_rows(random_draw)
        p_r, p_e = expected_weight_passes(random_draw, tile), expected_weight_passes(even_draw, tile)
        if p_r - p_e < EXTRA_TILE_MIN_PASSES:
            continue
        rho = statistics.median(drawn["random"]) / statistics.median(drawn["equal"])
        by_tile[tile].append((rho - 1) / ((p_r - 1) - rho * (p_e - 1)))
    return {tile: min(1.0, max(0.0, statistics.median(values))) for tile, values in by_tile.items()}


def fit_gemm(samples: Sequence[tuple[float, float, int, int, float, float]]) -> GemmFit | None:
    """``samples``: (experts, rows per expert, H, I, weight bytes per element, µs). The rate of each
    bound is the median over the samples that bound clearly dominates (the other term < 1/4 of it),
    starting from the best rate seen; then the knee that minimises the squared log error."""
    if len(samples) < 2:
        return None

    def bytes_(s):
        return s[0] * 3 * s[2] * s[3] * s[4]

    def flops(s):
        return s[0] * s[1] * 6 * s[2] * s[3]

    gbps = max(bytes_(s) / (s[5] * 1e3) for s in samples)
    tflops = max(flops(s) / (s[5] * 1e6) for s in samples)
    for _ in range(4):  # classify by the current rates, re-estimate each rate on its side
        w_us = {i: bytes_(s) / (gbps * 1e3) for i, s in enumerate(samples)}
        c_us = {i: flops(s) / (tflops * 1e6) for i, s in enumerate(samples)}
        w_bound = [s for i, s in enumerate(samples) if c_us[i] < 0.25 * w_us[i]]
        c_bound = [s for i, s in enumerate(samples) if w_us[i] < 0.25 * c_us[i]]
        if w_bound:
            gbps = statistics.median(bytes_(s) / (s[5] * 1e3) for s in w_bound)
        if c_bound:
            tflops = statistics.median(flops(s) / (s[5] * 1e6) for s in c_bound)

    def error(p: float) -> float:
        fit = GemmFit(gbps, tflops, p, len(samples))
        return sum(math.log(fit.time_us(s[0], s[1], s[2], s[3], s[4]) / s[5]) ** 2 for s in samples)

    return GemmFit(gbps, tflops, min(KNEES, key=error), len(samples))


# ---- the calibration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contention:
    """What sharing the SMs costs: ``sm_budget_slowdown`` of a GEMM planned for the SMs ``combine_sm``
    leaves it, and ``overlap_efficiency`` of a transfer on SMs launched before a GEMM (1: the
    transfer fully hidden; the GEMM is stretched by (1 - efficiency) x the time they overlap), and the
    GPU's ``sms``."""

    sm_budget_slowdown: float
    overlap_efficiency: float
    source: str
    sms: int = H200_SMS  # the GPU's SMs (the probe's; an H200's without one)
    gemm_us_by_sms: Curve | None = None  # the probe's GEMM alone, µs vs the SMs it planned for

    def gemm_slowdown(self, sm_budget: int) -> float:
        """How much longer a GEMM planned for ``sm_budget`` of the GPU's SMs takes than on all of them:
        from the probe's measured curve where there is one, else ``sms / sm_budget``."""
        if self.gemm_us_by_sms is not None:
            return self.gemm_us_by_sms(sm_budget) / self.gemm_us_by_sms(self.sms)
        return self.sms / sm_budget


@dataclass(frozen=True)
class StageCosts:
    """Everything the simulator predicts with (see the module docstring), and where it came from."""

    gemm: dict[str, GemmFit]  # by expert weight dtype; ``GEMV``: the bf16 experts' Triton grouped GEMV
    routed_factor: dict[DispatchPath, float]  # factor on the GEMM's rows in the layer, per path (and wildcards)
    route_gpu: Curve
    shared_gpu: Curve
    kernel: dict[tuple[DispatchPath, str], Curve]  # (path, "dispatch" | "combine") -> GPU work besides the wire
    kernel_eager: dict[tuple[DispatchPath, str], Curve]  # the same from eager spans, for paths never replayed
    host: dict[DispatchPath, Curve]  # path -> host time an eager forward adds to its GPU schedule
    links: dict[str, LinkFit]
    contention: Contention
    attention_us: dict[str, float] = field(default_factory=dict)  # regime -> fixed cost on the roofline
    files: tuple[str, ...] = ()
    grouped_mm: GroupedMmRate | None = None  # torch._grouped_mm's weight rate by experts with rows (bench_gemv)
    extra_tile: dict[int, float] = field(default_factory=dict)  # tile rows -> a further tile's share of a pass
    route_by_version: dict[str, Curve] = field(default_factory=dict)  # code version -> the router's GPU time

    def router_us(self, path: DispatchPath, tokens: float) -> float:
        """The router's GPU time: its code version's curve where that spans ``tokens`` (the router's
        code changed what it costs several times over), else the least any version measured."""
        own = self.route_by_version.get(path.version) if path.version is not None else None
        return max(0.0, (own if own is not None and own.covers(tokens) else self.route_gpu)(tokens))

    def link(self, wire: str) -> LinkFit:
        if wire in self.links:
            return self.links[wire]
        raise ValueError(f"wire must be one of {sorted(self.links)}, got {wire!r}")

    def kernel_us(self, path: DispatchPath, phase: str, tokens: float) -> float:
        """GPU work of a phase besides its transfer: from CUDA-graph phases of this dispatcher; else,
        for a dispatcher never replayed (host-synchronous ones), its eager spans, host time included;
        else the fused low_latency kernels' (a layout pass is a layout pass)."""
        own, last = path.own_keys(), path.last_resort_keys()
        for table, ways in ((self.kernel, own), (self.kernel_eager, own), (self.kernel, last)):
            found = first_fit(table, ((p, phase) for p in ways), tokens)
            if found is not None:
                return max(0.0, found(tokens))
        return 0.0

    def host_us(self, path: DispatchPath, tokens: float) -> float:
        found = first_fit(self.host, path.own_keys(), tokens)
        return 0.0 if found is None else max(0.0, found(tokens))

    def routed_scale(self, path: DispatchPath) -> float:
        return next((self.routed_factor[p] for p in path.own_keys() if p in self.routed_factor), 1.0)

    def routed_gpu_us(
        self,
        cfg: MoEConfig,
        experts: int,
        rows: float,
        expert_dtype: str,
        path: DispatchPath,
        dense_path: str | None = None,
    ) -> float:
        """The layer's routed experts over ``experts`` local experts and ``rows`` real (token, expert)
        pairs. The grouped GEMM: the roofline over the path's factor x the real rows (padding and
        imbalance add rows, so FLOPs; the weights are streamed once whatever the rows). ``dense_path``
        is the caller's decision (``simulate.dense_path``: ``"gemv"``, ``"tiled"``, ``"grouped_mm"``;
        None for FP8 experts): a Triton kernel with its fit among the files is costed by
        ``triton_us``; without its rows among the files, by the grouped GEMM's roofline (slower: it
        reads every expert). bf16 ``torch._grouped_mm`` with its weight rate among the files
        (``GroupedMmRate``): ``grouped_mm_us``."""
        key = TRITON_FITS.get(dense_path) if dense_path is not None else None
        if key == TILED and experts and rows / experts >= TMA_MIN_ROWS_PER_EXPERT and TILED_TMA in self.gemm:
            key = TILED_TMA  # the descriptor loads of the large tiles
        if key is not None and key in self.gemm:
            return self.triton_us(cfg, experts, rows, key)
        if expert_dtype == "bf16" and self.grouped_mm is not None:
            return grouped_mm_us(self.gemm["bf16"], self.grouped_mm, cfg, experts, rows, self.routed_scale(path))
        fit = self.gemm.get(expert_dtype) or self.gemm["bf16"]
        per_expert = rows / experts if experts else 0.0
        scaled = per_expert * self.routed_scale(path)
        return fit.time_us(experts, scaled, cfg.hidden_size, cfg.moe_intermediate_size, WEIGHT_B[expert_dtype])

    def triton_us(self, cfg: MoEConfig, experts: int, rows: float, key: str) -> float:
        """A Triton kernel of bf16 experts (``key``: ``GEMV`` or ``TILED``) over ``rows`` real rows, µs.
        Each reads only the weights of experts with rows (the GEMV's program for an empty expert returns
        at once; the tiled GEMM gives it no tile), so the roofline runs over their expected count under
        the layer's routing (``RowDraw.routing``), each streamed ``weight_passes`` times (the GEMV: once
        per ``GEMV_BLOCK_ROWS`` of its rows; the tiled GEMM: once per row tile): the weight bound over
        those streams, the FLOP bound over the rows. No path factor: that factor is grouped_mm's, fitted
        on FLOP-bound spans of >= 1 ms, and neither kernel computes a padded row (the GEMV stops at each
        expert's last row; the tiled GEMM's grid is sized for every row handed to it, padding included,
        but its programs past the real rows' tiles return at once)."""
        draw = RowDraw.routing(cfg, experts, rows)
        streams = expected_experts_with_rows(experts, draw) * weight_passes(key, draw, self.extra_tile)
        if streams <= 0:
            return 0.0
        fit = self.gemm[key]
        return fit.time_us(streams, rows / streams, cfg.hidden_size, cfg.moe_intermediate_size, WEIGHT_B["bf16"])


def grouped_mm_us(
    fit: GemmFit, rate: GroupedMmRate, cfg: MoEConfig, experts: int, rows: float, scale: float = 1.0
) -> float:
    """bf16 ``torch._grouped_mm`` over ``rows`` real rows on ``experts`` local experts, µs: the roofline
    over the experts expected to have rows under the layer's routing (``RowDraw.routing``; it skips
    the others), their weights streamed at ``rate``'s rate for that many experts, and ``scale`` x the
    rows' FLOPs (the path's factor: padding and imbalance add rows)."""
    touched = expected_experts_with_rows(experts, RowDraw.routing(cfg, experts, rows))
    if touched <= 0:
        return 0.0
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    weights_us = touched * 3 * hidden * inter * WEIGHT_B["bf16"] / (rate.GBps(touched) * 1e3)
    flops_us = rows * scale * 6 * hidden * inter / (fit.TFLOPs * 1e6)
    return smooth_max(weights_us, flops_us, fit.knee)


def _positive(row: ResultRow, key: str) -> float | None:
    return positive_field(row.row, key)


def _phase_bytes(row: ResultRow, phase: str) -> float:
    value = row.get(f"{phase}_bytes_sent")
    if value is None:  # rows with only the total: dispatch and combine rows are ~the same size
        value = (row.get("bytes_sent") or 0) / 2
    return float(value)


def _gemm_samples(rows: Sequence[ResultRow], extra_tile: Mapping[int, float]) -> dict[str, list]:
    """GEMM-only samples for ``fit_gemm`` by ``StageCosts.gemm`` key (expert dtype, ``GEMV``, ``TILED``);
    ``extra_tile`` as ``weight_passes`` takes it."""
    v3 = get_preset(DEFAULT_PRESET)
    by_dtype: dict[str, list] = defaultdict(list)
    # The GEMV's fit takes every size bench_gemv timed it at (up to 128 rows per expert), not only the
    # sizes layers run it at by their code's rule: with its weight passes one roofline describes them
    # all, and layers forced onto it (kernels="gemv") ran it at up to 128 rows per expert.
    by_dtype[GEMV] = _bench_gemv_samples(rows, GEMV)
    by_dtype[TILED] = _bench_gemv_samples(rows, TILED, _tiled_per_thread, extra_tile)
    by_dtype[TILED_TMA] = _bench_gemv_samples(rows, TILED_TMA, _tiled_descriptors)
    for r in rows:
        if r.get("bench") == "fp8_experts" and _positive(r, "t_us"):
            dtype = dtype_name(r.get("weight_dtype"))
            by_dtype[dtype].append(
                (
                    int(r.get("experts")),
                    float(r.get("rows_per_expert")),
                    v3.hidden_size,
                    v3.moe_intermediate_size,
                    WEIGHT_B[dtype],
                    float(r.get("t_us")),
                )
            )
        elif r.get("bench") == "grouped_gemm" and _positive(r, "t_routed_us"):
            cfg = r.cfg
            by_dtype["bf16"].append(
                (
                    int(r.get("experts_per_gpu")),
                    float(r.get("rows_per_expert")),
                    cfg.hidden_size,
                    cfg.moe_intermediate_size,
                    2.0,
                    float(r.get("t_routed_us")),
                )
            )
    return by_dtype


def _bench_gemv_samples(
    rows: Sequence[ResultRow],
    key: str,
    runs_at: Callable[[ResultRow, float, int], bool] | None = None,
    extra_tile: Mapping[int, float] | None = None,
) -> list:
    """The times of one Triton kernel (``key``: ``GEMV`` from ``bench_gemv``'s ``t_gemv_us``, ``TILED``
    from its ``t_tiled_us``: the whole routed MLP, bf16, DeepSeek-V3's dims, its defaults, which its
    rows do not record) as ``fit_gemm`` samples over the weight streams it read: the experts it read,
    ``experts_with_rows`` (it skips the empty ones), each ``weight_passes`` times over the draw the
    bench made (``RowDraw.uniform``: each row on one of its experts at random; ``RowDraw.even`` for
    its ``--draw equal`` rows), with the rows shared among them (so the FLOPs are the rows'). With
    ``runs_at``, only rows where ``runs_at(row, rows in all, experts)`` says the fit describes the
    kernel that row timed; ``extra_tile`` as ``weight_passes`` takes it."""
    v3 = get_preset(DEFAULT_PRESET)
    hidden, inter = v3.hidden_size, v3.moe_intermediate_size
    time_key = BENCH_GEMV_TIMES[key]
    samples = []
    for r in rows:
        if r.get("bench") != "gemv":
            continue
        t, total, touched = _positive(r, time_key), _positive(r, "rows"), _positive(r, "experts_with_rows")
        experts = int(r.get("experts", 0))
        if t and total and touched and experts > 0 and (runs_at is None or runs_at(r, total, experts)):
            drawn = RowDraw.uniform(experts, total) if _random_draw(r) else RowDraw.even(experts, total)
            streams = touched * weight_passes(key, drawn, extra_tile)
            samples.append((streams, total / streams, hidden, inter, WEIGHT_B["bf16"], t))
    return samples


def _random_draw(row: ResultRow) -> bool:
    """A ``bench_gemv`` row whose rows were drawn at random (``draw``; rows before the field were),
    read over ``RowDraw.uniform``; its ``--draw equal`` rows put R / L on every expert
    (``RowDraw.even``). ``torch._grouped_mm``'s rate by experts with rows is fitted on the random
    draws only (``_grouped_mm_samples``)."""
    return row.get("bench") == "gemv" and row.get("draw", "random") == "random"


def _grouped_mm_samples(rows: Sequence[ResultRow]) -> list[tuple[float, float, float]]:
    """``bench_gemv``'s ``torch._grouped_mm`` times as ``fit_grouped_mm_rate`` samples: (experts with
    rows, rows per expert with rows, µs)."""
    samples = []
    for r in rows:
        if not _random_draw(r):
            continue
        t, total = _positive(r, BENCH_GEMV_TIMES[GROUPED_MM]), _positive(r, "rows")
        touched = _positive(r, "experts_with_rows")
        if t and total and touched:
            samples.append((touched, total / touched, t))
    return samples


def _tiled_per_thread(row: ResultRow, rows: float, experts: int) -> bool:
    """Tiled timings of the per-thread loads at sizes where layers run them (``experts.kernel_by_rows``,
    today's rule, below ``TMA_MIN_ROWS_PER_EXPERT``; never from the code versions that took
    descriptor loads there)."""
    digest = str(row.meta.get("source_sha") or "")
    per_expert = rows / experts
    return (
        kernel_by_rows(per_expert) == "tiled"
        and per_expert < TMA_MIN_ROWS_PER_EXPERT
        and digest not in TILED_TMA_BELOW_256
    )


def _tiled_descriptors(row: ResultRow, rows: float, experts: int) -> bool:
    """Tiled timings of the descriptor loads: from ``TMA_MIN_ROWS_PER_EXPERT``, on code that had them."""
    return rows / experts >= TMA_MIN_ROWS_PER_EXPERT and measured_since(row.meta, TILED_TMA_SINCE)


def _contention(rows: Sequence[ResultRow]) -> Contention:
    from ..overlap.sbo import DEFAULT_COMM_SMS

    probe = [r for r in rows if r.get("bench") == "contention"]
    alone = {int(r.get("sm_budget")): float(r.get("t_us")) for r in probe if r.get("case") == "gemm_alone_sm_budget"}
    first = [
        float(r.get("efficiency"))
        for r in probe
        if r.get("case") == "gemm_beside_copy" and r.get("order") == "copy_first" and "ctas" in str(r.get("transport"))
    ]
    if not alone or not first:
        return Contention(NO_CONTENTION_SLOWDOWN, NO_CONTENTION_EFFICIENCY, "no contention probe among the files")
    sms = int(probe[0].meta.get("sms", max(alone)))
    budget_curve = curve((b, t) for b, t in alone.items())
    assert budget_curve is not None
    slowdown = budget_curve(sms - DEFAULT_COMM_SMS) / budget_curve(sms)
    source = f"{probe[0].file}: GEMM on {sms - DEFAULT_COMM_SMS}/{sms} SMs, copy launched first ({len(first)} rows)"
    return Contention(slowdown, statistics.median(first), source, sms, curve(alone.items(), trend=True))


def fit_stage_costs(rows: Sequence[ResultRow], keep: Callable[[str], bool] = lambda group: True) -> StageCosts:
    """Fit every stage cost to ``rows`` whose ``group`` ``keep`` accepts (attention is fitted later,
    by the simulator: ``simulate_report.calibrate_simulator``). Raises ``ValueError`` when a stage the
    simulator cannot do without has no rows."""
    rows = [r for r in rows if keep(r.group)]
    extra_tile = fit_extra_tile(rows)
    gemm = {d: f for d, s in _gemm_samples(rows, extra_tile).items() if (f := fit_gemm(s)) is not None}
    if "bf16" not in gemm:
        raise ValueError("results must hold grouped-GEMM rows (fp8_experts_*.json or foundation_*.json), got none")
    grouped_mm = fit_grouped_mm_rate(_grouped_mm_samples(rows), gemm["bf16"])

    moe = [r for r in rows if r.get("bench") in MOE_LAYER_BENCHES]  # kernel probes time no layer stage
    # Some files timed these floors eagerly (host time included): the GPU time is the least measured.
    timed_route = [r for r in moe if _positive(r, "t_floor_route_us")]
    route = curve([(r.tokens, float(r.get("t_floor_route_us"))) for r in timed_route], min)
    by_version: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in timed_route:
        if r.path.version is not None:
            by_version[r.path.version].append((r.tokens, float(r.get("t_floor_route_us"))))
    route_by_version = {v: c for v, pts in by_version.items() if (c := curve(pts, min)) is not None}
    shared = curve(
        [(r.tokens, float(r.get("t_floor_shared_us"))) for r in moe if _positive(r, "t_floor_shared_us")]
        + [(r.tokens, float(r.get("t_shared_us"))) for r in moe if r.graph and _positive(r, "t_shared_us")],
        min,
    )
    if route is None or shared is None:
        raise ValueError("results must time the router and shared experts alone (t_floor_* rows), got none")

    links = _links(rows)
    kernel = _kernels(moe, links, graph=True)
    kernel_eager = _kernels(moe, links, graph=False)
    routed_factor = _routed_factors(moe, gemm, grouped_mm)
    stages = StageCosts(gemm, routed_factor, route, shared, kernel, kernel_eager, {}, links, _contention(rows))
    files = tuple(sorted({r.file for r in rows}))
    return replace(stages, files=files, grouped_mm=grouped_mm, extra_tile=extra_tile, route_by_version=route_by_version)


def _kernels(moe: Sequence[ResultRow], links: dict[str, LinkFit], graph: bool) -> dict[tuple[DispatchPath, str], Curve]:
    """Each phase's span minus its wire time vs tokens, per path: from CUDA-graph rows (``graph``) or
    from eager ``none`` rows. A graph row that timed only dispatch + combine together (``t_comm_us``,
    ``bench`` rows) is split by the dispatch's median share of the rows that timed both."""
    kernel: dict[tuple[DispatchPath, str], Curve] = {}
    usable = [r for r in moe if r.graph == graph and r.get("overlap", "none") == "none" and not r.get("tbo")]

    def wire(r: ResultRow, phase: str) -> float:
        return links[r.wire].time_us(_phase_bytes(r, phase)) if r.ep > 1 and r.wire in links else 0.0

    def timed_both(r: ResultRow) -> bool:
        return _positive(r, "t_dispatch_us") is not None and _positive(r, "t_combine_us") is not None

    shares = [
        r.get("t_dispatch_us") / (r.get("t_dispatch_us") + r.get("t_combine_us")) for r in usable if timed_both(r)
    ]
    share = statistics.median(shares) if shares else 0.5
    by_path: dict[tuple[DispatchPath, str], list] = defaultdict(list)
    for r in usable:
        if timed_both(r):
            times = {"dispatch": float(r.get("t_dispatch_us")), "combine": float(r.get("t_combine_us"))}
        elif graph and _positive(r, "t_comm_us") and r.get("t_dispatch_us") is None:
            comm = float(r.get("t_comm_us"))
            times = {"dispatch": comm * share, "combine": comm * (1 - share)}
        else:
            continue
        for phase, t in times.items():
            kernel_us = max(0.0, t - wire(r, phase))
            for p in r.path.own_keys():
                by_path[(p, phase)].append((r.tokens, kernel_us))
    kernel.update({key: c for key, pts in by_path.items() if (c := curve(pts)) is not None})
    return kernel


def _links(rows: Sequence[ResultRow]) -> dict[str, LinkFit]:
    points: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r.ep < 2:
            continue
        for phase in ("dispatch", "combine"):
            t = _positive(r, f"ref_t_{phase}_us")
            if t is not None:
                points[r.wire].append((_phase_bytes(r, phase), t))
    links = {w: f for w, pts in points.items() if (f := fit_link(pts, f"raw all_to_all_single on {w}")) is not None}
    if "nvlink" not in links:
        raise ValueError("results must hold raw NCCL references (ref_t_*_us) over NVLink, got none")
    nvlink = links["nvlink"]
    # A wire without raw references: the all-to-all bandwidth its files measured (meta), else the constant.
    measured: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        gbps = r.meta.get("wire_all_to_all_GBps")
        if r.ep > 1 and isinstance(gbps, (int, float)) and gbps > 0:
            measured[r.wire][r.file] = float(gbps)
    for wire, by_file in measured.items():
        if wire not in links:
            source = f"measured all-to-all bandwidth of {len(by_file)} file(s) (meta), NVLink's latency"
            links[wire] = LinkFit(nvlink.latency_us, statistics.median(by_file.values()), 0, source)
    links.setdefault(
        "emulated-internode",
        LinkFit(
            nvlink.latency_us, EMULATED_INTERNODE_GBPS, 0, "assumed: 24.1 GB/s measured on 2x H200, NVLink's latency"
        ),
    )
    links["rdma"] = LinkFit(RDMA_LATENCY_US, RDMA_GBPS, 0, "assumed: 400 Gb/s NIC per GPU")
    return links


def _routed_factors(
    moe: Sequence[ResultRow], gemm: dict[str, GemmFit], grouped_mm: GroupedMmRate | None = None
) -> dict[DispatchPath, float]:
    """Per path, the median factor on the rows the layer's grouped GEMM runs (capacity padding, routing
    imbalance): the ``f`` for which the roofline over f x the real rows meets the routed span (or
    floor), over rows whose GEMM takes >= 1 ms (shorter spans are host-bound in eager rows) and is
    FLOP-bound (the weight stream does not change with the rows). So no row whose experts ran a Triton
    kernel counts: a row that records another path than the grouped GEMM (``expert_path``: the rule's,
    or one forced by ``RoutedExperts.kernels``) is left out whatever its size, and so is a bf16 row
    whose code's rule (``ResultRow.dense_rule``) ran the tiled GEMM at its size (today's up to
    ``TILED_MAX_ROWS_PER_EXPERT`` rows per expert, where the grouped GEMM is FLOP-bound from ~200; the
    GEMV of older code ran at <= ``GEMV_MAX_ROWS`` rows in all, tens of µs, far under 1 ms). With
    ``grouped_mm`` (its weight rate), a bf16 row's factor is the one ``grouped_mm_us`` meets the span with."""
    ratios: dict[DispatchPath, list[float]] = defaultdict(list)
    for r in moe:
        t = _positive(r, "t_floor_routed_us") or (_positive(r, "t_routed_us") if r.get("overlap") == "none" else None)
        if t is None or r.expert_path not in (None, "grouped_mm"):
            continue
        cfg, dtype = r.cfg, dtype_name(r.get("experts_dtype"))
        fit = gemm.get(dtype) or gemm["bf16"]
        experts, hidden, inter = r.experts_per_gpu, cfg.hidden_size, cfg.moe_intermediate_size
        rows_per_expert = r.tokens * cfg.num_experts_per_tok / experts
        if dtype == "bf16" and r.expert_path is None and not _ran_grouped_mm(r.dense_rule, rows_per_expert):
            continue
        weights, flops = fit.parts_us(experts, rows_per_expert, hidden, inter, WEIGHT_B[dtype])
        if flops >= weights and fit.time_us(experts, rows_per_expert, hidden, inter, WEIGHT_B[dtype]) >= 1000.0:
            if dtype == "bf16" and grouped_mm is not None:
                rows = r.tokens * cfg.num_experts_per_tok
                factor = _solve_factor(lambda f: grouped_mm_us(fit, grouped_mm, cfg, experts, rows, f), t)
            else:
                factor = fit.rows_factor(t, weights, flops)
            for p in r.path.own_keys():
                ratios[p].append(factor)
    return {p: statistics.median(v) for p, v in ratios.items()}


def kernel_by_rule(dense_rule: str, rows_per_expert: float) -> str | None:
    """The dense experts' GEMMs under one of the rules by rows per expert (``BY_ROWS_PER_EXPERT``,
    today's ``experts.kernel_by_rows``; ``BY_ROWS_TILED_TO_128``, the tiled GEMM up to
    ``TILED_MAX_BEFORE``); None for the older rules, which chose by other counts."""
    if dense_rule == BY_ROWS_PER_EXPERT:
        return kernel_by_rows(rows_per_expert)
    if dense_rule == BY_ROWS_TILED_TO_128:
        return kernel_by_rows(rows_per_expert, tiled_max=TILED_MAX_BEFORE)
    return None


def _ran_grouped_mm(dense_rule: str, rows_per_expert: float) -> bool:
    """Whether bf16 experts chose ``torch._grouped_mm`` at ``rows_per_expert`` under ``dense_rule``
    (``simulate_rows.DENSE_RULES``; the older rules ran the GEMV only at decode sizes)."""
    return kernel_by_rule(dense_rule, rows_per_expert) in (None, "grouped_mm")


def _solve_factor(time_us: Callable[[float], float], t_us: float, high: float = 16.0) -> float:
    """The factor f in [1, ``high``] at which ``time_us(f)`` (rising with f) meets ``t_us``: a bisection
    in log f; 1 where f = 1 already takes as long (as ``GemmFit.rows_factor``)."""
    low = 1.0
    if time_us(low) >= t_us:
        return low
    for _ in range(40):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if time_us(mid) < t_us else (low, mid)
    return math.sqrt(low * high)

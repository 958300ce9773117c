"""The result files the simulator calibrates from, as rows that know their setup.

A row (``ResultRow``) resolves what the fits need: its model, EP size, tokens, wire, and its
``DispatchPath`` (dispatcher, kernels, transport, dispatch element type, EP > 1, and the code
version that ran). Rows that measured one setup share a ``group`` (every overlap mode and TBO delay
of it, with its one-off floors and references), the unit the validation holds out.

What is hard is **old rows**: fields were added as the benchmarks grew, so a missing field is read
as what the code did when it was missing (``UNRECORDED_KERNELS``, ``DEFAULT_TRANSPORT``), never
guessed from the numbers; what an older row does not record (the routed experts' kernels) is read
from the file's date (``GEMV_SINCE``, ``TILED_SINCE``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cache, cached_property
from pathlib import Path

from ..config import PRESETS, MoEConfig, get_preset

# Rows of benchmarks that fix their model (fp8_experts, grouped_gemm) carry no dims: DeepSeek-V3's.
DEFAULT_PRESET = "deepseek-v3"
# Benchmarks whose rows time a whole MoE layer: the layer stage fits' samples and, with ``tbo``'s decoder
# layers, the rows validated. Any other bench is not a layer (kernel probes such as ``gemv``,
# ``gather_gemm`` or ``dense_gemm_config``; soak and generation runs), whatever fields its rows carry.
MOE_LAYER_BENCHES = ("sbo", "moe_layer", "low_latency", "prefill", "fp8_layer")
# A low_latency row without ``kernels`` predates the field: its path (torch or Triton) is not known,
# so its costs are kept apart ("unrecorded"); one without ``transport`` predates that option, when
# NCCL carried the blocks. The fused Triton kernels are the default path and the last resort.
UNRECORDED_KERNELS = "unrecorded"
DEFAULT_KERNELS = "triton"
DEFAULT_TRANSPORT = "nccl"
# A low_latency row with ``index_graphs: false`` launched the fused kernels directly instead of
# replaying their index graphs: the same GPU work, more host time in an eager forward, so its own path
# (``triton+direct``) and its own setup. Rows with ``index_graphs: true`` or without the field (the
# default) are unchanged.
DIRECT_LAUNCH = "+direct"
# A low_latency row with ``fixed_expert_rows: true`` gathered the expert rows into a buffer kept per
# buffer set: the same GPU work, other host work per eager forward (before the address tables, one
# launch less; since, one allocation less), so its own path and setup too.
FIXED_ROWS = "+fixed_rows"
# A low_latency row with ``index_rows: true`` left the received rows in place: no gather at the end of
# the dispatch, the experts' tiled GEMM reading through the layout's index; other GPU work, so its own
# path and setup.
INDEX_ROWS = "+index_rows"
# Since commit a479e10 (this instant, UTC) dense routed experts on CUDA run ``gemv_kernels``' Triton
# grouped GEMV at decode sizes (up to ``simulate_fit.GEMV_MAX_ROWS`` rows in all); before it,
# ``torch._grouped_mm`` at every size. No row of that code records which ran, so a file's ``meta.date``
# (UTC ISO 8601, ``measure.results``) on or after this says its code had the GEMV; a file without a
# date is taken as older.
GEMV_SINCE = "2026-11-30T21:18:02+00:00"
# Since the code of commit 3ef4268 (source digest 0bfe0059a701; this instant is the ``meta.date`` of
# the first file measured on it, ``gemv_h200x1_tiles32.json``) dense routed experts on CUDA choose by
# rows per expert (``RoutedExperts.dense_path``): the GEMV, ``grouped_gemm_kernels``' tiled GEMM, or
# ``torch._grouped_mm``. Its layer rows record the path that ran (``expert_path``), which wins; this
# date stands for a file of that code without the field. (The commit before, 0711265, chose by another
# rule; no layer file was measured on it.)
TILED_SINCE = "2026-12-01T11:23:20+00:00"
# Since this instant (the ``meta.date`` of ``gemv_tma_h200x1.json``, source digest bae0d9b7a780) the
# tiled GEMM's 128 x 256 tiles load through tensor descriptors at 256 rows per expert and more
# (``grouped_gemm_kernels.TMA_MIN_ROWS_PER_EXPERT``): ``bench_gemv``'s tiled timings there describe
# that kernel (``simulate_fit.TILED_TMA``), older ones the per-thread loads.
TILED_TMA_SINCE = "2026-12-01T14:31:58+00:00"
# Source digests whose tiled GEMM took descriptor loads below 256 rows per expert too (for every tile;
# from 128 rows per expert), unlike the code before and after them: their tiled timings below 256
# rows per expert describe no kernel layers run, and stay out of the fits.
TILED_TMA_BELOW_256 = ("bae0d9b7a780", "108b4775b2f1")
# Since this instant (just before commit 4ae348c, source digest d809faee499c, which raised
# ``experts.TILED_MAX_ROWS_PER_EXPERT`` from 128 to 512 rows per expert; no file was measured between
# the two, and the first on that code, ``low_latency_mid32_h200x1.json``, is dated 16:32) dense routed
# experts run the tiled GEMM up to 512 rows per expert; a file of the code between ``TILED_SINCE`` and
# this without ``expert_path`` ran it up to ``TILED_MAX_BEFORE`` only.
TILED_512_SINCE = "2026-12-01T16:28:00+00:00"
TILED_MAX_BEFORE = 128
# The rule dense routed experts chose their GEMMs by, per code version (``ResultRow.dense_rule``,
# applied by ``simulate.dense_path``): ``torch._grouped_mm`` at every size (before ``GEMV_SINCE``); the
# GEMV up to ``simulate_fit.GEMV_MAX_ROWS`` rows handed to the experts in all, else
# ``torch._grouped_mm`` (until ``TILED_SINCE``); by rows per expert with the tiled GEMM up to
# ``TILED_MAX_BEFORE`` (until ``TILED_512_SINCE``); by rows per expert (since; today's code).
GROUPED_MM_ONLY = "grouped_mm only"
GEMV_BY_ROWS = "gemv by rows"
BY_ROWS_TILED_TO_128 = "by rows per expert, tiled to 128"
BY_ROWS_PER_EXPERT = "by rows per expert"
DENSE_RULES = (GROUPED_MM_ONLY, GEMV_BY_ROWS, BY_ROWS_TILED_TO_128, BY_ROWS_PER_EXPERT)


@dataclass(frozen=True)
class ResultRow:
    """One row of a result file with what the fits need resolved: its file, its hold-out ``group``
    (every row measured under one setup, all overlap modes and TBO delays together), its path."""

    file: str
    group: str
    row: dict
    meta: dict

    def get(self, key: str, default=None):
        value = self.row.get(key, default)
        return default if value is None else value

    @property
    def ep(self) -> int:
        return int(self.get("ep", self.meta.get("world_size", 1)))

    @property
    def tokens(self) -> int:
        return int(self.get("tokens_per_rank", self.get("tokens", 0)))

    @property
    def graph(self) -> bool:
        return bool(self.get("graph", False))

    @property
    def wire(self) -> str:
        return str(self.get("wire", self.meta.get("wire", "nvlink" if self.ep > 1 else "none")))

    @cached_property
    def cfg(self) -> MoEConfig:
        preset = self.get("preset", self.meta.get("preset", DEFAULT_PRESET))
        cfg = get_preset(preset if preset in PRESETS else DEFAULT_PRESET)
        experts = self.get("num_experts")
        if experts is None and self.get("experts_per_gpu") is not None:
            experts = int(self.get("experts_per_gpu")) * self.ep
        return cfg.with_num_experts(int(experts)) if experts and experts != cfg.num_experts else cfg

    @property
    def experts_per_gpu(self) -> int:
        return int(self.get("experts_per_gpu", self.get("experts", self.cfg.num_experts // self.ep)))

    @cached_property
    def path(self) -> DispatchPath:
        return path_of(self.row, self.ep, str(self.meta.get("source_sha") or self.meta.get("commit") or "unknown"))

    @property
    def dense_rule(self) -> str:
        """The rule (``DENSE_RULES``) by which the code that measured this row chose its dense experts'
        GEMMs, from its file's date."""
        if measured_since(self.meta, TILED_512_SINCE):
            return BY_ROWS_PER_EXPERT
        if measured_since(self.meta, TILED_SINCE):
            return BY_ROWS_TILED_TO_128
        return GEMV_BY_ROWS if measured_since(self.meta, GEMV_SINCE) else GROUPED_MM_ONLY

    @property
    def expert_path(self) -> str | None:
        """The dense experts' GEMMs this row ran, where it records them (``bench_low_latency``'s
        ``expert_path``: ``"gemv"``, ``"tiled"`` or ``"grouped_mm"``, ``RoutedExperts.dense_path``'s
        names); None for a row that does not."""
        path = self.get("expert_path")
        return None if path is None else str(path)


def measured_since(meta: dict, since: str) -> bool:
    """Whether a result file's ``meta.date`` is at or after ``since`` (ISO 8601; one without a zone is
    taken as UTC, the zone ``measure.results`` writes); False without a readable date."""
    try:
        date = datetime.fromisoformat(str(meta["date"]))
    except (KeyError, ValueError):
        return False

    def utc(moment: datetime) -> datetime:
        return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)

    return utc(date) >= utc(datetime.fromisoformat(since))


@dataclass(frozen=True)
class DispatchPath:
    """How a layer moves its rows: dispatcher, kernels, transport, dispatch element type, whether
    peers exist (``multi``: EP > 1) and the code that ran (``version``: a result file's
    ``meta.source_sha``, else ``meta.commit``; dispatcher costs change with the code). ``None``
    fields are wildcards in a lookup."""

    dispatcher: str | None
    kernels: str | None = None
    transport: str | None = None
    dispatch_dtype: str | None = None
    multi: bool | None = None
    version: str | None = None

    @cache  # noqa: B019 - a handful of frozen paths, kept for the process
    def own_keys(self) -> tuple[DispatchPath, ...]:
        """This path, then ever more general ones of its dispatcher: within its code version first,
        then across versions. A sample is filed under every one of them."""
        k, t, dt, m = self.kernels, self.transport, self.dispatch_dtype, self.multi
        shapes = [(k, t, dt, m), (k, t, None, m), (k, None, None, m), (None, None, None, m), (None, None, None, None)]
        ways = [DispatchPath(self.dispatcher, *shape, version) for version in (self.version, None) for shape in shapes]
        return tuple(dict.fromkeys(ways))

    @cache  # noqa: B019
    def last_resort_keys(self) -> tuple[DispatchPath, ...]:
        """The fused low_latency kernels: the one dispatcher timed phase by phase under CUDA graphs,
        whose layout passes stand in for GPU work no other row separates from host time."""
        ways = [
            DispatchPath("low_latency", DEFAULT_KERNELS, None, None, multi, version)
            for version in (self.version, None)
            for multi in (self.multi, None)
        ]
        return tuple(dict.fromkeys(ways))


def dtype_name(value) -> str:
    """``bf16`` or ``fp8``, however a row spells its element type (``bfloat16``, ``float8``...)."""
    text = str(value or "bf16")
    return "fp8" if "8" in text else "bf16"


def path_of(row: dict, ep: int, version: str | None = None) -> DispatchPath:
    dispatcher = str(row.get("dispatcher") or "local")
    if dispatcher != "low_latency":
        return DispatchPath(dispatcher, None, None, dtype_name(row.get("dispatch_dtype")), ep > 1, version)
    kernels = str(row.get("kernels") or UNRECORDED_KERNELS)
    if row.get("plan") == "one_pass":  # the quadratic first version of the bulk kernels: its own costs
        kernels += "+one_pass"
    if kernels.startswith(DEFAULT_KERNELS) and row.get("index_graphs") is False:
        kernels += DIRECT_LAUNCH  # the fused kernels launched directly: more host time per eager forward
    if kernels.startswith(DEFAULT_KERNELS) and row.get("fixed_expert_rows"):
        kernels += FIXED_ROWS  # the expert rows in a buffer kept per set: other host time
    if kernels.startswith(DEFAULT_KERNELS) and row.get("index_rows"):
        kernels += INDEX_ROWS  # no gather in the dispatch: other GPU work
    transport = str(row.get("transport_used") or row.get("transport") or DEFAULT_TRANSPORT)
    if ep == 1 and transport == DEFAULT_TRANSPORT:
        # One rank: nothing crosses a wire, and NCCL's one-rank collective is EP1's usual path. Over
        # symmetric memory at EP1 (no collective call, a barrier in the graphs) the host costs differ.
        transport = "none"
    return DispatchPath(dispatcher, kernels, transport, dtype_name(row.get("dispatch_dtype")), ep > 1, version)


def _group_of(file: str, row: dict, meta: dict) -> str:
    """Rows that share a setup (and so its one-off measurements: floors, references) share a group."""
    keys = (
        *("bench", "dispatcher", "kernels", "plan", "transport", "dispatch_dtype", "experts_dtype", "weight_dtype"),
        *(
            "experts_per_gpu",
            "experts",
            "regime",
            "tokens_per_rank",
            "tokens",
            "rows_per_expert",
            "graph",
            "ep",
            "wire",
        ),
    )
    parts = [f"{k}={row[k]}" for k in keys if row.get(k) is not None]
    if row.get("index_graphs") is False:  # direct launches: a setup of their own (the default adds nothing)
        parts.append("index_graphs=False")
    if row.get("fixed_expert_rows"):
        parts.append("fixed_expert_rows=True")
    if row.get("index_rows"):
        parts.append("index_rows=True")
    if row.get("bench") in ("sbo", "tbo", "fp8_layer"):  # every mode (and TBO delay) of one setup together
        parts = [p for p in parts if not p.startswith("graph=")]
    return file + ":" + ",".join(parts)


def load_rows(results: str | Path) -> list[ResultRow]:
    """Every row of every ``*.json`` result file in ``results`` (a folder or one file); rows with an
    ``error`` are skipped. Raises ``ValueError`` when nothing usable is there."""
    root = Path(results)
    files = sorted(root.glob("*.json")) if root.is_dir() else [root]
    if not root.exists():
        raise ValueError(
            f"--results must be a folder of result files or one file, got {str(root)!r}, which does not "
            "exist; pass the repository's benchmarks/results (or your own run's folder)"
        )
    rows = []
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        meta: dict = data["meta"] if isinstance(data.get("meta"), dict) else {}
        for row in data["rows"]:
            if isinstance(row, dict) and "error" not in row:
                rows.append(ResultRow(path.name, _group_of(path.name, row, meta), row, meta))
    if not rows:
        raise ValueError(
            f"--results must hold result files ({{'meta', 'rows'}}), got none with rows in {str(root)!r}; "
            "pass benchmarks/results"
        )
    return rows

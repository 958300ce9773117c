"""Links: the bandwidths and fixed latency a plan predicts with, from the hardware table or a benchmark.

What is hard: **estimates vs datasheets vs measurements.** Link bandwidths in ``inputs.HARDWARE`` are
measured or datasheet figures (with sources); the fixed per-all-to-all latency is an *estimate*
(``datasheet_link`` passes them on as they are). ``calibrate`` replaces the link numbers with a fit over
a benchmark result file of this project -- a least-squares line t = latency + bytes / bandwidth, because
the ``algbw`` such a file records (bytes / t) folds the latency into the bandwidth.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .inputs import B_PER_US_PER_GBPS, Hardware


@dataclass(frozen=True)
class Link:
    """Bandwidths (per GPU, per direction) and fixed latency the plan predicts with."""

    nvlink_GBps: float
    nic_GBps: float
    gpus_per_node: int
    latency_us: float
    source: str


def datasheet_link(hw: Hardware) -> Link:
    return Link(hw.nvlink_GBps, hw.nic_GBps, hw.gpus_per_node, hw.latency_us, f"datasheet/measured: {hw.source}")


@dataclass(frozen=True)
class Calibration:
    """Bandwidth and latency measured by a benchmark result file of this project."""

    GBps: float
    latency_us: float
    num_rows: int
    method: str
    path: str

    def link(self, hw: Hardware) -> Link:
        # One measured effective bandwidth replaces both link classes: calibrate at the EP you plan for.
        return Link(self.GBps, self.GBps, hw.gpus_per_node, self.latency_us, f"calibrated: {self.path} ({self.method})")


def positive_field(row: dict, key: str) -> float | None:
    """``row[key]`` as a float when it is a finite number > 0 (not a bool), else None."""
    value = row.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _row_time_us(row: dict) -> float | None:
    """The time the row's ``bytes_sent`` took: t_comm_us, else dispatch + combine, else either one."""
    t_comm = positive_field(row, "t_comm_us")
    if t_comm is not None:
        return t_comm
    t_dispatch, t_combine = positive_field(row, "t_dispatch_us"), positive_field(row, "t_combine_us")
    if t_dispatch is not None and t_combine is not None:
        return t_dispatch + t_combine
    return t_dispatch if t_dispatch is not None else t_combine


def calibrate(path: str | Path, ep: int | None = None) -> Calibration:
    """Fit bandwidth and fixed latency to a result file ``{"meta": {...}, "rows": [...]}``
    (docs/BENCHMARKS.md, "Result files").

    With rows of >= 2 distinct ``bytes_sent`` that carry a time, a least-squares fit of
    t_us = latency_us + bytes / (GBps * 1e3) gives both (``algbw`` = bytes / t would fold the latency
    into the bandwidth). Otherwise the bandwidth is the median ``algbw_GBps`` (or ``ref_algbw_GBps``, or
    bytes / t) and the latency 0. Rows whose ``ep`` equals ``ep`` are used when there are any.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"calibrate file must exist, got {str(path)!r}; run a benchmark to write a result JSON "
            "(benchmarks/results/) or drop --calibrate"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"calibrate file must be JSON, got a parse error in {str(path)!r} ({exc}); pass a benchmark result file"
        ) from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(
            f'calibrate file must be {{"meta": {{...}}, "rows": [...]}}, got {type(data).__name__} without '
            f"a rows list in {str(path)!r}; pass a result file written by this project's benchmarks"
        )
    rows = [row for row in rows if isinstance(row, dict)]
    if ep is not None and any(row.get("ep") == ep for row in rows):
        rows = [row for row in rows if row.get("ep") == ep]

    pairs: list[tuple[float, float]] = []  # (bytes_sent, time in µs) of every row that has both
    for row in rows:
        bytes_sent, time_us = positive_field(row, "bytes_sent"), _row_time_us(row)
        if bytes_sent is not None and time_us is not None:
            pairs.append((bytes_sent, time_us))
    if len({b for b, _ in pairs}) >= 2:
        n = len(pairs)
        mean_b = sum(b for b, _ in pairs) / n
        mean_t = sum(t for _, t in pairs) / n
        slope_us_per_B = sum((b - mean_b) * (t - mean_t) for b, t in pairs) / sum((b - mean_b) ** 2 for b, _ in pairs)
        if slope_us_per_B > 0:
            latency_us = max(0.0, mean_t - slope_us_per_B * mean_b)
            return Calibration(
                GBps=1.0 / (slope_us_per_B * B_PER_US_PER_GBPS),
                latency_us=latency_us,
                num_rows=n,
                method=f"least-squares t = a + bytes/bw over {n} rows, {len({b for b, _ in pairs})} sizes",
                path=str(path),
            )
    for key in ("algbw_GBps", "ref_algbw_GBps"):
        values = [v for v in (positive_field(row, key) for row in rows) if v is not None]
        if values:
            return Calibration(statistics.median(values), 0.0, len(values), f"median {key}, latency 0", str(path))
    if pairs:
        values = [b / (t * B_PER_US_PER_GBPS) for b, t in pairs]
        return Calibration(statistics.median(values), 0.0, len(values), "median bytes_sent / t, latency 0", str(path))
    raise ValueError(
        f"calibrate file must hold rows with algbw_GBps, or bytes_sent with t_comm_us / t_dispatch_us / "
        f"t_combine_us, got none usable among {len(rows)} rows in {str(path)!r}; run a communication "
        "benchmark that records them"
    )


def transfer_time_us(intranode_B: float, internode_B: float, link: Link) -> float:
    """One all-to-all: fixed latency + the slower of the NVLink and NIC parts (they run in parallel)."""
    return link.latency_us + max(intranode_B / link.nvlink_GBps, internode_B / link.nic_GBps) / B_PER_US_PER_GBPS

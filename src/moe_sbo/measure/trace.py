"""What actually overlapped: spans per stream from a profiler trace, and the timeline picture.

The library marks its phases with ``profiling.annotate`` (``moe_sbo.<kind>`` ranges, free unless the
PyTorch profiler is on). From a
Chrome trace written by ``torch.profiler`` this module rebuilds one lane per CUDA stream: every
kernel becomes a span whose kind is the innermost ``moe_sbo.*`` annotation around its launch on the
host (found through the launch's correlation id), or ``comm`` when it is a NCCL kernel. Without CUDA
(CPU ranks) the lanes are the host's annotated phases, since gloo's transfer threads are not traced.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from ..profiling import PREFIX

COLORS = {
    "shared_experts": "#d62728",
    "routed_experts": "#1f77b4",
    "dispatch": "#2ca02c",
    "combine": "#9467bd",
    "comm": "#ff7f0e",
    "router": "#8c564b",
    "attention": "#17becf",
    "other": "#bbbbbb",
}


@dataclass(frozen=True)
class Span:
    """One bar of the timeline: ``lane`` (stream or host phase), ``kind``, start and length in µs."""

    lane: str
    kind: str
    start_us: float
    dur_us: float
    name: str


def spans_from_trace(trace: dict) -> list[Span]:
    """Spans of a ``torch.profiler`` Chrome trace (``export_chrome_trace``), times from its first span."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    annotations: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
    launches: dict[int, tuple[object, float]] = {}
    kernels = []
    for e in events:
        cat, args = e.get("cat", ""), e.get("args", {})
        if cat == "user_annotation" and e["name"].startswith(PREFIX):
            annotations[e["tid"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][len(PREFIX) :]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = (e["tid"], float(e["ts"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    for tid_spans in annotations.values():
        tid_spans.sort()
    if kernels:
        spans = [_kernel_span(k, launches, annotations) for k in kernels]
    else:  # CPU: the host's annotated phases, one lane per kind
        spans = [
            Span(f"host: {kind}", kind, start, end - start, kind)
            for tid_spans in annotations.values()
            for start, end, kind in tid_spans
        ]
    if not spans:
        return []
    origin = min(s.start_us for s in spans)
    return sorted(
        (Span(s.lane, s.kind, s.start_us - origin, s.dur_us, s.name) for s in spans), key=lambda s: (s.lane, s.start_us)
    )


def _kernel_span(kernel: dict, launches: dict, annotations: dict) -> Span:
    args = kernel.get("args", {})
    name = kernel["name"]
    kind = "other"
    launch = launches.get(args.get("correlation"))
    if "nccl" in name.lower():
        kind = "comm"
    elif launch is not None:
        kind = _innermost(annotations.get(launch[0], []), launch[1]) or "other"
    lane = f"stream {args.get('stream', '?')}"
    return Span(lane, kind, float(kernel["ts"]), float(kernel["dur"]), name[:80])


def _innermost(spans: list[tuple[float, float, str]], t: float) -> str | None:
    """Kind of the shortest annotation containing time ``t`` (spans sorted by start)."""
    best = None
    for start, end, kind in spans[: bisect.bisect_right(spans, (t, float("inf"), ""))]:
        if start <= t <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end, kind)
    return best[2] if best else None


def save_spans(spans_by_title: dict[str, list[Span]], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked writable before the work, made now
    with open(path, "w") as f:
        json.dump({title: [asdict(s) for s in spans] for title, spans in spans_by_title.items()}, f)


def load_spans(path: str | Path) -> dict[str, list[Span]]:
    with open(path) as f:
        return {title: [Span(**s) for s in spans] for title, spans in json.load(f).items()}


def plot_timeline(spans_by_title: dict[str, list[Span]], path: str | Path, title: str = "") -> None:
    """One panel per title (e.g. per overlap mode), one lane per stream, bars coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(t, s) for t, s in spans_by_title.items() if s]
    if not panels:
        raise ValueError("no spans to draw: was the profiler on, and did the forward run?")
    heights = [max(1, len({s.lane for s in spans})) for _, spans in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(14, 1.0 + 0.45 * sum(heights) + 0.5 * len(panels)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    kinds_seen: set[str] = set()
    for ax, (panel_title, spans) in zip(axes[:, 0], panels):
        lanes = sorted({s.lane for s in spans})
        for y, lane in enumerate(lanes):
            for s in (s for s in spans if s.lane == lane):
                ax.broken_barh([(s.start_us, max(s.dur_us, 0.5))], (y - 0.4, 0.8), color=COLORS.get(s.kind, "#bbbbbb"))
                kinds_seen.add(s.kind)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_title(panel_title, loc="left", fontsize=10)
        ax.set_xlim(0, max(s.start_us + s.dur_us for s in spans) * 1.01)
    axes[-1, 0].set_xlabel("µs")
    fig.legend(
        handles=[Patch(color=COLORS.get(k, "#bbbbbb"), label=k) for k in sorted(kinds_seen)],
        loc="upper right",
        ncol=len(kinds_seen),
    )
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked writable before the work, made now
    fig.savefig(path, dpi=110)
    plt.close(fig)

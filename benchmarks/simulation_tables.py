"""The validation tables of docs/SIMULATION.md, printed as Markdown from the result files.

Runs the same held-out validation as ``moe-sbo plan --simulate`` (``planner.load_rows``,
``planner.validate``, ``planner.validation_summary``, ``planner.repeatability``) and prints section 3's
tables (the result by timing and wire, the rows measured on both wires, the summary per file and
metric, the measurements' own spread) and the appendix of every validated row. CPU only, a few seconds.

Usage (repo root):
  python benchmarks/simulation_tables.py                      # every table, in the doc's order
  python benchmarks/simulation_tables.py --only appendix      # one part: result, wires, files, spread, appendix
  python benchmarks/simulation_tables.py --results out/       # another folder of result files
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Sequence

from moe_sbo import planner
from moe_sbo.overlap.sbo import OVERLAP_MODES

PARTS = ("result", "wires", "files", "spread", "appendix")
# A check's label (``simulate_report._label``): setup, [regime] tokens, timing, overlap, [TBO delay], [wire].
LABEL = re.compile(
    r"^(?P<setup>.+?) (?:(?P<regime>decode|prefill) )?(?P<tokens>\d+) tok (?P<timing>graph|eager) "
    r"(?P<overlap>\S+)(?: TBO d(?P<delay>\d+))?(?: (?P<wire>\S+))?$"
)


def parse(c: planner.Checked) -> dict[str, str]:
    match = LABEL.match(c.label)
    if match is None:
        raise ValueError(f"a validation label must read 'setup [regime] N tok timing overlap ...', got {c.label!r}")
    fields = {k: v or "" for k, v in match.groupdict().items()}
    if fields["wire"]:
        fields["setup"] += " " + fields["wire"]
    return fields


def pct(value: float) -> str:
    return f"{value:.1%}".replace("%", " %")


def table(header: Sequence[str], align: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def result_table(checked: Sequence[planner.Checked]) -> str:
    """Within the tolerance and median |error|: all rows, by timing, by wire."""
    tol = f"{planner.VALIDATION_TOLERANCE:.0%}".replace("%", " %")
    graph = [c for c in checked if c.metric == "layer" and parse(c)["timing"] == "graph"]
    eager = [c for c in checked if c.metric == "layer" and parse(c)["timing"] == "eager"]
    b2b = [c for c in checked if c.metric == "b2b"]
    one_gpu = [c for c in checked if c.label.startswith("EP1 ")]
    emulated = [c for c in checked if parse(c)["wire"] == "emulated-internode"]
    nvlink = [c for c in checked if not c.label.startswith("EP1 ") and parse(c)["wire"] == ""]
    groups = [
        (f"all {len(checked):,}", checked),
        (f"CUDA-graph replays ({len(graph)})", graph),
        (f"eager, ranks lined up ({len(eager)})", eager),
        (f"eager, back to back ({len(b2b)})", b2b),
        (f"one GPU ({len(one_gpu)})", one_gpu),
        (f"NVLink, EP2 ({len(nvlink)})", nvlink),
        (f"emulated inter-node wire, EP2 ({len(emulated)})", emulated),
    ]
    rows = []
    for name, group in groups:
        within = sum(c.within for c in group)
        median = statistics.median(abs(c.error) for c in group)
        rows.append((name, f"{within:,} ({within / len(group):.0%})".replace("%)", " %)"), pct(median)))
    return table(("rows", f"within {tol}", "median \\|error\\|"), "lrr", rows)


def wires_table(checked: Sequence[planner.Checked]) -> str:
    """The files measured on both wires (``*_wire_*``), by file and timing."""
    by: dict[tuple[bool, str, str], list[planner.Checked]] = {}
    for c in checked:
        if "_wire_" in c.file:
            fields = parse(c)
            by.setdefault((fields["wire"] != "", c.file, fields["timing"]), []).append(c)
    rows = []
    for (emulated, file, timing), group in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "graph")):
        fields = [parse(c) for c in group]
        regimes = sorted({f["regime"] for f in fields if f["regime"]})
        tokens = sorted({int(f["tokens"]) for f in fields})
        span = " / ".join(regimes) if regimes else f"{tokens[0]}–{tokens[-1]} tokens"
        errors = [abs(c.error) for c in group]
        rows.append(
            (
                f"`{file}`",
                "emulated" if emulated else "NVLink",
                f"{'CUDA graph' if timing == 'graph' else 'eager'} ({span})",
                str(len(group)),
                str(sum(c.within for c in group)),
                pct(statistics.median(errors)),
                pct(max(errors)),
            )
        )
    tol = f"{planner.VALIDATION_TOLERANCE:.0%}".replace("%", " %")
    header = ("file", "wire", "timing", "rows", f"within {tol}", "median \\|error\\|", "max \\|error\\|")
    return table(header, "lllrrrr", rows)


def files_table(checked: Sequence[planner.Checked]) -> str:
    """``planner.validation_summary``: per file and metric, then all rows."""
    rows = []
    for file, metric, *rest in planner.validation_summary(checked):
        rows.append(("**all**" if file == "all" else f"`{file}`", metric, *rest))
    tol = f"{planner.VALIDATION_TOLERANCE:.0%}".replace("%", " %")
    header = ("file", "metric", "rows", "median \\|error\\|", "max \\|error\\|", f"within {tol}")
    return table(header, "llrrrr", rows)


def spread_line(checked: Sequence[planner.Checked]) -> str:
    """``planner.repeatability``: how far one setup measured in two files differs, by timing."""
    lines = []
    for timing, spread in planner.repeatability(checked).items():
        if spread:
            lines.append(
                f"- {timing}: median {statistics.median(spread):.1%} over {len(spread)} setups, max {max(spread):.1%}"
            )
    return "\n".join(lines)


def cell(c: planner.Checked) -> str:
    return f"{c.error:+.0%} ({planner.round_sig(c.measured_us, 4):,.0f})"


def appendix(checked: Sequence[planner.Checked], benches: dict[str, set[str]]) -> str:
    """Every validated row, one table per file: layer benchmarks by tokens, SBO rows by overlap mode,
    TBO rows by delay."""
    delays = sorted({int(f["delay"]) for c in checked if (f := parse(c))["delay"]})
    out = [
        "## Appendix: every validated row",
        "",
        "Each cell: error (measured µs). Rows are grouped by setup; a blank cell was not measured. "
        "Printed by `python benchmarks/simulation_tables.py --only appendix`.",
    ]
    files = sorted({c.file for c in checked})
    for file in files:
        mine = [c for c in checked if c.file == file]
        cells: dict[tuple, dict[str, planner.Checked]] = {}
        if benches.get(file) == {"tbo"}:
            columns = ["no TBO", *(f"TBO delay {d}" if d == 0 else f"delay {d}" for d in delays)]
            header = ["setup", "regime", "size", "timing", "overlap", *columns]
            align = "llrll" + "r" * len(columns)
            for c in mine:
                f = parse(c)
                key = (f["setup"], f["regime"], int(f["tokens"]), f["timing"], f["overlap"])
                column = "no TBO" if not f["delay"] else columns[1 + delays.index(int(f["delay"]))]
                cells.setdefault(key, {})[column] = c
        elif benches.get(file) == {"sbo"}:
            columns = list(OVERLAP_MODES)
            header = ["setup", "tokens", "timing", *columns]
            align = "lrl" + "r" * len(columns)
            for c in mine:
                f = parse(c)
                cells.setdefault((f["setup"], int(f["tokens"]), f["timing"]), {})[f["overlap"]] = c
        else:
            sizes = sorted({int(parse(c)["tokens"]) for c in mine})
            columns = [f"{t} tok" for t in sizes]
            header = ["setup", "timing", "metric", *columns]
            align = "lll" + "r" * len(columns)
            for c in mine:
                f = parse(c)
                cells.setdefault((f["setup"], f["timing"], c.metric), {})[f"{f['tokens']} tok"] = c
        rows = []
        for key, by_column in sorted(cells.items()):
            rows.append((*(str(k) for k in key), *(cell(by_column[k]) if k in by_column else "" for k in columns)))
        out += ["", f"### `{file}`", "", table(header, align, rows)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results", help="a folder of result files, or one file")
    parser.add_argument("--only", choices=PARTS, help="print one part (default: all, in the doc's order)")
    args = parser.parse_args(argv)
    rows = planner.load_rows(args.results)
    checked = planner.validate(rows)
    duplicates = len(checked) - len({(c.file, c.label, c.metric) for c in checked})
    if duplicates:
        raise SystemExit(f"{duplicates} checks share a file, label and metric: the appendix would drop them")
    benches: dict[str, set[str]] = {}
    for r in rows:
        benches.setdefault(r.file, set()).add(str(r.get("bench")))
    parts = {
        "result": lambda: result_table(checked),
        "wires": lambda: wires_table(checked),
        "files": lambda: files_table(checked),
        "spread": lambda: spread_line(checked),
        "appendix": lambda: appendix(checked, benches),
    }
    for name in [args.only] if args.only else PARTS:
        if not args.only:
            print(f"<!-- {name} -->")
        print(parts[name]())
        print()


if __name__ == "__main__":
    main()

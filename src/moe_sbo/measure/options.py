"""Command-line options and defaults the subcommands and the ``benchmarks/`` drivers share, and how
they print: console width, tables, compact numbers, notes, logging.

The hard part is checking before starting: every option is resolved and checked here, on the
launching process, so a bad value is a usage error before any rank starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from .. import env
from ..config import PRESETS, MoEConfig
from ..quant.fp8 import FP8_BLOCK, sizes_off_blocks
from .results import dump_json

# ---- printing ------------------------------------------------------------------------------------

TABLE_WIDTH = 100  # every table must fit this many columns without folding a number


def make_console(stdout_taken: bool = False) -> Console:
    """A console as wide as the terminal; piped, ``COLUMNS`` or 100 (rich would assume 80, and fold).
    ``stdout_taken``: a JSON document goes to standard output (``--json -``), so the rest goes to stderr."""
    return Console(width=shutil.get_terminal_size((TABLE_WIDTH, 24)).columns, stderr=stdout_taken)


# Header words a narrow layout may shorten, each named in a legend under the table.
HEADER_ABBREVIATIONS = {
    "dispatch": "disp",
    "combine": "comb",
    "experts": "exp",
    "efficiency": "eff",
    "tokens": "tok",
    "redundant": "red",
    "hierarchical": "hier",
}


def make_table(
    title: str, columns: list[tuple[str, str]], *, wrap: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> FitTable:
    """A table compact enough for 100 columns: no frame, a rule under the header, one space between
    columns. ``columns``: (header, justify): right-justified columns hold numbers, left-justified
    ones names; ``wrap``: headers of the columns that hold prose, wrapped to what is left;
    ``optional``: headers of the columns a narrow terminal may leave out, the first named first.
    ``FitTable`` lays it out for the width it is printed at."""
    return FitTable(title, columns, wrap=wrap, optional=optional)


class FitTable(Table):
    """A table that never cuts a number or a name, whatever the terminal's width.

    Rich, given a table wider than the terminal, shortens every column alike, and ``combine`` and
    ``combine_sm`` both become ``combi…``. Laid out at print time instead, a table wider than the
    console is narrowed a step at a time, only as far as it must, each step said under the table:
    headers wrap at their spaces; a column whose rows all hold one value becomes one line ("every
    row: ..."); header words shorten (``HEADER_ABBREVIATIONS``, with a legend); ``optional`` columns
    are left out, then, should it still not fit, number columns from the right (each named). Names
    and numbers keep their whole width; only prose (``wrap``) folds.
    """

    def __init__(
        self,
        title: str,
        columns: list[tuple[str, str]],
        *,
        wrap: tuple[str, ...] = (),
        optional: tuple[str, ...] = (),
    ) -> None:
        super().__init__(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
        headers = [header for header, _ in columns]
        for name in (*wrap, *optional):
            if name not in headers:
                raise ValueError(f"wrap and optional must name columns of {headers}, got {name!r}")
        for header, justify in columns:
            self.add_column(header, justify=justify, no_wrap=header not in wrap)  # type: ignore[arg-type]
        self.wrap, self.optional = wrap, optional

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table, notes = self.fitted(console, options.max_width)
        yield table
        for note in notes:
            yield Text(note, style="dim")

    def fitted(self, console: Console, width: int) -> tuple[Table, list[str]]:
        """This table laid out for ``width`` columns, and the lines that say what the layout changed."""
        kept = [list(column.cells) for column in self.columns]  # as given: markup and all
        rows = [[_plain(console, cell) for cell in cells] for cells in kept]
        headers = [str(column.header) for column in self.columns]
        cells_w = [max((_width(text) for text in column), default=0) for column in rows]
        prose = [header in self.wrap for header in headers]
        shown = [True] * len(headers)
        head_w = [_width(header) for header in headers]
        wrapped = [False] * len(headers)
        notes: list[str] = []

        def col_w(i: int) -> int:
            header = _words_width(headers[i]) if wrapped[i] else head_w[i]
            if prose[i]:  # folds to the longest word of its cells, or of its header
                return max(header, max((_words_width(text) for text in rows[i]), default=0))
            return max(header, cells_w[i])

        def total() -> int:
            widths = [col_w(i) for i in range(len(headers)) if shown[i]]
            return sum(widths) + len(widths) - 1

        # 1. headers wrap at their spaces, the widest saving first
        for i in sorted(range(len(headers)), key=lambda i: _words_width(headers[i]) - head_w[i]):
            if total() <= width:
                break
            wrapped[i] = True
        # 2. a column holding one value in every row (but the rows' first name) becomes a line
        if total() > width and len(self.rows) > 1:
            folded = []
            name = next((i for i, column in enumerate(self.columns) if column.justify != "right"), None)
            for i in range(len(headers)):
                if total() <= width:
                    break
                if i != name and not prose[i] and len(set(rows[i])) == 1 and rows[i][0]:
                    shown[i] = False
                    folded.append(f"{headers[i]} {rows[i][0]}")
            if folded:
                notes.append("every row: " + "; ".join(folded))
        # 3. header words shorten, where that narrows the column
        legend: list[str] = []
        for i in range(len(headers)):
            if total() <= width:
                break
            short = " ".join(HEADER_ABBREVIATIONS.get(word, word) for word in headers[i].split(" "))
            if not shown[i] or short == headers[i]:
                continue
            before, full = col_w(i), headers[i]
            headers[i], head_w[i] = short, _width(short)
            if col_w(i) < before:
                legend += [f"{s}: {w}" for w, s in HEADER_ABBREVIATIONS.items() if s in short.split(" ")]
            else:
                headers[i], head_w[i] = full, _width(full)
        if legend:
            notes.append("; ".join(dict.fromkeys(legend)))
        # 4. optional columns are left out, then (a last resort) numbers from the right
        left_out = []
        original = [str(column.header) for column in self.columns]
        numbers = [i for i, column in reversed(list(enumerate(self.columns))) if column.justify == "right"]
        for i in [original.index(name) for name in self.optional] + numbers:
            if total() <= width:
                break
            if shown[i]:
                shown[i] = False
                left_out.append(original[i])
        if left_out:
            notes.append(f"left out at {width} columns: {', '.join(left_out)} (a wider terminal shows them)")
        for i in range(len(headers)):  # a header wrapped before a later step made room: whole again
            wrapped[i] = False
            if total() > width:
                wrapped[i] = True

        table = Table(
            title=self.title, caption=self.caption, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0)
        )
        for i, column in enumerate(self.columns):
            if not shown[i]:
                continue
            if prose[i]:
                table.add_column(headers[i], justify=column.justify, overflow="fold", min_width=col_w(i))
            else:
                table.add_column(headers[i], justify=column.justify, width=col_w(i), overflow="fold")
        for r in range(len(self.rows)):
            table.add_row(*(cells[r] for i, cells in enumerate(kept) if shown[i]))
        return table, notes


def _plain(console: Console, cell: object) -> str:
    """A cell's text without its markup."""
    if isinstance(cell, Text):
        return cell.plain
    return console.render_str(cell).plain if isinstance(cell, str) else str(cell)


def _width(text: str) -> int:
    """Terminal columns of ``text``'s widest line."""
    return max((cell_len(line) for line in text.split("\n")), default=0)


def _words_width(text: str) -> int:
    """Terminal columns of ``text``'s widest word (what it needs, wrapped at its spaces)."""
    return max((cell_len(word) for word in text.split()), default=0)


def compact(value: float | None) -> str:
    """``value`` in at most 6 characters: 812, 9999, 12.3k, 4.5M, 1.2G ("-" for None)."""
    if value is None:
        return "-"
    if abs(value) < 9999.5:
        return f"{value:.0f}"
    for suffix in "kMGT":
        value /= 1000
        if abs(value) < 999.95:
            return f"{value:.1f}{suffix}"
    return f"{value:.0f}P"


def sci(value: float) -> str:
    """A small error in few characters: 1.1e-6 (Python writes 1.1e-06), 0 for exactly 0."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def cpu_timing_note(device: str) -> str | None:
    """The line under a table of CPU times: they show the code runs, not how fast a GPU would."""
    if device != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU timings: gloo on {cores} cores, not a performance measurement"


def print_notes(console: Console, *notes: str | None) -> None:
    """Legend and notes under a table, dimmed, one note each, wrapped at the console's width or
    ``TABLE_WIDTH``, the narrower (None: skipped)."""
    for note in notes:
        if note:
            console.print(note, style="dim", highlight=False, width=min(console.width, TABLE_WIDTH))


# ---- logging -------------------------------------------------------------------------------------

_handler: logging.Handler | None = None
_level: int | None = None  # set by --log-level / -v; ranks are given it with each call (in_ranks)


def log_level(verbose: int | None, level: str | None) -> int | None:
    """``--log-level``, else ``-v`` (INFO) or ``-vv`` (DEBUG), else None: logging left as Python has it
    (warnings printed bare)."""
    if level is not None:
        return getattr(logging, level)
    if verbose:
        return logging.INFO if verbose == 1 else logging.DEBUG
    return None


def configure_logging(level: int | None, prefix: str = "") -> None:
    """Send the library's loggers (``moe_sbo.*``) at ``level`` and above to stderr; None undoes it."""
    global _handler, _level
    library = logging.getLogger("moe_sbo")
    if _handler is not None:
        library.removeHandler(_handler)
        _handler = None
    _level = level
    library.setLevel(level if level is not None else logging.NOTSET)
    if level is not None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter(f"{prefix}%(name)s: %(levelname)s: %(message)s"))
        library.addHandler(_handler)


@dataclass(frozen=True)
class _Logged:
    """A rank function run after configuring the rank's logging as the launcher's: ranks do not
    inherit it (CPU ranks fork from a server started before the command line was read)."""

    fn: Callable[..., Any]
    level: int

    def __call__(self, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        if _level != self.level:
            configure_logging(self.level, prefix=f"rank {rank}: ")
        return self.fn(device, *args, **kwargs)


def in_ranks(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as ``LocalRanks.run`` should call it: with the log level set by ``--log-level``/``-v``."""
    return fn if _level is None else _Logged(fn, _level)


# ---- defaults and checks -------------------------------------------------------------------------


def default_dtype_name(device: str) -> str:
    """The activation dtype a run uses unless told: bf16 on GPUs, float32 on CPU ranks."""
    return "bfloat16" if device == "cuda" else "float32"


def default_ep_size(device: str) -> int:
    """Ranks ``demo``, ``bench``, ``check`` and the benchmark drivers start unless told: every
    visible GPU, or 2 CPU ranks."""
    return torch.cuda.device_count() if device == "cuda" else 2


def resolve_ranks(ranks: int | None, device: str) -> int:
    """``--ranks`` checked (>= 1), or ``default_ep_size`` when not given. On CUDA more ranks than GPUs
    share them round-robin (``launch.group``). The environment the ranks will read is checked with it
    (``env.check``)."""
    if ranks is not None and ranks < 1:
        raise ValueError(
            f"--ranks must be >= 1, got {ranks}; leave it out for the default (every GPU on CUDA, 2 on CPU)"
        )
    world_size = default_ep_size(device) if ranks is None else ranks
    env.check(world_size)
    return world_size


def resolve_expert_dtype(choice: str | None, cfg: MoEConfig) -> str | None:
    """``--expert-dtype`` as ``MoELayer``'s ``expert_dtype`` (None: the layer's dtype), checked against
    ``cfg`` here: the layer would raise the same error on every rank, after they started."""
    if choice != "fp8":
        return None
    bad = sizes_off_blocks(cfg.hidden_size, cfg.moe_intermediate_size)
    if bad:
        raise ValueError(
            f"--expert-dtype fp8 needs hidden_size and moe_intermediate_size that are multiples of {FP8_BLOCK} "
            f"(one weight scale per {FP8_BLOCK}x{FP8_BLOCK} block), got {bad} for model {cfg.name}; "
            "leave out --expert-dtype (experts in --dtype) for this model"
        )
    return "fp8"


def add_rank_args(p: argparse.ArgumentParser, preset: str = "tiny") -> None:
    """The options a one-setup driver (soak, validation cost) shares: device, rank count, preset, dtype."""
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks to start (default: every GPU on CUDA, 2 on CPU); more ranks than GPUs share them round-robin "
        "(a functional run: correctness, not wire speed)",
    )
    p.add_argument("--preset", default=preset, choices=sorted(PRESETS))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")


def result_path(out: str, stem: str, device: str) -> Path:
    """``out`` as given, or ``out/<stem>_<device>.json`` when it names a directory."""
    path = Path(out)
    return path / f"{stem}_{device}.json" if path.is_dir() else path


# ---- expert load: --skew, --load and load files --------------------------------------------------


@dataclass(frozen=True)
class TargetLoad:
    """A per-expert load a run asked for: ``load`` (one number per expert, mean 1 for ``zipf:S``, tokens
    for a load file) and ``label`` (``zipf:1.2``, or the file's path)."""

    load: list[float]
    label: str


def target_load(spec: str, num_experts: int, model: str, flag: str = "--skew") -> TargetLoad:
    """``zipf:S`` or a load file's path -> the load for ``num_experts`` experts of ``model``. Raises
    ``ValueError`` naming ``flag`` for a bad exponent, a file that is not a load file, or one recorded
    for another expert count."""
    if spec.startswith("zipf:"):
        from ..eplb import zipf_load

        text = spec.removeprefix("zipf:")
        try:
            s = float(text)
        except ValueError:
            s = float("nan")
        if not 0 <= s < float("inf"):
            raise ValueError(
                f"{flag} zipf:S needs an exponent S >= 0, got {spec!r}; e.g. {flag} zipf:1.2 (zipf:0 is an even load)"
            )
        return TargetLoad(zipf_load(num_experts, s, seed=0).tolist(), f"zipf:{s:g}")
    return TargetLoad(read_load_file(spec, num_experts, model, flag), spec)


def read_load_file(path: str, num_experts: int, model: str, flag: str) -> list[float]:
    """The ``load`` of a file ``write_load_file`` wrote, checked against ``num_experts`` experts of ``model``."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"{flag} must be zipf:S or a load file, got {path!r}, which does not exist; "
            "record one with moe-sbo bench eplb --record-load PATH, or use zipf:S"
        ) from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{flag} {path} must be a JSON load file, but it cannot be read: {err}") from None
    load = doc.get("load") if isinstance(doc, dict) else None
    if not isinstance(load, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in load):
        raise ValueError(
            f'{flag} {path} must hold {{"load": [one number per expert], ...}}, got no such list; '
            "record one with moe-sbo bench eplb --record-load PATH"
        )
    if len(load) != num_experts:
        recorded = f" (recorded on {doc['preset']})" if doc.get("preset") else ""
        raise ValueError(
            f"{flag} {path} must hold one load per expert of {model} ({num_experts}), got {len(load)}{recorded}; "
            "use a load recorded with the same model and expert count, or zipf:S"
        )
    if not all(math.isfinite(v) and v >= 0 for v in load) or sum(load) <= 0:
        raise ValueError(f"{flag} {path} must hold finite loads >= 0, not all 0; record it again")
    return [float(v) for v in load]


def recorded_model(path: str) -> str | None:
    """The model a load file ``write_load_file`` wrote was recorded on (its ``preset``); None when the
    file cannot say (``read_load_file`` then names what is wrong with it)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    preset = doc.get("preset") if isinstance(doc, dict) else None
    return preset if isinstance(preset, str) else None


def write_load_file(path: Path, load: list[float], preset: str, meta: dict) -> None:
    """``{"meta", "load", "num_experts", "preset"}``: what ``--skew PATH`` and ``plan --load`` read."""
    dump_json(path, {"meta": meta, "load": load, "num_experts": len(load), "preset": preset})

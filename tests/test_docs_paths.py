"""Every repository path, result file, link and ``moe_sbo`` name that the docs and docstrings cite exists.

Read: ``docs/*.md`` and ``README.md`` (the CHANGELOG keeps the names of past releases), and every
module, class and function docstring under ``src/``. What is checked, and how it is told apart from
prose and from other projects' names:

- a path under ``src/``, ``benchmarks/``, ``docs/`` or ``tests/`` (anywhere in the text): the file or
  folder exists; a ``:LINE`` after it is ignored; a path starting ``../`` stays inside the
  repository (its users have nothing beside it);
- a path ``a/b.py`` without those roots: relative to ``src/moe_sbo`` (``experts/routed.py``), ``src``,
  the repository root, or (in a docstring) its module's folder or one above it; first folders of
  other projects are skipped;
- a bare ``name.py`` or ``name.sh`` in code (`` `x` `` in Markdown, ````x```` in docstrings): in
  Markdown, some file of the repository has that name; in a docstring, a module in its module's
  folder or one above it (as relative imports name it), or a file outside the package
  (``soak.py``);
- a result file name (``*_h200x1.json``, ``*_cpu.json``, any ``_h<N>x<M>`` or ``_cpu`` name ending in
  ``.json``, ``.txt`` or ``.log``): it is in ``benchmarks/results/``; and each file there is quoted by
  a doc (``docs/*.md``, ``README.md`` or ``CHANGELOG.md``);
- a Markdown link ``[text](target)`` that is not a URL: the target exists, and its ``#anchor`` is a
  heading of that file (GitHub's slugs);
- a dotted name starting ``moe_sbo.`` (anywhere), and ``from moe_sbo.x import a, b`` in code blocks:
  the module imports (``importlib``) and each further name is an attribute of it, or of the class
  it reaches (instance attributes assigned in the class's source count); a logger's name
  (``logging.getLogger("moe_sbo.tbo")`` in the source) counts too;
- a dotted name in code that starts with a module of the package (``fp8_gemm.grouped_gemm``,
  ``quant.kernels.quantize_rows``) or a class of it (``RoutedExperts.route``): the same, from any
  module or class of that name. Roots the source also uses as variable names (``layer``,
  ``dispatcher``, ``experts``: ``layer.rebalance()`` is a method of an instance) are not read as
  module names, nor are names the docs' code examples assign (``auto = AutoTbo(...)``), nor an
  engine's name (``vllm.general_plugins`` is vLLM's, not ``moe_sbo.engines.vllm``'s).

Names with a glob or placeholder (``*``, ``{a,b}``, ``<x>``) are skipped.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "moe_sbo"
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
QUOTING_DOCS = [*DOCS, ROOT / "CHANGELOG.md"]
# First folders of paths that belong to other projects (DeepEP, vLLM, SGLang, Megatron, ...).
FOREIGN = {
    "deep_ep", "deepep", "deep_gemm", "vllm", "sglang", "transformers", "torch", "triton", "megatron",
    "torchtitan", "fused_moe", "flashinfer", "nccl", "moe", "layers", "model_executor", "site-packages",
}  # fmt: skip
GLOB = set("*{}<>[]")

UP_RE = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*\w)")
PATH_RE = re.compile(r"(?<![\w./-])((?:src|benchmarks|docs|tests)/[\w./-]*\w)")
REL_PY_RE = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[A-Za-z_]\w*\.py)\b")
BARE_FILE_RE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|sh))\b")
RESULT_RE = re.compile(r"(?<![\w./-])([\w-]*_(?:h\d+x\d+|cpu)(?:_[\w-]*)?\.(?:json|txt|log))\b")
LINK_RE = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
QUALIFIED_RE = re.compile(r"(?<![\w./-])(moe_sbo(?:\.[A-Za-z_]\w*)+)")
DOTTED_RE = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT_RE = re.compile(r"^\s*from\s+(moe_sbo(?:\.\w+)*)\s+import\s+\(?([\w ,]+)\)?", re.M)
FENCE_RE = re.compile(r"^```.*?^```", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Text:
    """A piece of text to read: its file, the line its first character is on, and its kind."""

    path: Path
    line: int
    text: str
    markdown: bool

    def where(self, offset: int) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line + self.text.count(chr(10), 0, offset)}"


def _docstrings(path: Path) -> Iterator[Text]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    yield Text(path, first.value.lineno, first.value.value, markdown=False)


@functools.cache
def _texts() -> tuple[Text, ...]:
    texts = [Text(p, 1, p.read_text(), markdown=True) for p in DOCS]
    for path in sorted(PACKAGE.rglob("*.py")):
        texts.extend(_docstrings(path))
    return tuple(texts)


def _globbed(text: str, start: int, end: int) -> bool:
    """Whether the match at ``text[start:end]`` is part of a pattern (``run_gpu_*.sh``, ``{a,b}``)."""
    return bool(GLOB & set(text[max(start - 1, 0) : start] + text[end : end + 1]))


def _code_spans(t: Text) -> Iterator[tuple[int, str]]:
    """(offset, content) of each inline code span: `` `x` `` in Markdown (outside fenced blocks),
    ````x```` in docstrings."""
    if t.markdown:
        fenced = [m.span() for m in FENCE_RE.finditer(t.text)]
        for m in re.finditer(r"`([^`\n]+)`", t.text):
            if not any(a <= m.start() < b for a, b in fenced):
                yield m.start(1), m.group(1)
    else:
        for m in re.finditer(r"``([^`]+?)``", t.text):
            yield m.start(1), m.group(1)


# ---------------------------------------------------------------------------------------------- files


@functools.cache
def _repository_files() -> dict[str, list[Path]]:
    """Every file of the repository worth citing, by name (no caches, virtual environments, .git)."""
    by_name: dict[str, list[Path]] = {}
    skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build", "dist"}
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                if entry.name not in skip and not entry.name.endswith(".egg-info"):
                    stack.append(entry)
            else:
                by_name.setdefault(entry.name, []).append(entry)
    return by_name


def _package_folders(t: Text) -> list[Path]:
    """The folders a docstring names modules from: its module's and each above it up to the package."""
    if t.markdown:
        return [PACKAGE]
    return [t.path.parent, *(p for p in t.path.parent.parents if PACKAGE in p.parents or p == PACKAGE)]


def _relative_py_exists(rel: str, t: Text) -> bool:
    return any((base / rel).exists() for base in [ROOT, ROOT / "src", *_package_folders(t)])


def _bare_file_exists(name: str, t: Text) -> bool:
    found = _repository_files().get(name, [])
    if t.markdown:
        return bool(found)
    # In a docstring a module of the package is named from its module's folder or one above it (as
    # Python's relative imports name it); other files (benchmarks, tests, scripts) by their name.
    return any(p.parent in _package_folders(t) or PACKAGE not in p.parents for p in found)


def _path_problems(t: Text) -> Iterator[str]:
    for m in UP_RE.finditer(t.text):  # ``../x``: from the citing file's folder, inside the repository
        target = (t.path.parent / m.group(1)).resolve()
        if ROOT not in target.parents or not target.exists():
            yield f"{t.where(m.start(1))}: {m.group(1)} is not a file of this repository"
    for m in PATH_RE.finditer(t.text):
        if not _globbed(t.text, m.start(1), m.end(1)) and not (ROOT / m.group(1)).exists():
            yield f"{t.where(m.start(1))}: {m.group(1)} does not exist"
    for m in REL_PY_RE.finditer(t.text):
        rel = m.group(1)
        if rel.split("/")[0] in {"src", "benchmarks", "docs", "tests"} | FOREIGN:
            continue
        if not _globbed(t.text, m.start(1), m.end(1)) and not _relative_py_exists(rel, t):
            yield f"{t.where(m.start(1))}: {rel} is neither under src/moe_sbo/ nor the repository root"
    for offset, span in _code_spans(t):
        for m in BARE_FILE_RE.finditer(span):
            if _globbed(span, m.start(1), m.end(1)) or not m.group(1)[0].islower():
                continue
            if not _bare_file_exists(m.group(1), t):
                where = "in the repository" if t.markdown else "in this module's folder or one above it"
                yield f"{t.where(offset + m.start(1))}: no file {m.group(1)} {where}"
    for m in RESULT_RE.finditer(t.text):
        if not _globbed(t.text, m.start(1), m.end(1)) and not (RESULTS / m.group(1)).exists():
            yield f"{t.where(m.start(1))}: result file {m.group(1)} is not in benchmarks/results/"


# ---------------------------------------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, links and code marks dropped, punctuation but
    hyphens removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    text = FENCE_RE.sub("", path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = _slug(m.group(1))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def _link_problems(t: Text) -> Iterator[str]:
    if not t.markdown:
        return
    text = FENCE_RE.sub(lambda m: "\n" * m.group(0).count("\n"), t.text)
    for m in LINK_RE.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (t.path.parent / file_part).resolve() if file_part else t.path
        if not path.exists():
            yield f"{t.where(m.start(1))}: link target {file_part} does not exist"
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            yield f"{t.where(m.start(1))}: {path.name} has no heading #{anchor}"


# ---------------------------------------------------------------------------------------------- names


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _index() -> tuple[dict[str, list[str]], dict[str, list[str]], frozenset[str], frozenset[str]]:
    """From the source, without importing it: the modules by their last name, the modules defining
    each top-level class, the names a caller holds as variables (parameters, ``self.x`` attributes,
    and names the docs' code examples assign), and the names given to ``logging.getLogger``."""
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    variables: set[str] = set()
    loggers: set[str] = set()
    for doc in DOCS:
        for block in FENCE_RE.finditer(doc.read_text()):
            variables.update(re.findall(r"^\s*([A-Za-z_]\w*)\s*=[^=]", block.group(0), re.M))
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        name = _module_name(path)
        modules.setdefault(name.rpartition(".")[2], []).append(name)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                variables.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                variables.add(node.attr)
        loggers.update(re.findall(r"getLogger\(\s*[\"'](moe_sbo[\w.]*)[\"']", path.read_text()))
    return modules, classes, frozenset(variables), frozenset(loggers)


# The engines' subpackages share their names with the engines (``moe_sbo.engines.vllm``): a dotted name
# starting with one is the engine's own (``vllm.general_plugins``), another project's name.
ENGINE_PACKAGES = frozenset(p.name for p in (PACKAGE / "engines").iterdir() if (p / "__init__.py").is_file())

UNCHECKABLE = object()  # a module that needs an optional dependency this machine lacks


@functools.cache
def _import(module: str) -> object | None:
    """The module, None if there is no such module, ``UNCHECKABLE`` if it needs a missing package."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            return None
        if e.name and e.name.split(".")[0] != "moe_sbo":
            return UNCHECKABLE
        raise


@functools.cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """Names instances of ``cls`` have beyond its class attributes: annotated fields and
    ``self.x = ...`` assignments in the source of ``cls`` and its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        if getattr(klass, "__module__", "").startswith("moe_sbo"):
            try:
                names.update(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(klass)))
            except (OSError, TypeError):
                pass
    return frozenset(names)


def _walk(obj: object, attributes: list[str]) -> bool:
    """Whether each of ``attributes`` is found in turn from ``obj`` (a module or class; past a
    function, constant or instance attribute the rest is not followed)."""
    if obj is UNCHECKABLE:
        return True
    for name in attributes:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif inspect.isclass(obj) and name in _instance_attributes(obj):
            return True
        else:
            return False
        if not (inspect.ismodule(obj) or inspect.isclass(obj)):
            return True
    return True


def _resolves(parts: list[str]) -> bool:
    """Whether ``moe_sbo.a.b.c`` (``parts``) names a module, or an attribute reached from one."""
    for cut in range(len(parts), 0, -1):
        module = _import(".".join(parts[:cut]))
        if module is not None:
            return _walk(module, parts[cut:])
    return False


def _relative_resolves(parts: list[str]) -> bool | None:
    """Whether a name cited without ``moe_sbo.`` resolves from a module or class of the package it
    starts with; None where its first part is neither (or is also a variable name in the source)."""
    modules, classes, variables, _ = _index()
    root = parts[0]
    if root in ENGINE_PACKAGES:
        return None  # ``vllm.general_plugins``: the engine's own package, not moe_sbo.engines.vllm
    if root in classes:
        found = [_import(m) for m in classes[root]]
        return any(m is UNCHECKABLE or (m is not None and _walk(getattr(m, root), parts[1:])) for m in found)
    if root in modules and root not in variables:
        candidates = [m for m in modules[root]]
        return any(_resolves(m.split(".") + parts[1:]) for m in candidates)
    return None


def _name_problems(t: Text) -> Iterator[str]:
    for m in QUALIFIED_RE.finditer(t.text):
        if t.text[m.end(1) : m.end(1) + 1] in ("/", "-") or _globbed(t.text, m.start(1), m.end(1)):
            continue
        if not _resolves(m.group(1).split(".")) and m.group(1) not in _index()[3]:
            yield f"{t.where(m.start(1))}: {m.group(1)} does not resolve"
    if t.markdown:
        for m in FROM_IMPORT_RE.finditer(t.text):
            for name in (n.strip() for n in m.group(2).split(",")):
                if name and not _resolves([*m.group(1).split("."), name]):
                    yield f"{t.where(m.start(1))}: from {m.group(1)} import {name}: no such name"
    for offset, span in _code_spans(t):
        for m in DOTTED_RE.finditer(span):
            name = m.group(1)
            if name.startswith("moe_sbo.") or span[m.end(1) : m.end(1) + 1] in ("/", "-"):
                continue
            if re.search(r"\.(py|sh|md|json|txt|log|png|toml|yaml|safetensors)$", name):
                continue
            if _relative_resolves(name.split(".")) is False:
                yield f"{t.where(offset + m.start(1))}: {name} resolves to no module or class of moe_sbo"


# ---------------------------------------------------------------------------------------------- tests


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} stale {what} (file:line: citation):\n  " + "\n  ".join(problems)


def test_every_cited_path_and_result_file_exists() -> None:
    problems = [p for t in _texts() for p in _path_problems(t)]
    assert not problems, _report(problems, "paths")


def test_every_markdown_link_and_anchor_exists() -> None:
    problems = [p for t in _texts() for p in _link_problems(t)]
    assert not problems, _report(problems, "links")


def test_every_cited_moe_sbo_name_resolves() -> None:
    problems = [p for t in _texts() for p in _name_problems(t)]
    assert not problems, _report(problems, "names")


def test_every_result_file_is_quoted_by_a_doc() -> None:
    quoted = "\n".join(p.read_text() for p in QUOTING_DOCS)
    unquoted = sorted(
        p.name
        for p in RESULTS.iterdir()
        if p.is_file() and not re.search(rf"(?<![\w.-]){re.escape(p.name)}(?![\w-])", quoted)
    )
    assert not unquoted, (
        f"{len(unquoted)} file(s) in benchmarks/results/ that no doc quotes (docs/*.md, README.md, "
        "CHANGELOG.md): quote each where its claim is, or delete it (git keeps it):\n  " + "\n  ".join(unquoted)
    )


def test_the_matchers_find_what_they_should() -> None:
    """The checks above pass on nothing if their patterns stop matching: each one on a hand-made text."""
    doc = ROOT / "docs" / "BENCHMARKS.md"
    text = (
        "See `src/moe_sbo/no_such.py:3`, `experts/no_such.py`, `no_such_script.sh`, `gone_h200x1.json`,\n"
        "[a](BENCHMARKS.md#no-such-heading), [b](NO_SUCH.md), `moe_sbo.launch.ranks.init_from_torchrun()`,\n"
        "`fp8_gemm.no_such_name`, `RoutedExperts.no_such_method`; fine: `src/moe_sbo/layer.py`,\n"
        "`experts/routed.py:104`, `soak.py`, `run_gpu_*.sh`, `soak_cpu.json`, [c](FP8.md#kernel-choices),\n"
        "`moe_sbo.launch.group.init_from_torchrun`, `fp8_gemm.grouped_gemm`, `RoutedExperts.route`,\n"
        "`layer.rebalance()`, `torch.cuda.synchronize`; and ../shared/STYLE.md.\n"
    )
    t = Text(doc, 10, text, markdown=True)
    found = [*_path_problems(t), *_link_problems(t), *_name_problems(t)]
    stale = [
        "src/moe_sbo/no_such.py", "experts/no_such.py", "no_such_script.sh", "gone_h200x1.json",
        "#no-such-heading", "NO_SUCH.md", "moe_sbo.launch.ranks.init_from_torchrun",
        "fp8_gemm.no_such_name", "RoutedExperts.no_such_method", "../shared/STYLE.md",
    ]  # fmt: skip
    for citation in stale:
        assert any(citation in p for p in found), f"{citation} not reported: {found}"
    assert len(found) == len(stale), found
    assert any(p.startswith("docs/BENCHMARKS.md:10: src/moe_sbo/no_such.py") for p in found), found
    assert _slug("FP8 routed experts — 1× H200") == "fp8-routed-experts--1-h200"

"""Every ``moe_sbo.…`` name the README and docs/ cite in backquotes exists: a module, a name in one,
or a logger the package makes (``logging.getLogger("moe_sbo.…")``)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = sorted(
    {(doc.name, m.group(1)) for doc in DOCS for m in re.finditer(r"`(moe_sbo(?:\.\w+)+)(?:\(\))?`", doc.read_text())}
)
LOGGERS = {
    m.group(1)
    for path in (ROOT / "src" / "moe_sbo").rglob("*.py")
    for m in re.finditer(r"getLogger\(\"(moe_sbo[\w.]*)\"\)", path.read_text())
}


def _resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_docs_cite_names():
    assert ("README.md", "moe_sbo.launch.group.init_from_torchrun") in CITED


@pytest.mark.parametrize("doc, name", CITED)
def test_a_cited_name_exists(doc, name):
    if name in LOGGERS:
        return
    try:
        _resolve(name)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{doc} cites {name}, which does not exist: {err}")

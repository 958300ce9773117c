"""The package's layout rules: every module imports alone, no import loops, arrows point down.

Rooms, top to bottom: ``cli`` (the command line) may import anything; ``bench`` (the benchmark
modes' runners) the core and every tool room but ``cli``; ``engines`` (the vLLM and SGLang plugins) the core and
``deep_ep``; ``planner``, ``measure``, ``launch``, ``hf`` and ``deep_ep`` (DeepEP's API, a plugin)
import the core and nothing above them (the planner may also
read ``hf`` configs, ``measure`` start ``launch``'s ranks); the core (the root modules, ``routing``,
``experts``, ``quant``, ``dispatch``, ``overlap``, ``decoder``) imports only the core. Imports are read
from the source (``ast``), lazy ones inside functions included, ``if TYPE_CHECKING:`` blocks excluded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moe_sbo"
TOOLS = ("cli", "bench", "engines", "measure", "planner", "hf", "launch", "deep_ep")
# What each tool room may import besides the core (and itself). ``deep_ep`` is a plugin (DeepEP's API
# over the dispatchers): it imports the core's public contract only, and nothing in the core imports it.
TOOL_MAY_IMPORT = {
    "cli": set(TOOLS),
    "bench": {"measure", "launch", "hf", "planner", "deep_ep"},
    "planner": {"hf"},
    "measure": {"launch"},
    "hf": set(),
    "launch": set(),
    "deep_ep": set(),
    "engines": {"deep_ep"},
}
# An engine plugin's modules that subclass the engine's classes import the engine itself: without it
# installed they cannot import, and nothing else in the package imports them.
ENGINE_PACKAGES = {"moe_sbo.engines.vllm": "vllm", "moe_sbo.engines.sglang": "sglang"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py"}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, type_checking: bool = False) -> set[str]:
    """The ``moe_sbo`` modules ``name`` imports (a package stands for its ``__init__``); those under
    ``if TYPE_CHECKING:`` too when ``type_checking``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "moe_sbo")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "moe_sbo":
                for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in MODULES else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return {m for m in found if m in MODULES}


def _room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in TOOLS else "core"


GRAPH = {name: _imports(name) for name in MODULES}


def test_the_core_imports_only_the_core_and_tools_point_down():
    wrong = []
    for name, targets in GRAPH.items():
        room = _room(name)
        allowed = {"core", room} | TOOL_MAY_IMPORT.get(room, set())
        wrong += [f"{name} -> {t}" for t in sorted(targets) if _room(t) not in allowed]
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_loops():
    loops, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                loops.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            walk(name, [name])
    assert not loops, "import loops:\n" + "\n".join(loops)


def _rooms_of(name: str) -> str:
    """A folder of the package is one room; a module at the root is a room of its own."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or MODULES[name].name == "__init__.py" else name


def test_rooms_form_no_circle():
    """Between rooms, type-only imports count too: every arrow points one way."""
    arrows: dict[str, set[str]] = {}
    for name in MODULES:
        room = _rooms_of(name)
        arrows.setdefault(room, set()).update(_rooms_of(t) for t in _imports(name, type_checking=True))
    for room, targets in arrows.items():
        targets.discard(room)
    circles = [f"{a} <-> {b}" for a in sorted(arrows) for b in sorted(arrows[a]) if a < b and a in arrows.get(b, ())]
    seen: dict[str, str] = {}

    def walk(room: str, path: list[str]) -> None:
        seen[room] = "open"
        for nxt in sorted(arrows.get(room, ())):
            if seen.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in seen:
                walk(nxt, path + [nxt])
        seen[room] = "done"

    for room in sorted(arrows):
        if room not in seen:
            walk(room, [room])
    assert not circles, "rooms in a circle:\n" + "\n".join(sorted(set(circles)))


def test_no_private_name_is_imported_from_another_module():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("moe_sbo")):
                found += [f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_every_module_imports_alone():
    """Each module in a fresh set of ``moe_sbo`` modules (torch stays loaded, so this is quick):
    an import that only works after another module was imported fails here."""
    script = (
        "import importlib, sys, torch\n"
        f"names = {sorted(MODULES)!r}\n"
        f"engines = {ENGINE_PACKAGES!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'moe_sbo' or m.startswith('moe_sbo.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        engine = next((e for p, e in engines.items() if name.startswith(p)), None)\n"
        "        if engine is None or exc.name is None or exc.name.split('.')[0] != engine:\n"
        "            failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

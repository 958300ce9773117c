"""Every ``@triton.jit`` kernel reads only globals a compiled kernel may read.

Triton's interpreter (how the CPU tests run the kernels) lets a kernel read any module global;
the compiler refuses a plain number or string (``NameError: Cannot access global variable``) unless
it is a ``tl.constexpr``. So a kernel can pass every CPU test and fail on its first GPU launch. This
test reads each kernel's source and checks every free name it loads against its module's globals.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import types
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

SRC = Path(__file__).resolve().parents[1] / "src"


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    """(module name, function node) of every ``@triton.jit`` function under ``src/moe_sbo``."""
    found = []
    for path in sorted((SRC / "moe_sbo").rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found += [
            (module, node)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list)
        ]
    return found


def _free_loads(fn: ast.FunctionDef) -> set[str]:
    """Names the kernel loads that it neither takes as an argument nor assigns."""
    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    loads = set()
    for node in (n for statement in fn.body for n in ast.walk(statement)):  # not the decorators
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return loads - bound


def _allowed(value: object) -> bool:
    """What Triton lets a compiled kernel read from its globals: constexprs, modules, other kernels
    and functions, classes (``tl`` types among them)."""
    return isinstance(value, tl.constexpr | types.ModuleType | type) or callable(value)


KERNELS = _kernels()


def test_the_scan_finds_the_project_kernels():
    modules = {module for module, _ in KERNELS}
    low_latency = {f"moe_sbo.dispatch.low_latency.kernels.{m}" for m in ("pack", "layout", "combine")}
    assert {"moe_sbo.routing.kernel", "moe_sbo.dispatch.reduce", *low_latency} <= modules
    assert len(KERNELS) >= 20


@pytest.mark.parametrize(("module", "fn"), KERNELS, ids=[f"{m}.{f.name}" for m, f in KERNELS])
def test_a_kernel_reads_only_constexpr_globals(module, fn):
    namespace = vars(importlib.import_module(module))
    bad = []
    for name in sorted(_free_loads(fn)):
        if name in namespace:
            if not _allowed(namespace[name]):
                bad.append(f"{name} = {namespace[name]!r}")
        elif not hasattr(builtins, name):
            bad.append(f"{name} (not defined in {module})")
    assert not bad, (
        f"{module}.{fn.name} reads globals a compiled kernel cannot: {', '.join(bad)}; make each a "
        "tl.constexpr(...) or pass it as an argument"
    )


def test_the_check_catches_a_plain_number():
    source = "import triton\nLIMIT = 3.0\n@triton.jit\ndef k(x_ptr):\n    y = LIMIT\n"
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef))
    assert _free_loads(fn) == {"LIMIT"}
    assert not _allowed(3.0)
    assert _allowed(tl.constexpr(3.0)) and _allowed(tl) and _allowed(inspect)

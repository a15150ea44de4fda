"""Layers: the decision does no I/O, and the ledger knows nothing of Prefect.

The decision modules, and every module of this package they import (followed through `from
prefect_gpu_budget... import`, package `__init__`s included, `if TYPE_CHECKING:` blocks left
out), import no module that reaches the network, the disk, threads, processes or the clock,
and read no clock.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "prefect_gpu_budget"
DECISION = [
    "prefect_gpu_budget.admission.policy",
    "prefect_gpu_budget.admission.quota",
    "prefect_gpu_budget.admission.queueing",
    "prefect_gpu_budget.admission.preemption",
    "prefect_gpu_budget.admission.accounting",
    "prefect_gpu_budget.admission.timing",
    "prefect_gpu_budget.admission.orphans",
]
IMPURE = {
    "prefect",
    "sqlalchemy",
    "threading",
    "_thread",
    "time",
    "socket",
    "httpx",
    "subprocess",
    "os",
}
CLOCK_READS = {"now", "utcnow", "today", "time", "monotonic", "perf_counter"}


def _file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _is_type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _nodes(tree: ast.Module):
    """Every node of the module, the bodies of `if TYPE_CHECKING:` left out."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack += [c for c in ast.iter_child_nodes(node) if not _is_type_checking(c)]


def _imports(module: str) -> set[str]:
    """Full names of the modules `module` imports (for `from a import b`: a, and a.b)."""
    path = _file(module)
    assert path is not None, module
    names: set[str] = set()
    for node in _nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _closure(module: str) -> set[str]:
    """`module` and every module of this package that importing it imports."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a module's packages run their __init__ first
            candidate = ".".join(parts[:i])
            if candidate in seen or _file(candidate) is None:
                continue
            seen.add(candidate)
            todo += [n for n in _imports(candidate) if n.split(".")[0] == PACKAGE]
    return seen


def _clock_reads(module: str) -> list[str]:
    path = _file(module)
    assert path is not None
    return [
        f"{path.name}:{node.lineno} .{node.func.attr}()"
        for node in _nodes(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCK_READS
    ]


def test_the_decision_imports_no_io_threads_clock_or_prefect() -> None:
    for module in DECISION:
        for inner in sorted(_closure(module)):
            impure = {n.split(".")[0] for n in _imports(inner)} & IMPURE
            assert not impure, f"{module} imports {inner}, which imports {sorted(impure)}"
            assert not _clock_reads(inner), (module, inner, _clock_reads(inner))


def test_the_pure_modules_import_what_they_should() -> None:
    assert _closure("prefect_gpu_budget.admission.timing") == {
        "prefect_gpu_budget",
        "prefect_gpu_budget._lazy",
        "prefect_gpu_budget.admission",
        "prefect_gpu_budget.admission.timing",
    }
    assert "prefect_gpu_budget.admission.policy" in _closure(
        "prefect_gpu_budget.admission.accounting"
    )


LEDGER = "prefect_gpu_budget.admission.ledger"
NO_PREFECT = [
    LEDGER,
    # the job's life: what the benchmarks and the chaos worker run, outside any Prefect run
    "prefect_gpu_budget.admission.lifecycle",
]


def _with_submodules(module: str) -> list[str]:
    """`module` and, for a package, each module in it."""
    package = ROOT.joinpath(*module.split("."))
    if not package.is_dir():
        return [module]
    return [module] + [
        f"{module}.{p.stem}" for p in sorted(package.glob("*.py")) if p.stem != "__init__"
    ]


@pytest.mark.parametrize("module", NO_PREFECT)
def test_the_ledger_and_the_job_life_do_not_import_prefect(module: str) -> None:
    modules = _with_submodules(module)
    assert module != LEDGER or len(modules) > 2, modules  # the package and its modules
    for each in modules:
        assert "prefect" not in {n.split(".")[0] for n in _imports(each)}, each
    probe = f"import {module}, sys; print('prefect' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr

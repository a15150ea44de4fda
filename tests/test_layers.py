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
RULES = ROOT / PACKAGE / "admission" / "rules"
DECISION = [
    f"{PACKAGE}.admission.rules.{path.stem}"
    for path in sorted(RULES.glob("*.py"))
    if path.stem != "__init__"
] + [
    # the bill's rules: whose a line is, when a figure is final
    f"{PACKAGE}.billing.lines",
    f"{PACKAGE}.billing.trueup",
    # where a job asking for accelerators runs: the request, the offerings, the choice
    f"{PACKAGE}.placement.accelerators",
    f"{PACKAGE}.placement.offerings",
    f"{PACKAGE}.placement.choice",
]
"""Every module of `admission/rules/` (the folder is the list), and the bill's rules."""
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
    assert _closure("prefect_gpu_budget.admission.rules.timing") == {
        "prefect_gpu_budget",
        "prefect_gpu_budget._lazy",
        "prefect_gpu_budget.admission",
        "prefect_gpu_budget.admission.rules",
        "prefect_gpu_budget.admission.rules.timing",
    }
    assert "prefect_gpu_budget.admission.rules.policy" in _closure(
        "prefect_gpu_budget.admission.rules.accounting"
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


# -- the shape of the objects: small classes, no hidden dependencies, no cycles -----------------

MOST_PUBLIC_METHODS = 30
MOST_LINES = 450
"""A module longer than this holds more than one concern, or one that wants splitting."""


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own)."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _public_methods() -> dict[str, set[str]]:
    """Per class of the package (`module.Class`), its public methods, those of its bases in the
    package included (a base is matched by its name)."""
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for module, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                own = {
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not f.name.startswith("_")
                }
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes[f"{module}.{node.name}"] = (own, bases)
    by_name: dict[str, list[str]] = {}
    for key in classes:
        by_name.setdefault(key.rsplit(".", 1)[1], []).append(key)

    def methods(key: str, seen: frozenset[str] = frozenset()) -> set[str]:
        own, bases = classes[key]
        found = set(own)
        for base in bases:
            for other in by_name.get(base, ()):
                if other not in seen and other != key:
                    found |= methods(other, seen | {key})
        return found

    return {key: methods(key) for key in classes}


def test_no_class_has_more_than_thirty_public_methods() -> None:
    counts = {k: len(v) for k, v in _public_methods().items()}
    assert counts["prefect_gpu_budget.admission.ledger.queue.Queue"] >= 5  # it counts
    big = {k: n for k, n in counts.items() if n > MOST_PUBLIC_METHODS}
    assert not big, big


def test_no_module_is_over_four_hundred_and_fifty_lines() -> None:
    lines = {k: len(p.read_text().splitlines()) for k, p in _modules().items()}
    assert lines["prefect_gpu_budget.admission.ledger.queue"] > 300  # it counts
    long = {k: n for k, n in lines.items() if n > MOST_LINES}
    assert not long, long


def test_the_admission_wing_has_no_mixins_and_no_type_only_imports() -> None:
    """Each collaborator is passed in, so no module declares another's methods for the type
    checker (`if TYPE_CHECKING:`) and no class is put together from mixins."""
    for module, path in _modules().items():
        if not module.startswith(f"{PACKAGE}.admission"):
            continue
        text = path.read_text()
        assert "TYPE_CHECKING" not in text, module
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                assert "Mixin" not in node.name, f"{module}.{node.name}"
                assert not any("Mixin" in ast.unparse(b) for b in node.bases), node.name


def _package_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports anywhere: at module level, under `if
    TYPE_CHECKING:`, and inside functions (a deferred import still ties the two modules
    together; `from a import b`: a.b when that is a module, else a)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            if len(subs) < len(node.names) and node.module in modules:
                found.add(node.module)
            found.update(subs)
    return found


def test_no_import_cycle_not_even_a_type_only_or_deferred_one() -> None:
    modules = _modules()
    graph = {m: _package_imports(p, set(modules)) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycle = path[path.index(other) :] + [other]
                raise AssertionError(" -> ".join(cycle))
            if other not in state:
                walk(other, [*path, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])


# -- one home per feature: rooms import downward only, no private name crosses a module ----------

MOST_FUNCTION_LINES = 80
MOST_OVER_FIFTY = 10
"""A function longer than fifty lines is a loop that wants named steps; a few may stay."""


def _room(module: str) -> str:
    """The room a module lives in: its top-level folder, or itself at the top level."""
    return ".".join(module.split(".")[:2])


def test_no_room_imports_upward() -> None:
    """The rooms (the package's folders, and its top-level modules) import one another one way
    only, deferred and type-only imports counted: no two rooms reach each other. The package's
    own `__init__`, the lazy face of the public names, is the one room everything may be
    reached from."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        if module == PACKAGE:
            continue
        rooms = {_room(m) for m in _package_imports(path, set(modules)) - {PACKAGE}}
        graph.setdefault(_room(module), set()).update(rooms - {_room(module)})

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for other in graph.get(todo.pop(), ()):
                if other == goal:
                    return True
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return False

    assert len(graph) > 10, sorted(graph)  # it counts
    upward = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if reaches(b, a))
    assert not upward, upward


def _private_imports() -> list[str]:
    modules = _modules()
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and not node.level):
                continue
            if node.module.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in modules:
                    found.append(f"{module} imports {node.module}.{alias.name}")
    return found


def test_no_module_takes_a_private_name_of_another() -> None:
    assert not _private_imports()


def _function_lengths() -> dict[str, int]:
    lengths = {}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{module}:{node.lineno} {node.name}"
                lengths[key] = (node.end_lineno or node.lineno) - node.lineno + 1
    return lengths


def test_functions_are_short() -> None:
    lengths = _function_lengths()
    assert len(lengths) > 500, len(lengths)  # it counts
    long = {k: n for k, n in lengths.items() if n > MOST_FUNCTION_LINES}
    assert not long, long
    over_fifty = sorted((n, k) for k, n in lengths.items() if n > 50)
    assert len(over_fifty) <= MOST_OVER_FIFTY, over_fifty

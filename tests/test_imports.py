"""The package's import graph: no cycle, and no floor importing a floor above it.

Read from the source with `ast`, so nothing is imported. Only imports that run when a module is
imported count: those inside functions (deliberately lazy) and under `if TYPE_CHECKING:` do not.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "prefect_gpu_budget"
ROOT = Path(__file__).parents[1] / PACKAGE

FLOORS = ["decision", "ledger", "gate", "tasks", "flows", "cli"]
"""Lowest first: a module may import its own floor and the floors below it, never above."""

DECISION = {
    # The rules that decide, pure (see test_layers): the policy, quotas, queues, preemption, a
    # queued job as the decision sees it, periods, money, the liveness clocks, orphans.
    *(
        f"{PACKAGE}.admission.rules.{p.stem}"
        for p in (ROOT / "admission" / "rules").glob("*.py")
        if p.stem != "__init__"
    ),
    f"{PACKAGE}.admission.rules",
    f"{PACKAGE}.priorities",
    f"{PACKAGE}.units",
}

GATE = {
    f"{PACKAGE}.admission.gate",
    # What an admitted job holds while it runs, and its settlement (the gate hands it over).
    f"{PACKAGE}.admission.holding",
    # An admitted job's life runs on the gate: the task, the soak's agents and the workers call it.
    f"{PACKAGE}.admission.lifecycle",
}

KNOWN_UPWARD: set[tuple[str, str]] = set()
"""Upward imports let stand, each with the reason (none today: reconcile, which read the gate's
liveness clocks, now reads them from `admission.rules.timing`). A new one is a failure to fix, and an
entry whose import has gone fails until it is removed."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run on import: into `if`/`try`/`with` blocks and class bodies, never
    into functions, and not into the body of `if TYPE_CHECKING:`."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        out.append(node)
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                out += _import_time_statements(node.body)
            out += _import_time_statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                out += _import_time_statements(block)
            for handler in node.handlers:
                out += _import_time_statements(handler.body)
        elif isinstance(node, ast.With | ast.ClassDef):
            out += _import_time_statements(node.body)
    return out


def _import_nodes(path: Path, lazy: bool) -> list[ast.AST]:
    tree = ast.parse(path.read_text())
    return list(ast.walk(tree)) if lazy else list(_import_time_statements(tree.body))


def _imports(name: str, path: Path, lazy: bool = False) -> set[str]:
    """The package modules `name` imports when it is imported (`lazy`: or in any function)."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in _import_nodes(path, lazy):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + is_package]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports the module; `from module import name`
            # imports the module only.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` where c is a name
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _outside(path: Path) -> set[str]:
    """The top-level names of the modules from outside the package imported on import."""
    found: set[str] = set()
    for node in _import_nodes(path, lazy=False):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {PACKAGE}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def floor_of(module: str) -> str | None:
    """The floor of a package module, or None for one outside the floors (pricing, launchers,
    blocks, the models, the forecast and simulator, ...)."""
    if module in DECISION:
        return "decision"
    if module in GATE:
        return "gate"
    for prefix, floor in (
        (f"{PACKAGE}.admission", "ledger"),
        (f"{PACKAGE}.tasks", "tasks"),
        (f"{PACKAGE}.flows", "flows"),
        (f"{PACKAGE}.sweeps.flow", "flows"),
        (f"{PACKAGE}.cli", "cli"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return floor
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    out = set()
    for module, targets in graph.items():
        low = floor_of(module)
        for target in targets:
            high = floor_of(target)
            if low is not None and high is not None and FLOORS.index(high) > FLOORS.index(low):
                out.add((module, target))
    return out


def test_the_graph_is_read_from_every_module():
    assert len(MODULES) > 40
    assert f"{PACKAGE}.admission.ledger" in GRAPH[f"{PACKAGE}.admission.gate"]
    # imported only inside a function, and only for type checking: not edges
    assert f"{PACKAGE}.sweeps.forecast" not in GRAPH[f"{PACKAGE}.sweeps.flow"]
    assert f"{PACKAGE}.pricing.catalog" not in GRAPH[f"{PACKAGE}.job"]


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_floor_imports_a_floor_above_it():
    found = upward_imports(GRAPH)
    new = sorted(found - KNOWN_UPWARD)
    gone = sorted(KNOWN_UPWARD - found)
    assert not new, "upward imports (lower floor -> higher floor): " + "; ".join(
        f"{a} ({floor_of(a)}) -> {b} ({floor_of(b)})" for a, b in new
    )
    assert not gone, "no longer imported, remove from KNOWN_UPWARD: " + "; ".join(
        f"{a} -> {b}" for a, b in gone
    )


def test_the_floors_are_as_documented():
    assert floor_of(f"{PACKAGE}.admission.rules.policy") == "decision"
    assert floor_of(f"{PACKAGE}.admission.ledger") == "ledger"
    assert floor_of(f"{PACKAGE}.admission.gate") == "gate"
    assert floor_of(f"{PACKAGE}.admission.lifecycle") == "gate"
    assert floor_of(f"{PACKAGE}.tasks.gpu_job") == "tasks"
    assert floor_of(f"{PACKAGE}.sweeps.flow") == "flows"
    assert floor_of(f"{PACKAGE}.cli") == "cli"
    assert floor_of(f"{PACKAGE}.launchers.local") is None


def _reachable(start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


BELOW_THE_FLOWS = [
    f"{PACKAGE}.sweeps.spec",
    f"{PACKAGE}.sweeps.plots",
    f"{PACKAGE}.sweeps.forecast",
    f"{PACKAGE}.identity",
    f"{PACKAGE}.launchers.local",
]
"""Modules outside the floors that the flows, the CLI and the ledger build on."""


def test_the_models_below_the_flows_never_reach_up_even_lazily():
    """The floors above count top-level imports only; these modules must not import a task,
    flow or CLI module even inside a function (the forecast once imported the sweep flow for
    its spec and the flows' plots, while the sweep flow imports the forecast)."""
    high = {"tasks", "flows", "cli"}
    for module in BELOW_THE_FLOWS:
        reached = {t for t in _imports(module, MODULES[module], lazy=True) if floor_of(t) in high}
        assert not reached, f"{module} imports {sorted(reached)}"
    # The local launcher names its processes with `identity`, not the ledger, and records a
    # start through `threads`, not the gate.
    assert not {t for t in GRAPH[f"{PACKAGE}.launchers.local"] if floor_of(t) is not None}


def test_the_spec_the_forecast_and_process_identity_load_without_prefect():
    for module in (f"{PACKAGE}.sweeps.spec", f"{PACKAGE}.sweeps.forecast", f"{PACKAGE}.identity"):
        loads = {name for m in _reachable(module) for name in _outside(MODULES[m])}
        assert "prefect" not in loads, module
    identity = MODULES[f"{PACKAGE}.identity"]
    assert _outside(identity) <= set(sys.stdlib_module_names) and not GRAPH[f"{PACKAGE}.identity"]


def test_the_local_launcher_loads_neither_the_gate_nor_the_ledger():
    """A launcher runs jobs; deciding and remembering are not its to load (its start goes
    through `threads`)."""
    import subprocess

    code = (
        "import sys, prefect_gpu_budget.launchers.local;"
        "print(sorted(m for m in sys.modules if m.startswith('prefect_gpu_budget.admission.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    loaded = out.stdout.strip()
    assert out.returncode == 0, out.stderr
    assert "admission.gate" not in loaded and "admission.ledger" not in loaded, loaded

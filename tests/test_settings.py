"""Every setting this package reads from the environment is read in `settings.py`: elsewhere the
environment is only passed on (to a job, a holder, a child process), never consulted."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prefect_gpu_budget"


def _reads_a_variable(node: ast.AST) -> bool:
    """`os.environ.get(...)` or `os.getenv(...)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    func = node.func
    if func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os":
        return True
    return (
        func.attr == "get"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "environ"
        and isinstance(func.value.value, ast.Name)
        and func.value.value.id == "os"
    )


def test_the_environment_is_read_in_settings_only():
    """`testing/` is left out: it starts servers for the suite and the benchmarks, and sets
    their environment, as a test would."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "settings.py" and path.parent.name != "testing"
        for node in ast.walk(ast.parse(path.read_text()))
        if _reads_a_variable(node)
    ]
    assert found == [], found

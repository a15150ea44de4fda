"""The install's extras: the core needs no Vertex AI SDK, `[test]` has everything optional."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
VERTEX_SDKS = {"google-cloud-aiplatform", "google-cloud-billing"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


def _own_extras(requirements: list[str]) -> set[str]:
    """The extras of this package that `requirements` pull in, e.g. `prefect-gpu-budget[a,b]`."""
    found = (re.fullmatch(r"prefect-gpu-budget\[(.*)\]", r) for r in requirements)
    return {e.strip() for m in found if m for e in m.group(1).split(",")}


def test_vertex_sdks_are_an_extra_and_the_test_extra_has_all() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    assert not _names(project["dependencies"]) & VERTEX_SDKS
    assert _names(extras["vertex"]) == VERTEX_SDKS
    optional = {name for name in extras if name not in ("all", "test")}
    assert _own_extras(extras["all"]) == optional
    assert "all" in _own_extras(extras["test"])

"""Run Python code in a fresh process where an extra's packages cannot be imported, as in an
install without that extra."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

VERTEX_MODULES = (
    "google.cloud.aiplatform",
    "google.cloud.aiplatform_v1",
    "google.cloud.aiplatform_v1beta1",
    "google.cloud.billing",
    "google.cloud.billing_v1",
    "vertexai",
)
"""What the `vertex` extra (google-cloud-aiplatform, google-cloud-billing) installs."""

_BLOCKER = """
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {modules!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def run_without(
    modules: tuple[str, ...], code: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `code` with none of `modules` (nor their submodules) importable."""
    script = _BLOCKER.format(modules=modules) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )

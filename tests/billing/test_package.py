"""The bill's package face (billing/__init__.py): every public name resolves from its module on
first use, and importing the package (which the pure rules' import runs first) loads none of
the readers."""

from __future__ import annotations

import subprocess
import sys

import prefect_gpu_budget.billing as billing
from prefect_gpu_budget.billing.imports import import_export
from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.sources import SOURCE_TYPES


def test_every_public_name_resolves() -> None:
    assert sorted(billing.__all__) == sorted(set(billing.__all__))
    for name in billing.__all__:
        assert getattr(billing, name) is not None, name
    assert billing.import_export is import_export and billing.BillLine is BillLine
    assert billing.SOURCE_TYPES is SOURCE_TYPES
    assert set(billing.__all__) <= set(dir(billing))


def test_the_package_loads_its_names_lazily() -> None:
    probe = (
        "import sys, prefect_gpu_budget.billing.trueup; "
        "print(sorted(m for m in sys.modules if m.startswith('prefect_gpu_budget.billing')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        [
            "prefect_gpu_budget.billing",
            "prefect_gpu_budget.billing.lines",
            "prefect_gpu_budget.billing.trueup",
        ]
    )

"""A trial runs inside its job's time limit: the modules a trial process loads import only the
standard library (and numpy for the demo's), never Prefect, pydantic or SQLAlchemy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["prefect_gpu_budget.flows.trial", "prefect_gpu_budget.flows.demo_trial"]
)
def test_trial_modules_import_nothing_heavy(module: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import json, sys, {module};"
            "print(json.dumps([m for m in ('prefect', 'pydantic', 'sqlalchemy', 'pandas',"
            " 'matplotlib') if m in sys.modules]))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(done.stdout) == [], done.stderr


def test_report_appends_json_lines(tmp_path, monkeypatch) -> None:
    from prefect_gpu_budget.flows.trial import report
    from prefect_gpu_budget.settings import METRICS_ENV

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(METRICS_ENV, str(path))
    report(step=1, loss=0.5)
    report(summary=True, loss=0.25)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5}, {"summary": True, "loss": 0.25}]

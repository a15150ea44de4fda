"""A trial runs inside its job's time limit: the modules a trial process loads import only the
standard library (and numpy for the demo's), never Prefect, pydantic or SQLAlchemy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["prefect_gpu_budget.sweeps.trial", "prefect_gpu_budget.flows.demo_trial"]
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
    from prefect_gpu_budget.settings import METRICS_ENV
    from prefect_gpu_budget.sweeps.trial import report

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(METRICS_ENV, str(path))
    report(step=1, loss=0.5)
    report(summary=True, loss=0.25)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5}, {"summary": True, "loss": 0.25}]


def test_the_old_entry_still_runs_a_trial_on_the_standard_library(tmp_path) -> None:
    """`prefect_gpu_budget.flows.trial`, the path the manual gave before the sweep had a home of
    its own, still runs a callable to its final metrics, without Prefect."""
    from prefect_gpu_budget.settings import METRICS_ENV

    path = tmp_path / "metrics.jsonl"
    (tmp_path / "objective.py").write_text(
        "import sys\n"
        "from prefect_gpu_budget.flows.trial import report\n"
        "def run(x):\n"
        "    report(step=1, loss=x)\n"
        "    assert 'prefect' not in sys.modules\n"
        "    return {'loss': x / 2}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.flows.trial", "objective:run", '{"x": 0.5}'],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", METRICS_ENV: str(path), "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5}, {"summary": True, "loss": 0.25}]

"""The placement kept on the job's ledger row (`gpu_jobs.choice`), on SQLite and PostgreSQL:
what the job asked and every offering considered, read back by `ledger --json`, `status` and
the agents' door."""

from __future__ import annotations

import json
import os

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.agents.views import trial_view
from prefect_gpu_budget.placement.placing import place_job
from prefect_gpu_budget.placement.recorded import choice_line, choice_view
from tests.cli.support import cli_run
from tests.placement.test_placing import POOL, VERTEX, _job, catalog, lab  # noqa: F401


def test_the_choice_is_on_the_jobs_row_and_read_back(lab, catalog) -> None:  # noqa: F811
    placed = place_job(_job(), "acme/vision/s1", lab, catalog=catalog, routes=[POOL, VERTEX])
    admission = Gate(lab, catalog=catalog).admit(placed.job, "acme/vision/s1")
    row = lab.views.job(admission.job_id)

    view = choice_view(row["choice"])
    assert view is not None and view["accelerators"] == "H200:8"
    assert view["chosen"]["offering"] == "local:h200x8 on-demand (lab-a)"
    assert view["chosen"]["instance_type"] == row["instance_type"] == "local:h200x8"
    others = {o["offering"]: o["why"] for o in view["passed_over"]}
    assert len(others) == len(placed.placement.considered) - 1 >= 1
    assert all(why.startswith("costlier than local:h200x8") for why in others.values())
    assert trial_view(0, None, row)["placement"] == view  # the agents' door

    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": lab.url, "COLUMNS": "100"}
    listed = cli_run(env, "ledger", "--json")
    assert listed.returncode == 0, listed.stderr
    [job] = json.loads(listed.stdout)
    assert job["placement"] == view and job["provisioning"] == "on-demand"
    shown = cli_run(env, "status")
    assert shown.returncode == 0, shown.stderr
    line = f"placed {admission.job_id[:8]} acme/vision/s1: {choice_line(row['choice'])}"
    assert line in " ".join(shown.stdout.split())  # wrapped at the terminal's width
    assert "H200:8 -> local:h200x8 on-demand (lab-a), expected $24.00;" in line


def test_a_job_that_named_its_machine_has_no_choice(lab, catalog) -> None:  # noqa: F811
    from prefect_gpu_budget.job import GpuJob

    job = GpuJob(instance_type="local:h200x8", max_runtime="1h")
    admission = Gate(lab, catalog=catalog).admit(job, "acme/vision/s1")
    row = lab.views.job(admission.job_id)
    assert row["choice"] is None and choice_view(row["choice"]) is None
    assert choice_line(None) is None

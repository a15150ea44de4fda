"""What the door answers, shaped (`agents.views`): each trial's reason in the one wording of
its ending, times in ISO 8601, and a session's budget named as `status --json` names it; over
a real ledger (SQLite and PostgreSQL) and a Prefect run read through a stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import pytest
from prefect.states import Completed

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.stopping import stop_job
from prefect_gpu_budget.agents.callers import Caller
from prefect_gpu_budget.agents.door import Door
from prefect_gpu_budget.agents.limits import STOPPED_BY_AGENT
from prefect_gpu_budget.agents.views import trial_view
from prefect_gpu_budget.placement.recorded import trial_job
from tests.support.jobs import new_job

SESSION = "acme/agents/agent-1"
CALLER = Caller(SESSION, "g")


class _Prefect:
    """What the door reads of Prefect: one flow run of `SESSION`, ended Completed."""

    def __init__(self, run_id: str) -> None:
        self.run = SimpleNamespace(
            id=uuid.UUID(run_id),
            name="brave-otter",
            parameters={"session": SESSION},
            state=Completed(),
        )

    def read_flow_run(self, flow_run_id: uuid.UUID) -> Any:
        return self.run


def _ran(ledger: Ledger, run_id: str, trial: int, outcome: str, stopped: bool = False) -> str:
    """A trial's job, admitted, run for 10 s and settled as `outcome` (stopped by its agent
    first, if `stopped`)."""
    job_id, decision = ledger.queue.request(
        new_job(SESSION, name=f"train/{trial:04d}", flow_run_id=run_id)
    )
    assert decision.verdict == "admit", decision
    started = time.time() - 10
    assert ledger.settlements.mark_started(job_id, started)
    if stopped:
        assert stop_job(ledger, job_id, SESSION, STOPPED_BY_AGENT) == "stopping"
    ledger.settlements.settle(job_id, ended_at=started + 10, outcome=outcome, scope=SESSION)
    return job_id


def test_each_trial_reads_the_words_of_its_own_ending(ledger: Ledger) -> None:
    """A completed trial carries no reason (its row keeps the admission's words); a stopped one
    its stopper's, as its row; a failed one what its run said; a waiting one why it waits."""
    ledger.config.set_budget(BudgetRule(SESSION, hourly_cap_cents=360))  # one job at a time
    run_id = str(uuid.uuid4())
    store = ledger.sweeps
    store.open_sweep(run_id, SESSION, "train", "loss", "min", [{"lr": lr} for lr in (1, 2, 3, 4)])
    _ran(ledger, run_id, 0, "completed")
    store.end_trial(run_id, 0, "Completed", "")
    _ran(ledger, run_id, 1, "cancelled", stopped=True)
    stopped_run = f"cancelled: {STOPPED_BY_AGENT} (exit code -15); cost $0.01"
    store.end_trial(run_id, 1, "Cancelled", stopped_run)
    _ran(ledger, run_id, 2, "failed")
    store.end_trial(run_id, 2, "Failed", "failed: exit code 1; cost $0.01")
    ledger.queue.request(new_job(SESSION, name="elsewhere"))  # holds the cap
    ledger.queue.request(new_job(SESSION, name="train/0003", flow_run_id=run_id))
    assert [j["reason"] for j in ledger.views.jobs(SESSION)][0]  # the admission's own words

    view = Door(ledger, _Prefect(run_id)).sweep(CALLER, run_id)
    reasons = [t["reason"] for t in view["trials"]]
    assert reasons[:3] == ["", STOPPED_BY_AGENT, "failed: exit code 1; cost $0.01"], reasons
    assert "hourly cap" in reasons[3], reasons  # why it waits
    assert STOPPED_BY_AGENT in stopped_run  # the run's message names the stop as the view does
    assert [t["outcome"] for t in view["trials"][:3]] == ["completed", "cancelled", "failed"]


def test_a_trials_times_are_iso_8601_as_the_ledgers_json(ledger: Ledger) -> None:
    ledger.config.set_budget(BudgetRule(SESSION, hourly_cap_cents=720))
    run_id = str(uuid.uuid4())
    ledger.sweeps.open_sweep(run_id, SESSION, "train", "loss", "min", [{"lr": 1}])
    job_id = _ran(ledger, run_id, 0, "completed")
    [trial] = Door(ledger, _Prefect(run_id)).sweep(CALLER, run_id)["trials"]
    row = ledger.views.job(job_id)
    for name in ("requested_at", "started_at", "ended_at"):
        assert datetime.fromisoformat(trial[name]).timestamp() == pytest.approx(row[name]), name
        assert trial[name].endswith("+00:00"), trial[name]


def test_the_session_status_names_its_figures_as_status_json_does(ledger: Ledger) -> None:
    """The gateway's budget is `status --json`'s row for the session, word for word and figure
    for figure (times in ISO 8601), and when its period ends; one name for each figure."""
    ledger.config.set_budget(
        BudgetRule(SESSION, hourly_cap_cents=720, period_budget_micro=5 * 10**6, period="day")
    )
    job_id, _ = ledger.queue.request(new_job(SESSION, name="train/0000"))
    ledger.settlements.mark_started(job_id, time.time())
    env = {"PREFECT_GPU_BUDGET_LEDGER_URL": ledger.url, "PATH": "/usr/bin:/bin"}
    shown = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "status", SESSION, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    [cli] = [row for row in json.loads(shown.stdout) if row["scope"] == SESSION]
    status = Door(ledger).status(CALLER)
    budget = status["budget"]
    assert {name: budget.get(name) for name in cli} == cli
    assert set(budget) - set(cli) == {"period_end"}
    assert budget["running_rate_usd_per_hour"] == 3.6 and budget["running"] == 1
    start, end = (datetime.fromisoformat(budget[k]) for k in ("period_start", "period_end"))
    assert (end - start).total_seconds() == 86400
    [job] = status["jobs"]
    assert datetime.fromisoformat(job["started_at"]).timestamp() > 0 and job["reason"] == ""


def test_a_trial_placed_again_shows_every_place_and_costs_them_all() -> None:
    """A trial's job taken back and placed again has a ledger row per place: the view shows
    the latest place, the cost of all of them, and each place in order."""
    first = {
        "id": "a" * 36,
        "name": "s/0000",
        "instance_type": "gcp:a2-highgpu-1g",
        "provisioning": "spot",
        "state": "settled",
        "outcome": "interrupted",
        "actual_micro": 120_000,
        "requested_at": 1.0,
        "choice": None,
    }
    again = {
        **first,
        "id": "b" * 36,
        "provisioning": "on-demand",
        "outcome": "completed",
        "actual_micro": 3_400_000,
        "requested_at": 2.0,
    }
    view = trial_view(0, None, trial_job([first, again]))
    assert view["job_id"] == "b" * 36 and view["outcome"] == "completed"
    assert view["cost_usd"] == 3.52
    assert view["placements"] == (
        "gcp:a2-highgpu-1g spot: interrupted, $0.12; gcp:a2-highgpu-1g on-demand: completed, $3.40"
    )
    alone = trial_view(0, None, trial_job([again]))
    assert alone["placements"] is None and alone["cost_usd"] == 3.4

"""A sweep whose worker was lost, as the door tells it (`agents.lost`): the rule and its line,
then the door's answer over a real ledger (SQLite and PostgreSQL) and a Prefect run in each
final state, read through a stand-in for the Prefect client."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from prefect.states import Cancelled, Completed, Crashed, Failed, Running

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.agents.callers import Caller
from prefect_gpu_budget.agents.door import Door
from prefect_gpu_budget.agents.lost import lost_message, worker_lost
from tests.support.jobs import new_job

SESSION = "acme/agents/agent-1"
PARAMS = [{"lr": lr} for lr in (0.1, 0.2, 0.3, 0.4, 0.5)]


def _trial(outcome: str | None, state: str | None, cost_usd: float = 0.0) -> dict[str, Any]:
    return {
        "outcome": outcome,
        "state": state,
        "job_id": None if state is None else str(uuid.uuid4()),
        "cost_usd": cost_usd,
    }


def test_a_sweep_is_lost_when_its_run_ended_before_the_sweep_recorded_its_end():
    opened, ended = {"ended_at": None}, {"ended_at": 1000.0}
    assert worker_lost(True, opened)
    assert not worker_lost(False, opened)  # still running: its flow may yet end it
    assert not worker_lost(True, ended)
    assert not worker_lost(True, None)  # never opened: no trial can have started


def test_the_lost_line_counts_each_trial_once_from_the_ledger():
    trials = [
        _trial("completed", "settled", 0.012),
        _trial("completed", "settled", 0.003),
        _trial("reconciled", "settled", 0.0021),
        _trial(None, "cancelled"),
        _trial(None, "running"),
        _trial(None, None),
    ]
    assert lost_message(trials, 7) == (
        "worker lost: 2 of 7 trials finished (billed $0.015); 2 stopped, failed or cancelled "
        "(billed $0.0021); 1 not settled yet (reconcile settles what ran); 2 never started; "
        "starting it again re-runs all 7"
    )
    assert lost_message([_trial("completed", "settled", 1.5)], 1) == (
        "worker lost: 1 of 1 trials finished (billed $1.50); starting it again re-runs all 1"
    )


class _Prefect:
    """What the door reads of Prefect: one flow run of `SESSION`, in the state a test sets."""

    def __init__(self, run_id: str) -> None:
        self.run = SimpleNamespace(
            id=uuid.UUID(run_id), name="brave-otter", parameters={"session": SESSION}, state=None
        )

    def read_flow_run(self, flow_run_id: uuid.UUID) -> Any:
        return self.run


def _job(ledger: Ledger, run_id: str, trial: int) -> str:
    job_id, decision = ledger.queue.request(
        new_job(SESSION, name=f"train/{trial:04d}", flow_run_id=run_id)
    )
    assert decision.verdict == "admit", decision
    return job_id


def _ran(ledger: Ledger, job_id: str, seconds: float, outcome: str) -> None:
    started = time.time() - seconds
    assert ledger.settlements.mark_started(job_id, started)
    ledger.settlements.settle(job_id, ended_at=started + seconds, outcome=outcome, scope=SESSION)


@pytest.fixture
def crashed(ledger: Ledger) -> tuple[Door, _Prefect, str]:
    """A five-trial sweep whose worker died in its fourth trial, after reconcile: trials 0-2
    finished and billed (trial 2 just before the crash: its end never recorded), trial 3
    settled by reconcile, trial 4 never asked for. Its run is set by each test."""
    ledger.config.set_budget(BudgetRule(SESSION, hourly_cap_cents=3600))
    run_id = str(uuid.uuid4())
    store = ledger.sweeps
    store.open_sweep(run_id, SESSION, "train", "loss", "min", PARAMS)
    for trial in range(3):
        _ran(ledger, _job(ledger, run_id, trial), 10.0, "completed")
        store.add_records(run_id, trial, [{"step": 0, "loss": 1.0 - trial / 10}])
        if trial < 2:
            store.end_trial(run_id, trial, "Completed", "")
    _ran(ledger, _job(ledger, run_id, 3), 5.0, "reconciled")
    prefect = _Prefect(run_id)
    return Door(ledger, prefect), prefect, run_id


def test_a_crashed_sweep_reports_its_finished_trials_and_the_lost_worker(crashed):
    door, prefect, run_id = crashed
    prefect.run.state = Crashed(message="Process exited with status code: -9.")
    view = door.sweep(Caller(SESSION, "g"), run_id)
    assert view["state"] == "Crashed" and view["worker_lost"] is True
    trials = view["trials"]
    assert [t["outcome"] for t in trials] == ["completed"] * 3 + ["reconciled", None]
    assert [t["state"] for t in trials] == ["settled"] * 4 + ["not_started"]
    assert [t["metrics"] for t in trials[:3]] == [{"loss": 1.0}, {"loss": 0.9}, {"loss": 0.8}]
    assert all(t["cost_usd"] == 0.01 for t in trials[:3])  # 10 s at $3.60 an hour
    assert trials[3]["cost_usd"] == 0.005
    assert view["best"] == {"trial": 2, "metric": "loss", "goal": "min", "value": 0.8}
    assert view["spent_usd"] == 0.035
    assert view["message"] == (
        "worker lost: 3 of 5 trials finished (billed $0.03); 1 stopped, failed or cancelled "
        "(billed $0.005); 1 never started; starting it again re-runs all 5"
    )
    rows = door.results(Caller(SESSION, "g"), run_id)  # nothing published: the ledger's table
    assert [(r["lr"], r.get("loss"), r["cost_usd"]) for r in rows[:3]] == [
        (0.1, 1.0, 0.01),
        (0.2, 0.9, 0.01),
        (0.3, 0.8, 0.01),
    ]


@pytest.mark.parametrize("state", [Failed, Cancelled])
def test_any_run_that_ended_without_the_sweeps_end_lost_its_worker(crashed, state):
    door, prefect, run_id = crashed
    prefect.run.state = state(message="the process was stopped")
    view = door.sweep(Caller(SESSION, "g"), run_id)
    assert view["worker_lost"] is True
    assert view["message"].startswith("worker lost: 3 of 5 trials finished (billed $0.03)")


def test_a_running_or_finished_sweep_has_not_lost_its_worker(crashed):
    door, prefect, run_id = crashed
    prefect.run.state = Running()
    view = door.sweep(Caller(SESSION, "g"), run_id)
    assert view["worker_lost"] is False and view["message"] == ""
    assert view["trials"][4]["state"] == "pending"  # it may still start
    door.ledger.sweeps.end_sweep(run_id, "3 of 5 trials completed; best loss 0.8")
    prefect.run.state = Completed()
    view = door.sweep(Caller(SESSION, "g"), run_id)
    assert view["worker_lost"] is False
    assert view["message"] == "3 of 5 trials completed; best loss 0.8"
    assert view["trials"][4]["state"] == "not_started"

"""Preemption reaches a `gpu-budget-process` run: in a pool with team quotas, team B's flow run
that borrowed team A's idle node, run by a real `prefect worker start` against the session's
Prefect server with a PostgreSQL ledger, is stopped as its max_runtime stop does (SIGTERM to
its whole tree, kill grace, SIGKILL) when A's job within A's quota arrives; it is settled
`preempted` for what it ran, its flow run ends `Preempted` saying who took what back (or is
scheduled again and runs once A's job is done, with `requeue`), and A's job is admitted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.launchers.local import marked_processes
from prefect_gpu_budget.pricing.catalog import set_local_price
from tests.conftest import PG_URL
from tests.support.jobs import new_job
from tests.support.postgres import fresh_database
from tests.support.prefect_server import stop_groups, wait_for

HERE = Path(__file__).parent
POOL = "gpu-teams"
MACHINE = "local:h100x8"
DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "borrower": {"scope": "acme/b/s", "requeue": False},
    "borrower-again": {"scope": "acme/b/s"},  # requeue: the default
    "lender": {"scope": "acme/a/s"},
}


@pytest.fixture(scope="module")
def house(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A gated process pool whose deployments run `MACHINE` in team B's or A's scope, a
    PostgreSQL ledger whose capacity pool has one node per team (B may borrow A's), and a
    worker polling the pool. Each deployment marks its processes (`TEST_TREE`)."""
    tmp = tmp_path_factory.mktemp("preempted-worker")
    prices = set_local_price("h100x8", "8", gpus=8, path=tmp / "prices.csv")
    marks = {name: uuid.uuid4().hex for name in DEPLOYMENTS}
    with fresh_database(PG_URL) as url:
        ledger = Ledger(url)
        ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
        pool = Pool("acme", "lab-a", 2, (8, 192, 2048), (MACHINE,), "H100")
        ledger.config.set_pool(
            pool,
            [
                TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
                TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
            ],
        )
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "PREFECT_GPU_BUDGET_LEDGER_URL": url,
            "PREFECT_GPU_BUDGET_PRICES": str(prices),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",  # the worker's log says what it did, if a test fails
        }
        created = subprocess.run(
            [sys.executable, "-m", "prefect", "work-pool", "create", POOL]
            + ["--type", "gpu-budget-process"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert created.returncode == 0, created.stdout + created.stderr
        target = flow.from_source(source=str(HERE), entrypoint="gated_target.py:target")
        for name, more in DEPLOYMENTS.items():
            target.deploy(
                name=name,
                work_pool_name=POOL,
                job_variables={
                    "instance_type": MACHINE,
                    "max_runtime": "5m",
                    **more,
                    "env": {"TEST_TREE": marks[name]},
                },
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
            )
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
            env=env,
            stdout=(tmp / "worker.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield {"ledger": ledger, "marks": marks, "tmp": tmp, "log": tmp / "worker.log"}
        finally:
            stop_groups([worker])
            ledger.db.dispose()


def _rows(ledger: Ledger, run: Any, state: str | None = None) -> list[dict]:
    rows = [r for r in ledger.views.jobs() if r["flow_run_id"] == str(run.id)]
    return sorted(
        (r for r in rows if state is None or r["state"] == state),
        key=lambda r: r["requested_at"],
    )


def _final(run: Any, timeout: float = 180, settled: bool = False) -> Any:
    """The run's final state; `settled`: the one set once its job is settled (a stopped run
    shows why as soon as it is stopped, and what it cost once it is settled)."""

    def final() -> Any:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run.id).state
        if not state or not state.is_final():
            return None
        return state if not settled or "cost $" in (state.message or "") else None

    return wait_for(final, timeout, "the flow run to end")


def _states(run: Any) -> list[str]:
    """The names of the run's states, oldest first."""
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(run.id)
    return [s.name for s in sorted(states, key=lambda s: s.timestamp)]


def _explain(house: dict[str, Any], run: Any) -> str:
    """What a failed test shows: the run's states, its ledger rows, the worker's last words."""
    rows = [(r["state"], r["outcome"]) for r in _rows(house["ledger"], run)]
    return f"states {_states(run)}; rows {rows}; log:\n{house['log'].read_text()[-4000:]}"


def _own_node(ledger: Ledger) -> str:
    """Team B's own node, taken by a job held elsewhere: B's next job borrows A's."""
    job_id, decision = ledger.queue.request(
        new_job(
            "acme/b/s",
            name="b-own",
            instance_type=MACHINE,
            rate_micro_per_hour=8_000_000,
            rate_cents=800,
            node_gpus=8,
            max_runtime_s=600.0,
        )
    )
    assert decision.verdict == "admit", decision.reason
    return job_id


def _borrow_then_reclaim(house: dict[str, Any], deployment: str, **params: Any) -> tuple:
    """B's run borrows A's node and runs; then A's job arrives within A's quota. Returns
    (B's run, A's run, the job holding B's own node)."""
    ledger = house["ledger"]
    own = _own_node(ledger)
    borrower = run_deployment(
        f"gated-target/{deployment}", parameters={"seconds": 120, **params}, timeout=0
    )
    wait_for(
        lambda: (rows := _rows(ledger, borrower)) and rows[0]["started_at"],
        180,
        "B's run to start on the borrowed node",
    )
    lender = run_deployment("gated-target/lender", parameters={"seconds": 1}, timeout=0)
    return borrower, lender, own


def _give_back(ledger: Ledger, job_id: str) -> None:
    ledger.settlements.settle(job_id, ended_at=time.time(), outcome="completed", scope="acme/b/s")


@pytest.mark.timeout(400)
def test_a_borrowing_worker_run_is_stopped_settled_and_ends_preempted(house):
    ledger, mark = house["ledger"], house["marks"]["borrower"]
    borrower, lender, own = _borrow_then_reclaim(house, "borrower")
    try:
        state = _final(borrower, settled=True)
        assert state.name == "Preempted", (state, _explain(house, borrower))
        [row] = _rows(ledger, borrower, "settled")
        [mine] = wait_for(lambda: _rows(ledger, lender, "settled"), 180, "A's run to settle")
    finally:
        _give_back(ledger, own)
    assert row["outcome"] == "preempted" and row["preempt_at"] is not None, row
    assert 0 < row["actual_micro"] < row["reserved_micro"], row  # paid for what ran
    assert row["billed_seconds"] < 120, row  # stopped, not run out
    assert f"preempted for job {mine['id'][:8]}" in state.message
    assert "in pool lab-a was taken back" in state.message and "cost $" in state.message
    assert mine["outcome"] == "completed" and mine["admitted_at"] >= row["ended_at"]
    assert _final(lender).name == "Completed"
    assert marked_processes("TEST_TREE", mark) == []  # its whole tree is gone


@pytest.mark.timeout(500)
def test_a_preempted_worker_run_that_asks_for_it_is_queued_again(house):
    ledger = house["ledger"]
    once = house["tmp"] / f"once-{uuid.uuid4().hex}"
    borrower, lender, own = _borrow_then_reclaim(house, "borrower-again", once=str(once))
    try:
        try:
            first, again = wait_for(
                lambda: len(rows := _rows(ledger, borrower, "settled")) == 2 and rows,
                300,
                "both of B's admissions to settle",
            )
        except AssertionError as late:
            raise AssertionError(f"{late}: {_explain(house, borrower)}") from None
        state = _final(borrower)
        [mine] = _rows(ledger, lender, "settled")
    finally:
        _give_back(ledger, own)
    assert state.name == "Completed", (state, _explain(house, borrower))
    assert first["outcome"] == "preempted" and again["outcome"] == "completed"
    assert again["admitted_at"] >= mine["ended_at"]  # A's job first, then B's again
    states = _states(borrower)  # shown preempted, scheduled again, gated, run again
    assert states.index("Preempted") < states.index("AwaitingBudget", states.index("Preempted"))


@pytest.mark.timeout(300)
def test_a_worker_run_its_owner_stops_is_stopped_the_same_way_and_ends_cancelled(house):
    """`ledger.settlements.ask_stop` (an agent's cancel of its running trial) reaches a worker
    run as a preemption does: its tree is stopped, it is settled `cancelled` for what ran, and its flow
    run ends Cancelled saying why; no pool is needed."""
    ledger, mark = house["ledger"], house["marks"]["lender"]
    run = run_deployment("gated-target/lender", parameters={"seconds": 120}, timeout=0)
    started = wait_for(
        lambda: (rows := _rows(ledger, run)) and rows[0]["started_at"] and rows[0],
        180,
        "the run to start",
    )
    assert ledger.settlements.ask_stop(started["id"], "stopped from a test")
    state = _final(run, settled=True)
    [row] = _rows(ledger, run, "settled")
    assert state.is_cancelled(), (state, _explain(house, run))
    assert state.message.startswith("stopped from a test; cost ")
    assert row["outcome"] == "cancelled" and 0 < row["actual_micro"] < row["reserved_micro"]
    assert marked_processes("TEST_TREE", mark) == []

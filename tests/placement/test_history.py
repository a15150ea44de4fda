"""Each offering's history read from the ledger (placement/history.py), on a SQLite file and on
PostgreSQL: the waits from admission to start (the latest few, oldest first), the run hours per
node, the interruptions (preempted), and what the final bills charged over the gate's rate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.ledger.tables import bill_jobs
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.placement import history
from prefect_gpu_budget.placement.choice import History
from prefect_gpu_budget.placement.history import offering_histories
from tests.conftest import PG_URL
from tests.support.jobs import new_job
from tests.support.postgres import fresh_database

H100_8 = "gcp:a3-highgpu-8g"
T0 = 1_700_000_000.0
HOUR = 3600.0
RATE = 10_000_000  # $10 an hour, the job's whole rate


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
        yield led
        led.db.dispose()
        return
    with fresh_database(PG_URL) as url:
        led = Ledger(url)
        try:
            yield led
        finally:
            led.db.dispose()


def _job(ledger: Ledger, provisioning: str, admitted: float, **kw) -> str:
    if not ledger.config.budgets("lab"):
        ledger.config.set_budget(BudgetRule("lab", period_budget_micro=10**12), now=T0 - 10)
    asked = new_job(
        "lab/t",
        instance_type=kw.pop("instance_type", H100_8),
        provisioning=provisioning,
        rate_micro_per_hour=RATE,
        rate_cents=1000,
        max_runtime_s=10 * HOUR,
        nodes=kw.pop("nodes", 1),
    )
    job_id, decision = ledger.queue.request(asked, now=admitted)
    assert decision.verdict == "admit", decision
    return job_id


def _ran(
    ledger: Ledger,
    provisioning: str,
    admitted: float,
    wait: float,
    ran: float | None,
    outcome: str = "completed",
    **kw,
) -> str:
    """A job admitted at `admitted`, started `wait` seconds later, ended `ran` seconds after
    that (None: still running) as `outcome`."""
    billed = kw.pop("billed_seconds", None)
    job_id = _job(ledger, provisioning, admitted, **kw)
    assert ledger.settlements.mark_started(job_id, admitted + wait)
    if ran is not None:
        end = admitted + wait + ran
        settled = ledger.settlements.settle(
            job_id, ended_at=end, outcome=outcome, billed_seconds=billed, scope="lab/t", now=end
        )
        assert settled is not None
    return job_id


def _bill(ledger: Ledger, job_id: str, billed_micro: int, final: bool) -> None:
    with ledger.db.tx() as conn:
        conn.execute(
            bill_jobs.insert().values(
                job_id=job_id,
                org="lab",
                scope="lab/t",
                billed_micro=billed_micro,
                final=final,
                updated_at=T0,
            )
        )


def test_each_figure_of_each_offering(ledger: Ledger) -> None:
    # spot: three starts (waited 300, 60, 120 s), two of them taken back, one still running
    _ran(ledger, "spot", T0, 300, 2 * HOUR)  # completed after 2 h
    _ran(ledger, "spot", T0 + 10, 60, 0.5 * HOUR, "preempted")
    _ran(ledger, "spot", T0 + 20, 120, None)  # running: a wait, no run yet
    _ran(ledger, "spot", T0 + 30, 30, 0.25 * HOUR, "failed", billed_seconds=600.0)
    _ran(ledger, "spot", T0 + 40, 45, HOUR, "preempted")
    # flex-start on two nodes: billed at half the gate's rate by a final bill
    flex = _ran(ledger, "flex-start", T0, 600, HOUR, nodes=2)
    _bill(ledger, flex, RATE // 2, final=True)
    provisional = _ran(ledger, "flex-start", T0 + 5, 900, HOUR)
    _bill(ledger, provisional, 50 * RATE, final=False)  # not final: not counted
    # on demand: admitted, never started: no history yet
    _job(ledger, "on-demand", T0)

    found = offering_histories(ledger)

    assert set(found) == {(H100_8, "spot", ""), (H100_8, "flex-start", "")}
    spot = found[H100_8, "spot", ""]
    assert spot.waits_s == (30.0, 60.0, 45.0, 120.0, 300.0)  # by start, oldest first
    # the hours each held its machine, whatever the launcher billed of them (600 s of 15 min)
    assert spot.run_hours == pytest.approx(2 + 0.5 + 0.25 + 1)
    assert spot.interruptions == 2  # preempted twice; `failed` is the job's own end
    # no final bill: what the ledger settled (the launcher billed 600 s of one job's 15 min),
    # over the rate for the time they ran
    assert spot.billed_over_reserved == pytest.approx((3.5 * HOUR + 600) / (3.75 * HOUR))
    assert found[H100_8, "flex-start", ""] == History(
        waits_s=(600.0, 900.0),
        run_hours=pytest.approx(2.0),  # per node: the two-node job counts its hour once
        interruptions=0,
        billed_over_reserved=pytest.approx(0.5),
    )


def test_the_latest_waits_only_oldest_first_and_the_window(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "MOST_WAITS", 3)
    for i, wait in enumerate([10.0, 20.0, 30.0, 40.0, 50.0]):
        _ran(ledger, "on-demand", T0 + i * HOUR, wait, 60.0)
    _ran(ledger, "spot", T0 + 4 * HOUR, 5.0, 60.0)

    found = offering_histories(ledger)
    assert found[H100_8, "on-demand", ""].waits_s == (30.0, 40.0, 50.0)
    assert found[H100_8, "on-demand", ""].run_hours == pytest.approx(5 * 60 / HOUR)
    assert found[H100_8, "spot", ""].waits_s == (5.0,)  # each key has its own latest

    # only the jobs asked for in the last 2.5 hours before `now`
    recent = offering_histories(ledger, since_s=2.5 * HOUR, now=T0 + 4 * HOUR + 1)
    assert recent[H100_8, "on-demand", ""].waits_s == (30.0, 40.0, 50.0)
    assert recent[H100_8, "on-demand", ""].run_hours == pytest.approx(3 * 60 / HOUR)
    assert offering_histories(ledger, since_s=60.0, now=T0 + 10 * HOUR) == {}

    # only the ledger's newest jobs, however long it grows
    monkeypatch.setattr(history, "RECENT_JOBS", 2)
    newest = offering_histories(ledger)
    assert newest[H100_8, "on-demand", ""].waits_s == (50.0,)
    assert newest[H100_8, "spot", ""].waits_s == (5.0,)


def test_three_queries_aggregated_in_sql(ledger: Ledger) -> None:
    """One query per figure (the run hours and the interruptions share one): the waits limited
    per key and the sums taken in the database, not the ledger read into memory."""
    job = _ran(ledger, "spot", T0, 30.0, HOUR, "preempted")
    _bill(ledger, job, RATE // 4, final=True)
    statements: list[str] = []

    def seen(conn, cursor, statement, *args):
        statements.append(statement)

    sa.event.listen(ledger.db.engine, "before_cursor_execute", seen)
    try:
        found = offering_histories(ledger)
    finally:
        sa.event.remove(ledger.db.engine, "before_cursor_execute", seen)
    assert found[H100_8, "spot", ""] == History((30.0,), pytest.approx(1.0), 1, pytest.approx(0.25))
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 3, selects
    assert "row_number() OVER" in selects[0] and "sum(" in selects[1].lower()
    assert "GROUP BY" in selects[1] and "GROUP BY" in selects[2]
    assert all("LIMIT" in s for s in selects), selects  # a bounded part of the ledger each

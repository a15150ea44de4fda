"""The ledger's read views (admission/ledger/views.py): scopes matched exactly, a job admitted but
not started told from a running one, the newest jobs chosen in SQL, and why a job must stop."""

from __future__ import annotations

import time

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.support.jobs import new_job


def _job(scope: str) -> NewJob:
    return new_job(scope)


def test_underscore_in_a_scope_is_not_a_wildcard(ledger):
    ledger.config.set_budget(BudgetRule("axb", hourly_cap_cents=10_000, period_budget_micro=10**9))
    job_id, decision = ledger.queue.request(_job("axb/t"))
    ledger.settlements.mark_started(job_id, time.time() - 100)
    ledger.settlements.settle(job_id, ended_at=time.time(), outcome="completed", scope="axb/t")
    ledger.config.set_budget(BudgetRule("a_b", hourly_cap_cents=10_000, period_budget_micro=10**9))
    assert [s["settled_micro"] for s in ledger.views.status("a_b")] == [0]
    assert [len(ledger.views.jobs(scope)) for scope in ("a_b", "axb")] == [0, 1]


def test_status_tells_a_job_admitted_but_not_started_from_a_running_one(ledger):
    """As squeue tells CONFIGURING from RUNNING: an admitted job a cloud is still finding
    capacity for is `admitted`, not `running`; both hold their rate in the cap."""
    ledger.config.set_budget(BudgetRule("st2", hourly_cap_cents=10_000))
    started, _ = ledger.queue.request(_job("st2/t/a"))
    ledger.queue.request(_job("st2/t/b"))
    ledger.settlements.mark_started(started, time.time())
    (row,) = ledger.views.status("st2")
    assert (row["running"], row["admitted"], row["queued"]) == (1, 1, 0)
    assert row["running_rate_micro"] == 2 * _job("st2/t/a").rate_micro_per_hour


def test_the_newest_jobs_are_chosen_in_sql(ledger):
    ledger.config.set_budget(BudgetRule("nw", period_budget_micro=10**9))
    ids = [ledger.queue.request(_job("nw/a"), now=1_000_000.0 + i)[0] for i in range(5)]
    ledger.queue.request(new_job("nw/a", flow_run_id="run-1"), now=1_000_010.0)
    statements: list[str] = []

    def seen(conn, cursor, statement, *args):
        statements.append(statement)

    sa.event.listen(ledger.db.engine, "before_cursor_execute", seen)
    try:
        newest = ledger.views.jobs("nw", limit=3)
        of_run = ledger.views.jobs("nw", flow_run_id="run-1")
    finally:
        sa.event.remove(ledger.db.engine, "before_cursor_execute", seen)
    assert [j["id"] for j in newest[:2]] == ids[3:] and newest[2]["flow_run_id"] == "run-1"
    assert [j["flow_run_id"] for j in of_run] == ["run-1"]
    selects = [s for s in statements if "FROM gpu_jobs" in s]
    assert "LIMIT" in selects[0] and "flow_run_id =" in selects[1], selects


def test_an_owners_stop_wins_over_a_preemption(ledger):
    """A job both preempted and stopped by its owner is named stopped: a preempted job may be
    queued again, one its owner stopped must not be."""
    from prefect_gpu_budget.admission.ledger.tables import jobs

    ledger.config.set_budget(BudgetRule("both", hourly_cap_cents=3600))
    job_id, _ = ledger.queue.request(new_job("both/t"))
    with ledger.db.tx() as conn:
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(preempt_at=time.time()))
    assert ledger.views.stop_asked(job_id) == "preempted"
    assert ledger.settlements.ask_stop(job_id, "stopped by its owner")
    assert ledger.views.stop_asked(job_id) == "stopped"


def test_a_page_before_a_job_is_the_next_older_page(ledger):
    """`before` pages by (requested_at, id): two jobs asked at the same instant are split by
    their ids, none is shown twice or left out; an unknown job has no page."""
    ledger.config.set_budget(BudgetRule("pg", period_budget_micro=10**9))
    at = [1_000_000.0, 1_000_001.0, 1_000_002.0, 1_000_002.0, 1_000_003.0]
    for i, now in enumerate(at):
        ledger.queue.request(_job(f"pg/t/s{i % 2}"), now=now)
    whole = [j["id"] for j in ledger.views.jobs("pg", limit=10)]
    pages, before = [], None
    while page := ledger.views.jobs("pg", limit=2, before=before):
        pages.append([j["id"] for j in page])
        before = page[0]["id"]
    assert [i for page in reversed(pages) for i in page] == whole and len(whole) == 5
    assert [len(p) for p in pages] == [2, 2, 1]
    assert ledger.views.jobs(limit=2, before="no-such-job") == []
    session = ledger.views.jobs("pg/t/s0", limit=5, before=whole[-1])
    assert {j["scope"] for j in session} == {"pg/t/s0"} and len(session) == 2


def test_since_leaves_out_the_jobs_that_ended_before(ledger):
    ledger.config.set_budget(BudgetRule("sn", period_budget_micro=10**9))
    now = time.time()
    old, _ = ledger.queue.request(_job("sn/t/a"), now=now - 3000)
    ledger.settlements.mark_started(old, now - 2990)
    ledger.settlements.settle(old, ended_at=now - 2000, outcome="completed", scope="sn/t/a")
    late, _ = ledger.queue.request(_job("sn/t/a"), now=now - 2500)
    ledger.settlements.mark_started(late, now - 2490)
    ledger.settlements.settle(late, ended_at=now - 500, outcome="completed", scope="sn/t/a")
    running, _ = ledger.queue.request(_job("sn/t/b"), now=now - 100)
    ledger.settlements.mark_started(running, now - 90)
    assert [j["id"] for j in ledger.views.jobs("sn", since=now - 1000)] == [late, running]
    assert len(ledger.views.jobs("sn")) == 3


def test_a_teams_page_is_its_own_jobs_in_request_order(ledger):
    """A team's jobs are read by their team (`ix_gpu_jobs_team_requested`): its sessions' jobs
    and its own, never another team whose name starts the same, newest first by `before`."""
    ledger.config.set_budget(BudgetRule("tp", period_budget_micro=10**9))
    scopes = ["tp/t/s0", "tp/t2/s0", "tp/t", "tp/t_/s1", "tp/t/s1", "tp", "tp/t/s0"]
    ids = [ledger.queue.request(_job(s), now=1_000_000.0 + i)[0] for i, s in enumerate(scopes)]
    mine = [i for i, s in zip(ids, scopes, strict=True) if s == "tp/t" or s.startswith("tp/t/")]
    assert [j["id"] for j in ledger.views.jobs("tp/t")] == mine
    assert [j["id"] for j in ledger.views.jobs("tp/t", limit=2)] == mine[-2:]
    assert [j["id"] for j in ledger.views.jobs("tp/t", limit=2, before=mine[-2])] == mine[:2]
    assert [j["id"] for j in ledger.views.jobs("tp/t2")] == [ids[1]]
    assert len(ledger.views.jobs("tp")) == len(scopes)

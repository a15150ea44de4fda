"""Waiting costs events, not waiters x time: a freed slot wakes the job it admitted, a process
of waiting jobs holds two ledger connections, a lost notice is caught by the recheck, and a
waiter's row stays stamped while it only waits (admission/watcher.py)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission import ledger as ledger_module
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.ledger import engine as ledger_engine
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.watcher import Ticket, watcher_for
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.conftest import PG_URL, _fresh_pg
from tests.support.postgres import fresh_database

JOB = GpuJob(instance_type="local:box", max_runtime="1m")  # $3.60/h: a 360-cent cap fits one


def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _counting(ledger: Ledger) -> list[str]:
    """Count the decisions waiters make for themselves (each one a transaction)."""
    calls: list[str] = []
    try_admit = ledger.queue.try_admit

    def counted(job_id, scope, now=None):
        calls.append(job_id)
        return try_admit(job_id, scope, now)

    ledger.queue.try_admit = counted  # type: ignore[method-assign]
    return calls


def _handed_admissions(ledger: Ledger) -> list[str]:
    """Count the admissions a watcher reads for the jobs it wakes (one read for them all)."""
    handed: list[str] = []
    decided = ledger.queue.decided

    def counted(job_ids):
        out = decided(job_ids)
        handed.extend(i for i, (d, _) in out.items() if d.verdict == "admit")
        return out

    ledger.queue.decided = counted  # type: ignore[method-assign]
    return handed


def _queue_up(gate: Gate, ledger: Ledger, scope: str, n: int, hold_s: float) -> list[str]:
    """`n` jobs racing for a cap that fits one; each holds it `hold_s`. Their admission order."""
    order: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            admission = gate.admit(JOB, scope)
            order.append(admission.job_id)
            time.sleep(hold_s)
            gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return order


def test_a_freed_slot_wakes_the_job_it_admitted_not_every_waiter(ledger, prices):
    """Before, every change of the org woke every waiter into a decision: n jobs through a
    one-job cap cost about n^2 / 2 decisions. Now a waiter decides when woken for its own
    row: when it is admitted, or when what blocks it changes (it became the queue's head)."""
    ledger.config.set_budget(BudgetRule("wake", hourly_cap_cents=360))
    gate = Gate(ledger, catalog=Catalog.load(prices))
    calls, handed = _counting(ledger), _handed_admissions(ledger)
    n = 16
    order = _queue_up(gate, ledger, "wake/t", n, hold_s=0.05)
    assert len(order) == len(set(order)) == n
    rows = ledger.views.jobs("wake")
    assert len(rows) == n and {r["state"] for r in rows} == {"settled"}
    assert len(calls) <= 4 * n, (len(calls), n)  # polling waiters made ~n^2/2 = 128 and more
    # an admission made by another's transaction is read for its job by the watcher, most
    # often (a slow wake past FRESH_ADMISSION_S decides itself instead, and stamps the row)
    assert len(set(handed)) >= n // 2, (len(set(handed)), n)


def test_a_process_whose_jobs_only_wait_holds_two_ledger_connections(prices, monkeypatch):
    """Counted once all 30 jobs are asleep waiting (getting in line reads budgets too), while
    the one that holds the cap is another process's (its own ledger, no heartbeat or stop poll
    in the window): a running job's heartbeat is not waiting."""
    asleep, lock, wait = [0], threading.Lock(), Ticket.wait

    def counted(ticket: Ticket, timeout: float) -> bool:
        with lock:
            asleep[0] += 1
        try:
            return wait(ticket, timeout)
        finally:
            with lock:
                asleep[0] -= 1

    monkeypatch.setattr(Ticket, "wait", counted)
    with fresh_database(PG_URL) as own:  # no other test's connections in the count
        _count_connections_while_waiting(own, prices, asleep)


def _count_connections_while_waiting(url: str, prices, asleep: list[int]) -> None:
    ledger = Ledger(url)
    holder = Ledger(url)
    try:
        ledger.config.set_budget(BudgetRule("conn", hourly_cap_cents=360))
        gate = Gate(ledger, catalog=Catalog.load(prices))
        # another process: no heartbeat and no stop poll of its running job in the window
        holding = Gate(holder, catalog=Catalog.load(prices), heartbeat_s=3600, preempt_poll_s=3600)
        held = holding.admit(JOB, "conn/t")
        # its watcher (it listened in case the job had to wait) lingers, then closes its own;
        # then the holder's pooled connections close (settling reopens one)
        _until(lambda: watcher_for(holder)._thread is None, 30, "the holder's watcher to end")
        holder.db.dispose()
        waiters = [
            threading.Thread(
                target=lambda: gate.holding.settle(
                    gate.admit(JOB, "conn/t"), ended_at=time.time(), outcome="completed"
                ),
                daemon=True,
            )
            for _ in range(30)
        ]
        for thread in waiters:
            thread.start()
        _until(lambda: asleep[0] == 30, 60, "30 jobs asleep in their wait")
        observer = sa.create_engine(ledger_module.normalise_url(ledger.url), poolclass=sa.NullPool)
        peak = 0
        deadline = time.monotonic() + 2.5 * gate.recheck_s  # rechecks included
        with observer.connect() as conn:
            while time.monotonic() < deadline:
                count = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND application_name = 'prefect-gpu-budget'"
                    )
                ).scalar_one()
                peak = max(peak, count)
                time.sleep(0.1)
        observer.dispose()
        holding.holding.settle(held, ended_at=time.time(), outcome="completed")
        for thread in waiters:
            thread.join(timeout=120)
        assert 1 <= peak <= 2, peak  # the watcher's LISTEN and the pool's one
        assert {r["state"] for r in ledger.views.jobs("conn")} == {"settled"}
    finally:
        holder.db.dispose()
        ledger.db.dispose()


def test_a_lost_notice_is_caught_by_the_recheck(prices, monkeypatch):
    """PostgreSQL: a notice that never arrives (a dropped LISTEN connection) delays a waiter
    by one recheck at most; the recheck's own decision admits it."""
    monkeypatch.setattr(ledger_engine, "notice_payloads", lambda org, ids: [])  # `Db.bump` calls it
    ledger = Ledger(_fresh_pg())
    try:
        ledger.config.set_budget(BudgetRule("lost", hourly_cap_cents=360))
        gate = Gate(ledger, catalog=Catalog.load(prices), recheck_s=0.5)
        order = _queue_up(gate, ledger, "lost/t", 3, hold_s=0.05)
        assert len(order) == 3
    finally:
        ledger.db.dispose()


def test_a_waiting_jobs_row_is_stamped_while_it_only_waits(ledger, prices):
    """It keeps its place (`STALE_WAITER_S`) without deciding: its watcher stamps it."""
    ledger.config.set_budget(BudgetRule("stamp", hourly_cap_cents=360))
    gate = Gate(ledger, catalog=Catalog.load(prices), recheck_s=0.3)
    held = gate.admit(JOB, "stamp/t")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(gate.admit(JOB, "stamp/t")))
    waiter.start()
    _until(lambda: ledger.views.jobs("stamp", states=("queued",)), 30, "the queued job")
    (first,) = ledger.views.jobs("stamp", states=("queued",))
    _until(
        lambda: ledger.views.job(first["id"])["heartbeat_at"] > first["heartbeat_at"] + 0.5,
        30,
        "a stamp",
    )
    gate.holding.settle(held, ended_at=time.time(), outcome="completed")
    waiter.join(timeout=30)
    gate.holding.settle(got[0], ended_at=time.time(), outcome="completed")


@pytest.mark.parametrize("depth", [40])
def test_a_deep_queue_keeps_its_order_and_admits_everyone(ledger, prices, depth):
    """Priority then arrival, through queue-wide decisions made by other jobs' settlements."""
    ledger.config.set_budget(BudgetRule("deep", hourly_cap_cents=360))
    gate = Gate(ledger, catalog=Catalog.load(prices))
    held = gate.admit(JOB, "deep/t")
    admitted: list[int] = []
    threads = []

    def one(priority: int) -> None:
        job = GpuJob(instance_type="local:box", max_runtime="1m", priority=priority)
        admission = gate.admit(job, "deep/t")
        admitted.append(priority)
        gate.holding.settle(admission, ended_at=time.time(), outcome="completed")

    for i in range(depth):
        threads.append(threading.Thread(target=one, args=(i % 4,)))
        threads[-1].start()
    _until(lambda: len(ledger.views.jobs("deep", states=("queued",))) == depth, 60, "the queue")
    gate.holding.settle(held, ended_at=time.time(), outcome="completed")
    for thread in threads:
        thread.join(timeout=120)
    assert admitted == sorted(admitted, reverse=True), admitted


def test_a_ledger_the_watcher_cannot_reach_is_told_to_its_waiters_as_an_outage():
    """PostgreSQL: the LISTEN connection's own connect failing (here: no such database) is an
    outage the waiting jobs hear about in one line, not a watcher error in the log."""
    gone = sa.make_url(PG_URL).set(database=f"gpu_budget_never_{uuid.uuid4().hex[:8]}")
    ledger = Ledger(gone.render_as_string(hide_password=False), create=False)
    told: list[str] = []
    ticket = Ticket("job-1", "org", told.append)
    watcher_for(ledger).watch(ticket)
    try:
        _until(lambda: told, 30, "an outage message")
        assert told[0].startswith("waiting for admission: the ledger's database is unreachable")
        assert "does not exist" in told[0] and "\n" not in told[0]
    finally:
        watcher_for(ledger).unregister(ticket)
        ledger.db.dispose()


def test_a_job_admitted_at_once_starts_no_watcher(ledger, prices):
    """Only a job that waits is watched: an admission at once costs no watcher thread (and, on
    PostgreSQL, no LISTEN connection of its own)."""
    ledger.config.set_budget(BudgetRule("once", hourly_cap_cents=3600))
    gate = Gate(ledger, catalog=Catalog.load(prices))
    for _ in range(3):
        admission = gate.admit(JOB, "once/t")
        gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
    watcher = watcher_for(ledger)
    assert watcher._thread is None and watcher.waiting() == 0


def test_a_decision_made_before_a_waiter_is_watched_reaches_it(ledger, prices, monkeypatch):
    """The job that frees the cap settles between the waiter's request and its watch, while the
    process's watcher already listens for another job: the notice named a job it did not know
    yet. The waiter reads its decision once it is watched, not at its recheck an hour away."""
    ledger.config.set_budget(BudgetRule("gap", hourly_cap_cents=360))
    gate = Gate(ledger, catalog=Catalog.load(prices), recheck_s=3600)
    other = Ticket("someone-else", "gap", lambda message: None)
    watcher_for(ledger).watch(other)
    held = gate.admit(JOB, "gap/t")
    watch = Gate._watch

    def settle_first(self, ticket: Ticket) -> None:
        gate.holding.settle(held, ended_at=time.time(), outcome="completed")
        _until(lambda: ledger.views.job(ticket.job_id)["state"] == "admitted", 30, "the admission")
        time.sleep(0.5)  # the watcher has heard (or polled) the change by now
        watch(self, ticket)

    monkeypatch.setattr(Gate, "_watch", settle_first)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(gate.admit(JOB, "gap/t")), daemon=True)
    try:
        waiter.start()
        waiter.join(timeout=60)  # else asleep until WAKE_ANYWAY_S
        assert got, "the waiter did not hear of its admission"
        gate.holding.settle(got[0], ended_at=time.time(), outcome="completed")
    finally:
        watcher_for(ledger).unregister(other)

"""Requests and their decisions (admission/ledger/queue.py): stale waiters, a request retried
after a lost commit, holds where spend can fall, estimate mode, what held a job and for how
long, the queue's head, the policy run once, and a burst recorded in a few transactions."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.support.jobs import new_job


def _job(scope: str) -> NewJob:
    return new_job(scope)


def test_a_waiter_that_stalled_is_still_decided(ledger):
    ledger.config.set_budget(BudgetRule("st", hourly_cap_cents=360))
    first, admitted = ledger.queue.request(_job("st/a"))
    second, waiting = ledger.queue.request(_job("st/a"))
    assert admitted.verdict == "admit" and waiting.verdict == "wait"
    later = time.time() + 45  # its own heartbeat is older than the stale limit
    assert ledger.queue.try_admit(second, "st/a", now=later).verdict == "wait"


def test_a_request_whose_commit_went_unheard_is_recorded_once_when_asked_again(ledger):
    """The connection drops as the request commits: the gate asks again under the same job id,
    and that second try reads the row the first one recorded (a first try has none to read)."""
    import uuid
    from contextlib import contextmanager

    ledger.config.set_budget(BudgetRule("unheard", hourly_cap_cents=10_000))
    write, lost = ledger.db.write, []

    @contextmanager
    def commit_unheard(org: str, request: bool = False):
        with write(org, request) as conn:
            yield conn
        if request and not lost:  # committed; the answer is lost on the way back
            lost.append(org)
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))

    ledger.db.write = commit_unheard
    job_id = str(uuid.uuid4())
    with pytest.raises(sa.exc.OperationalError):
        ledger.queue.ask(_job("unheard/t"), job_id)
    assert lost == ["unheard"]
    decision, rules, _ = ledger.queue.ask(_job("unheard/t"), job_id)
    assert decision.verdict == "admit" and [r.scope for r in rules] == ["unheard"]
    assert [row["id"] for row in ledger.views.jobs("unheard")] == [job_id]
    assert not ledger.queue._unsure


def test_a_job_that_waits_for_cloud_capacity_is_held_where_its_spend_can_fall(ledger):
    """Admitted at 23:00, started at 02:00 after a wait for capacity: its reservation counts
    in the day it runs, not in the day it was admitted."""
    day = 86400.0
    ledger.config.set_budget(BudgetRule("cw", period_budget_micro=10**9, period="day"))
    admitted_at = 20_000 * day + 23 * 3600
    job_id, decision = ledger.queue.request(_job("cw/a"), now=admitted_at)
    assert decision.verdict == "admit"
    [before] = ledger.views.status("cw", now=admitted_at + 1)
    assert before["reserved_micro"] > 0  # not started: held from now on, in today
    assert ledger.settlements.mark_started(job_id, admitted_at + 3 * 3600)
    [today] = ledger.views.status("cw", now=admitted_at + 3 * 3600 + 1)
    assert (
        today["period_start"] == 20_001 * day
        and today["reserved_micro"] == before["reserved_micro"]
    )  # all of it lies in the day it runs


def test_an_admitted_job_that_has_not_started_holds_all_of_it_in_every_day_ahead(ledger):
    """A flex-start job admitted 17 min before midnight may start after it and spend all of
    its reservation in the new day: a job asked for beside it is held against that, so the
    new day's real spend stays within its budget however late the first starts."""
    day, hour = 86400.0, 3600.0
    ledger.config.set_budget(BudgetRule("fs", period_budget_micro=15_000_000, period="day"))
    midnight = 20_000 * day
    asked = midnight - 17 * 60
    rate = {"rate_micro_per_hour": 10_000_000, "rate_cents": 1000, "on_limit": "reject"}
    a_id, a = ledger.queue.request(new_job("fs/a", max_runtime_s=80 * 60, **rate), now=asked)
    assert a.verdict == "admit"
    c_id, c = ledger.queue.request(new_job("fs/a", max_runtime_s=40 * 60, **rate), now=asked)
    assert c.verdict == "reject" and "day budget of fs" in c.reason, c.reason
    assert ledger.settlements.mark_started(a_id, midnight + 300)  # capacity came after midnight
    ledger.settlements.settle(
        a_id, ended_at=midnight + 300 + 80 * 60, outcome="timed_out", now=midnight + hour
    )
    assert ledger.views.period_settled("fs", midnight) <= 15_000_000
    # once it has started, a job is held where it runs: one beside it fits what is left
    _, fits = ledger.queue.request(
        new_job("fs/a", max_runtime_s=60, **rate), now=midnight + 2 * hour
    )
    assert fits.verdict == "admit", fits.reason


def test_estimate_mode_learns_how_far_a_scope_overruns(ledger):
    """After 25 jobs that ran twice their estimate, the next reservation is stretched by 2x."""
    from dataclasses import replace

    ledger.config.set_budget(
        BudgetRule("lrn", period_budget_micro=10**9, reservation_mode="estimate")
    )
    job = replace(_job("lrn/a"), expected_runtime_s=10.0, max_runtime_s=60.0)
    t = time.time() - 3600
    for i in range(25):
        job_id, decision = ledger.queue.request(job, now=t)
        assert decision.reserve_seconds == (10.0 if i < 20 else 20.0)  # 20 settled jobs teach
        ledger.settlements.mark_started(job_id, t)
        ledger.settlements.settle(
            job_id, ended_at=t + 20.0, outcome="completed", scope="lrn/a", now=t + 20
        )
        t += 30
    fresh = type(ledger)(ledger.url)  # a new process reads what the ledger learned
    _, decision = fresh.queue.request(job, now=t)
    assert decision.reserve_seconds == 20.0 and "estimate x2.00, as in lrn/a" in decision.reason
    fresh.db.dispose()


def test_a_zero_cap_admits_no_job_however_cheap(ledger):
    from prefect_gpu_budget.blocks import GpuBudget

    ledger.config.set_budget(GpuBudget(scope="zc", hourly_cap_usd=0, on_limit="reject").rule())
    _, decision = ledger.queue.request(new_job("zc/a", rate_micro_per_hour=10_000, rate_cents=1))
    assert decision.verdict == "reject", decision
    assert [j["state"] for j in ledger.views.jobs("zc")] == ["rejected"]


def test_a_job_says_what_held_it_and_for_how_long(ledger):
    from prefect_gpu_budget.admission.ledger import wait_spans

    ledger.config.set_budget(BudgetRule("wt", hourly_cap_cents=360))
    ledger.config.set_budget(BudgetRule("wt/a", hourly_cap_cents=10_000))
    first, _ = ledger.queue.request(_job("wt/a"), now=1000.0)
    second, waiting = ledger.queue.request(_job("wt/a"), now=1000.0)
    assert waiting.verdict == "wait"
    assert ledger.queue.try_admit(second, "wt/a", now=1010.0).verdict == "wait"
    assert wait_spans(ledger.views.job(second)) and wait_spans(ledger.views.job(first)) == {}
    ledger.settlements.settle(first, ended_at=1020.0, outcome="completed", scope="wt/a")
    assert ledger.queue.try_admit(second, "wt/a", now=1025.0).verdict == "admit"
    assert wait_spans(ledger.views.job(second)) == {"hourly_cap wt": 25.0}


def test_every_wait_names_what_held_it_slots_held_outside_and_the_start_included(ledger):
    """An admission given back because Prefect's limit was full waits on `prefect_slots`; the
    time from admission to start is `starting`: no wait is left unnamed."""
    from prefect_gpu_budget.admission.ledger import wait_spans

    ledger.config.set_budget(BudgetRule("ws", hourly_cap_cents=10_000))
    job, decision = ledger.queue.request(_job("ws/a"), now=1000.0)
    assert decision.verdict == "admit"
    assert ledger.queue.unadmit(job, "ws/a", "Prefect's slots are held", now=1001.0)
    assert ledger.queue.try_admit(job, "ws/a", now=1008.0).verdict == "admit"
    assert ledger.settlements.mark_started(job, 1010.5)
    assert wait_spans(ledger.views.job(job)) == {"prefect_slots ws/a": 7.0, "starting": 2.5}


def test_a_request_joining_a_queue_waits_behind_its_head_unless_it_goes_first(ledger):
    """A request behind a waiter that a budget on its path blocks is decided from that one row
    (`deciding.decide_behind`); one of higher priority goes ahead of it, decided in full."""
    ledger.config.set_budget(BudgetRule("dq", hourly_cap_cents=360, max_wait_s=3600))
    running, admitted = ledger.queue.request(_job("dq/t/a"))
    head, blocked = ledger.queue.request(_job("dq/t/b"))
    _, behind = ledger.queue.request(_job("dq/t/c"))
    _, refused = ledger.queue.request(new_job("dq/t/c", on_limit="reject"))
    urgent, first = ledger.queue.request(new_job("dq/t/d", priority=5))
    assert admitted.verdict == "admit"
    assert (blocked.verdict, blocked.limit, blocked.scope) == ("wait", "hourly_cap", "dq")
    assert (behind.verdict, behind.limit, behind.scope) == ("wait", "queue", "dq")
    assert f"waiting behind job {head[:8]}" in behind.reason
    assert refused.verdict == "reject" and refused.reason.startswith("over budget: waiting")
    assert (first.verdict, first.limit) == ("wait", "hourly_cap")  # not behind the head
    assert ledger.settlements.settle(
        running, ended_at=time.time(), outcome="completed", scope="dq/t/a"
    )
    states = {r["id"]: r["state"] for r in ledger.views.jobs("dq")}
    assert states[urgent] == "admitted" and states[head] == "queued"


def test_the_policy_runs_once_for_a_request_decided_at_once(ledger, monkeypatch):
    """A new job admitted (or refused) at once made no room for any other: its request loads
    the org's snapshot and runs the policy once. A waiter admitted later may have held jobs
    behind it, so its admission decides the org's queue again."""
    from prefect_gpu_budget.admission.ledger import queue

    ledger.config.set_budget(BudgetRule("once", hourly_cap_cents=360, max_wait_s=3600))
    loads: list[str] = []
    load = queue.load_state

    def counted(conn, org, now, deciding, *known, **named):
        loads.append(deciding)
        return load(conn, org, now, deciding, *known, **named)

    monkeypatch.setattr(queue, "load_state", counted)
    first, admitted = ledger.queue.request(_job("once/t/a"))
    assert admitted.verdict == "admit" and loads == [first]
    loads.clear()
    _, refused = ledger.queue.request(new_job("once/t/b", on_limit="reject"))
    assert refused.verdict == "reject" and len(loads) == 1
    loads.clear()
    waiter, waiting = ledger.queue.request(_job("once/t/c"))
    assert waiting.verdict == "wait" and loads == [waiter]
    loads.clear()
    ledger.settlements.settle(first, ended_at=time.time(), outcome="completed", scope="once/t/a")
    assert loads == [""]  # the settlement decides the queue: the waiter is admitted
    assert ledger.views.job(waiter)["state"] == "admitted"


def test_a_new_job_decided_at_once_still_admits_a_waiter_time_made_room_for(ledger, monkeypatch):
    """A waiter ahead goes silent (its holder died): the live waiter behind it now fits. A new
    job decided at once must not go before it: its request decides the org's queue, and the
    waiter is admitted in the same transaction (FIFO holds)."""
    from prefect_gpu_budget.admission.ledger import jobs, queue, state

    monkeypatch.setattr(queue, "STALE_WAITER_S", 1.0)  # the waiter a new job joins behind
    monkeypatch.setattr(state, "STALE_WAITER_S", 1.0)  # and the policy's queue
    ledger.config.set_budget(BudgetRule("fifo", hourly_cap_cents=400))
    _, running = ledger.queue.request(new_job("fifo", rate_cents=200))
    _, silent = ledger.queue.request(new_job("fifo", rate_cents=300))
    live, behind = ledger.queue.request(new_job("fifo", rate_cents=100))
    assert (running.verdict, silent.verdict, behind.verdict) == ("admit", "wait", "wait")
    time.sleep(1.5)  # the silent waiter's row goes stale; the live one's watcher stamps it
    with ledger.db.engine.begin() as conn:
        conn.execute(jobs.update().where(jobs.c.id == live).values(heartbeat_at=time.time()))
    _, new = ledger.queue.request(new_job("fifo", rate_cents=100))
    assert new.verdict == "admit"
    assert ledger.views.job(live)["state"] == "admitted"


def test_a_burst_of_requests_is_recorded_once_each_in_a_few_transactions(ledger):
    """Threads of one process asking at once: every job recorded once, each told what its row
    says, the cap admits exactly its share, and the burst costs fewer transactions than jobs."""
    import threading
    import uuid

    from sqlalchemy import event

    ledger.config.set_budget(BudgetRule("bu", hourly_cap_cents=10**6))
    ledger.config.set_budget(BudgetRule("bu/t", hourly_cap_cents=4 * 360))
    ended = [0]

    def count(_conn) -> None:
        ended[0] += 1

    event.listen(ledger.db.engine, "commit", count)
    start = threading.Barrier(48)
    told: dict[str, str] = {}

    def ask() -> None:
        job_id = str(uuid.uuid4())
        start.wait()
        told[job_id] = ledger.queue.ask(_job("bu/t/s"), job_id)[0].verdict

    threads = [threading.Thread(target=ask) for _ in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    event.remove(ledger.db.engine, "commit", count)
    rows = {r["id"]: r for r in ledger.views.jobs(limit=1000)}
    assert set(rows) == set(told)
    assert sum(v == "admit" for v in told.values()) == 4
    for job_id, verdict in told.items():
        assert rows[job_id]["state"] == ("admitted" if verdict == "admit" else "queued")
    assert ended[0] < 48


def test_an_admission_given_back_ends_if_its_owner_asked_it_to_stop(ledger):
    """Prefect's limit was full, so an admission goes back to the queue (`unadmit`): a stop its
    owner asked for meanwhile ends it there, cancelled for the owner's reason, and a preemption
    asked of another is forgotten (it holds nothing now: were it admitted again, it would be
    stopped at once for nothing)."""
    from prefect_gpu_budget.admission.ledger.tables import jobs

    ledger.config.set_budget(BudgetRule("back", hourly_cap_cents=3600))
    stopped, admitted = ledger.queue.request(_job("back/t"))
    assert admitted.verdict == "admit"
    assert ledger.settlements.ask_stop(stopped, "stopped by its owner")
    assert ledger.queue.unadmit(stopped, "back/t", "blocked by Prefect's limit")
    row = ledger.views.job(stopped)
    assert (row["state"], row["reason"]) == ("cancelled", "stopped by its owner")
    assert (row["reserved_micro"], row["actual_micro"]) == (0, 0)
    assert ledger.queue.try_admit(stopped, "back/t").limit == "cancelled"

    preempted, _ = ledger.queue.request(_job("back/t"))
    with ledger.db.tx() as conn:
        conn.execute(jobs.update().where(jobs.c.id == preempted).values(preempt_at=time.time()))
    assert ledger.views.stop_asked(preempted) == "preempted"
    assert ledger.queue.unadmit(preempted, "back/t", "blocked by Prefect's limit")
    assert ledger.views.job(preempted)["state"] == "admitted"  # at once again: the ledger has room
    assert ledger.views.stop_asked(preempted) is None

"""Ledger edge cases: stale waiters, LIKE wildcards in scopes, dropped connections."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.policy import BudgetRule
from tests.conftest import PG_URL, _fresh_pg
from tests.jobs import new_job


def _job(scope: str) -> NewJob:
    return new_job(scope)


def test_a_waiter_that_stalled_is_still_decided(ledger):
    ledger.config.set_budget(BudgetRule("st", hourly_cap_cents=360))
    first, admitted = ledger.queue.request(_job("st/a"))
    second, waiting = ledger.queue.request(_job("st/a"))
    assert admitted.verdict == "admit" and waiting.verdict == "wait"
    later = time.time() + 45  # its own heartbeat is older than the stale limit
    assert ledger.queue.try_admit(second, "st/a", now=later).verdict == "wait"


def test_underscore_in_a_scope_is_not_a_wildcard(ledger):
    ledger.config.set_budget(BudgetRule("axb", hourly_cap_cents=10_000, period_budget_micro=10**9))
    job_id, decision = ledger.queue.request(_job("axb/t"))
    ledger.settlements.mark_started(job_id, time.time() - 100)
    ledger.settlements.settle(job_id, ended_at=time.time(), outcome="completed", scope="axb/t")
    ledger.config.set_budget(BudgetRule("a_b", hourly_cap_cents=10_000, period_budget_micro=10**9))
    assert [s["settled_micro"] for s in ledger.views.status("a_b")] == [0]
    assert [len(ledger.views.jobs(scope)) for scope in ("a_b", "axb")] == [0, 1]


def test_calls_go_on_after_the_server_drops_every_connection():
    from prefect_gpu_budget.admission.ledger import Ledger, normalise_url

    _fresh_pg()
    ledger = Ledger(PG_URL)
    ledger.config.set_budget(BudgetRule("rc", hourly_cap_cents=10_000))
    job_id, decision = ledger.queue.request(_job("rc/t"))
    assert decision.verdict == "admit"
    killer = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
    with killer.connect() as conn:
        killed = conn.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'prefect-gpu-budget' AND pid <> pg_backend_pid() "
                "AND datname = current_database()"  # this run's own: not other tests'
            )
        ).scalar_one()
    killer.dispose()
    assert killed >= 1
    row = ledger.settlements.settle(
        job_id,
        ended_at=ledger.views.job(job_id)["admitted_at"] + 1,
        outcome="completed",
        scope="rc/t",
    )
    assert row is not None and row["state"] == "settled"
    assert ledger.queue.request(_job("rc/t"))[1].verdict == "admit"
    ledger.db.dispose()


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
    decision, rules = ledger.queue.ask(_job("unheard/t"), job_id)
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


def test_a_cap_beyond_what_a_prefect_limit_holds_is_refused_and_not_written(ledger):
    import pytest

    from prefect_gpu_budget.units import BudgetInputError

    for write in (ledger.config.set_budget, ledger.config.set_session_template):
        with pytest.raises(BudgetInputError, match="^hourly_cap: must be at most"):
            write(BudgetRule("big/team", hourly_cap_cents=2**31))
    assert ledger.config.budgets() == [] and ledger.config.session_templates() == []
    ledger.config.set_budget(BudgetRule("big", hourly_cap_cents=2**31 - 1))
    assert [r.hourly_cap_cents for r in ledger.config.budgets()] == [2**31 - 1]


def _sqlite_ledger(path):
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(f"sqlite:///{path}")
    ledger.config.set_budget(BudgetRule("rf", hourly_cap_cents=100_000))
    assert ledger.queue.request(_job("rf/a"))[1].verdict == "admit"
    return ledger


def test_a_removed_ledger_file_fails_closed_in_the_process_using_it(tmp_path):
    import pytest

    from prefect_gpu_budget.admission.ledger import Ledger, LedgerFileReplaced

    path = tmp_path / "ledger.db"
    ledger = _sqlite_ledger(path)
    path.unlink()
    with pytest.raises(LedgerFileReplaced, match="was replaced or removed") as exc:
        ledger.queue.request(_job("rf/a"))
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)
    # a new process sees the orphaned write-ahead log and says so, not `disk I/O error`
    assert (tmp_path / "ledger.db-wal").exists()  # the live process still holds it open
    with pytest.raises(LedgerFileReplaced, match="was removed while a process had it open"):
        Ledger(f"sqlite:///{path}")
    ledger.db.dispose()


def test_a_replaced_ledger_file_fails_closed_and_admits_nothing(tmp_path):
    import pytest

    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.ledger import Ledger, LedgerFileReplaced
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import Catalog

    path = tmp_path / "ledger.db"
    ledger = _sqlite_ledger(path)
    other = Ledger(f"sqlite:///{tmp_path / 'other.db'}")
    other.config.set_budget(BudgetRule("rf", hourly_cap_cents=100_000))
    other.db.dispose()
    (tmp_path / "other.db").replace(path)  # e.g. a backup restored over the live file
    gate = Gate(ledger, catalog=Catalog.load())
    with pytest.raises(LedgerFileReplaced, match="was replaced or removed"):
        gate.admit(GpuJob(instance_type="aws:g5.xlarge", max_runtime="1h"), "rf/a")
    ledger.db.dispose()
    fresh = Ledger(f"sqlite:///{path}")  # the file now in place never saw this request
    assert [j for j in fresh.views.jobs() if j["instance_type"] == "aws:g5.xlarge"] == []
    fresh.db.dispose()


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


def test_a_ledger_of_an_earlier_version_gets_the_new_columns_and_a_current_one_one_query(tmp_path):
    import sqlalchemy as sa

    from prefect_gpu_budget.admission.ledger import Ledger

    url = f"sqlite:///{tmp_path / 'old.db'}"
    Ledger(url).db.dispose()
    old = sa.create_engine(url)
    with old.begin() as conn:  # as an earlier version left it: no `waits`, no schema stamp
        conn.exec_driver_sql("ALTER TABLE gpu_jobs DROP COLUMN waits")
        conn.exec_driver_sql("DROP TABLE gpu_schema")
    old.dispose()
    reopened = Ledger(url)
    columns = {c["name"] for c in sa.inspect(reopened.db.engine).get_columns("gpu_jobs")}
    assert "waits" in columns
    reopened.db.dispose()

    statements: list[str] = []
    current = Ledger(url, create=False)
    sa.event.listen(current.db.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    current.db.create()
    queries = [s for s in statements if not s.startswith("BEGIN")]
    assert len(queries) == 1 and "gpu_schema" in queries[0], statements
    current.db.dispose()


def test_a_request_joining_a_queue_waits_behind_its_head_unless_it_goes_first(ledger):
    """A request behind a waiter that a budget on its path blocks is decided from that one row
    (`policy.decide_behind`); one of higher priority goes ahead of it, decided in full."""
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
    from prefect_gpu_budget.admission.ledger import decisions

    ledger.config.set_budget(BudgetRule("once", hourly_cap_cents=360, max_wait_s=3600))
    loads: list[str] = []
    load = decisions.Queue._load

    def counted(self, conn, org, now, deciding, *known):
        loads.append(deciding)
        return load(self, conn, org, now, deciding, *known)

    monkeypatch.setattr(decisions.Queue, "_load", counted)
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
    from prefect_gpu_budget.admission.ledger import decisions, jobs

    monkeypatch.setattr(decisions, "STALE_WAITER_S", 1.0)
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


def test_an_org_s_writes_go_in_turn_and_a_settlement_before_a_burst_of_requests():
    """`OrgLock`: first come, first served, except that waiting requests let the other writes
    go first; a write inside a write of the same thread is refused."""
    import threading

    from prefect_gpu_budget.admission.ledger.engine import OrgLock

    lock, order, inside, lined_up = OrgLock(), [], threading.Event(), threading.Event()

    def write(name: str, request: bool) -> None:
        with lock.held(request):
            order.append(name)

    def first() -> None:
        with lock.held():
            inside.set()
            lined_up.wait(10)
            order.append("first")

    threads = [threading.Thread(target=first)]
    threads[0].start()
    inside.wait(5)
    for n, (name, request) in enumerate(
        (("r1", True), ("r2", True), ("w1", False), ("r3", True), ("w2", False)), 1
    ):
        threads.append(threading.Thread(target=write, args=(name, request)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(lock._writes) + len(lock._requests) < n and time.monotonic() < deadline:
            time.sleep(0.01)  # in line, in this order
    lined_up.set()
    for thread in threads:
        thread.join(10)
    assert order == ["first", "w1", "w2", "r1", "r2", "r3"]
    with lock.held():
        try:
            with lock.held(request=True):
                raise AssertionError("a write inside a write was let in")
        except RuntimeError as exc:
            assert "inside another" in str(exc)
    with lock.held():  # free again
        pass


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

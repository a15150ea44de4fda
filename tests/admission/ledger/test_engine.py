"""The ledger's database (admission/ledger/engine.py): connections the server drops, a SQLite
file removed or replaced under a live process, a schema an earlier version made, and an org's
writes in turn."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.conftest import PG_URL, _fresh_pg
from tests.support.jobs import new_job


def _job(scope: str) -> NewJob:
    return new_job(scope)


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


def _sqlite_ledger(path):
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(f"sqlite:///{path}")
    ledger.config.set_budget(BudgetRule("rf", hourly_cap_cents=100_000))
    assert ledger.queue.request(_job("rf/a"))[1].verdict == "admit"
    return ledger


def test_a_removed_ledger_file_fails_closed_in_the_process_using_it(tmp_path):

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


def test_jobs_recorded_before_their_team_was_kept_get_it_when_the_ledger_is_upgraded(tmp_path):
    """A team's jobs are read by `gpu_jobs.team`: an earlier version's rows without it are
    filled in (`org/team` of their scope) when a newer version first opens the ledger."""
    from prefect_gpu_budget.admission.ledger import Ledger

    url = f"sqlite:///{tmp_path / 'old.db'}"
    ledger = Ledger(url)
    ids = [ledger.queue.request(new_job(scope))[0] for scope in ("up/t/s", "up/t", "up", "up/u/s")]
    ledger.db.dispose()
    old = sa.create_engine(url)
    with old.begin() as conn:  # as an earlier version left it: no team, no schema stamp
        conn.exec_driver_sql("UPDATE gpu_jobs SET team = NULL")
        conn.exec_driver_sql("DROP TABLE gpu_schema")
    old.dispose()
    reopened = Ledger(url)
    teams = {j["id"]: j["team"] for j in reopened.views.jobs()}
    assert [teams[i] for i in ids] == ["up/t", "up/t", None, "up/u"]
    assert [j["id"] for j in reopened.views.jobs("up/t")] == ids[:2]
    reopened.db.dispose()


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

"""The Prefect tasks in real flow runs: named final states, logs, settlement, max_runtime."""

from __future__ import annotations

import subprocess
import sys

from prefect import flow

from prefect_gpu_budget import GpuBudget, GpuJob, SpendLedger, run_gpu_job
from prefect_gpu_budget.admission.ledger import Ledger
from tests.support.jobs import held_job, until_in


def _job(seconds: float, **kw) -> GpuJob:
    code = f"import time; print('step 1'); time.sleep({seconds}); print('done')"
    return GpuJob(instance_type="local:box", command=[sys.executable, "-c", code], **kw)


def test_flow_runs_settles_and_names_refusals(prefect_api, prices, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd="3.6", period_budget_usd=5).apply(ledger)
    GpuBudget(scope="lab/reject", hourly_cap_usd="3.6", on_limit="reject").apply(ledger)
    GpuBudget(scope="lab/wait", hourly_cap_usd="3.6", max_wait="1s").apply(ledger)
    GpuBudget(scope="lab/a").apply(ledger)  # lab has teams: the one the first job runs in too
    block = SpendLedger(database_url=url)

    done = tmp_path / "done"

    @flow
    def experiment():
        running = run_gpu_job.submit(held_job(done, max_runtime="1m"), scope="lab/a", ledger=block)
        until_in(url, "lab/a", "running")  # the first job takes the whole cap
        rejected = run_gpu_job(
            _job(0, max_runtime="1m"), scope="lab/reject", ledger=block, return_state=True
        )
        timed_out = run_gpu_job(
            _job(0, max_runtime="1m"), scope="lab/wait", ledger=block, return_state=True
        )
        done.touch()
        return running.result(), rejected, timed_out

    result, rejected, timed_out = experiment()
    assert result.outcome == "completed" and result.exit_code == 0
    assert rejected.name == "OverBudget" and "hourly cap of lab" in rejected.message
    assert timed_out.name == "AdmissionTimeout" and "max wait 1s ran out" in timed_out.message
    rows = {r["state"]: r for r in ledger.views.jobs("lab")}
    assert set(rows) == {"settled", "rejected", "timed_out"}
    settled = rows["settled"]
    assert settled["actual_micro"] == round(3_600_000 * settled["billed_seconds"] / 3600)
    assert settled["actual_micro"] == int(result.actual_usd * 1_000_000)


def test_max_runtime_stops_the_job_and_bills_what_ran(prefect_api, prices, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd=100).apply(ledger)

    @flow
    def too_long():
        state = run_gpu_job(
            _job(60, max_runtime="2s", kill_grace="3s"),  # the start's record has 3 s
            scope="lab",
            ledger=SpendLedger(database_url=url),
            return_state=True,
        )
        return state.name, state.message

    name, message = too_long()
    assert name == "TimedOut" and "timed_out" in message  # as a @gpu_task's and a worker's
    [row] = ledger.views.jobs("lab")
    assert row["outcome"] == "timed_out"
    assert 2.0 <= row["billed_seconds"] < 5.0  # stopped at 2 s (sleep dies at SIGTERM)
    assert row["actual_micro"] <= row["reserved_micro"]


def test_identical_jobs_are_never_served_from_cache(prefect_api, prices, tmp_path):
    """Prefect caches task results by input by default; the gate must run for every job."""
    from prefect_gpu_budget import admit, settle

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd=100).apply(ledger)
    block = SpendLedger(database_url=url)

    @flow
    def twice():
        job = _job(0.1, max_runtime="1m")
        first = run_gpu_job(job, scope="lab", ledger=block)
        second = run_gpu_job(job, scope="lab", ledger=block)
        import time

        admission = admit(job, scope="lab", ledger=block)
        row = settle(admission, time.time() - 1, time.time(), "completed", ledger=block)
        return first.job_id, second.job_id, row["billed_seconds"]

    first, second, billed = twice()
    assert first != second
    assert len(ledger.views.jobs("lab")) == 3
    assert 0.9 < billed < 2


def test_researcher_is_told_once_when_a_job_starts_waiting(prefect_api, prices, tmp_path):
    """A real notification block (a custom webhook) posting to a local HTTP server."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    received: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    CustomWebhookNotificationBlock(
        name="lab",
        url=f"http://127.0.0.1:{server.server_port}/hook",
        json_data={"text": "{{subject}}: {{body}}"},
    ).save("lab-hook", overwrite=True)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd="3.6", notify_block="custom-webhook/lab-hook").apply(
        ledger
    )
    block = SpendLedger(database_url=url)

    done = tmp_path / "done"

    @flow
    def two_jobs():
        a = run_gpu_job.submit(held_job(done, max_runtime="1m"), scope="lab/s", ledger=block)
        until_in(url, "lab/s", "running")  # the first job takes the whole cap
        b = run_gpu_job.submit(_job(0.1, max_runtime="1m"), scope="lab/s", ledger=block)
        until_in(url, "lab/s", "queued")
        done.touch()
        return a.result().outcome, b.result().outcome

    assert two_jobs() == ("completed", "completed")
    server.shutdown()
    assert len(received) == 1
    assert "is waiting: blocked by hourly cap of lab" in received[0]["text"]


def test_a_waiting_job_shows_awaiting_budget_then_running(prefect_api, prices, tmp_path):
    """While its job waits at the gate the task run is in `AwaitingBudget` (the reason as its
    message), then Running once admitted, and it ends Completed."""
    import time

    from prefect.client.orchestration import get_client

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    GpuBudget(scope="wait", hourly_cap_usd="3.6").apply(Ledger(url))
    block = SpendLedger(database_url=url)

    done = tmp_path / "done"

    @flow
    def two_jobs():
        a = run_gpu_job.submit(held_job(done, max_runtime="1m"), scope="wait/s", ledger=block)
        until_in(url, "wait/s", "running")  # the first job takes the whole cap
        b = run_gpu_job.submit(_job(0.1, max_runtime="1m"), scope="wait/s", ledger=block)
        until_in(url, "wait/s", "queued")
        done.touch()
        return str(b.task_run_id), a.result().outcome, b.result().outcome

    waiter, *outcomes = two_jobs()
    assert outcomes == ["completed", "completed"]
    names: list[str] = []
    with get_client(sync_client=True) as client:
        for _ in range(60):  # the server records task-run states from events, a moment later
            states = sorted(client.read_task_run_states(waiter), key=lambda s: s.timestamp)
            names = [s.name for s in states]
            if names and names[-1] == "Completed":
                break
            time.sleep(0.5)
    assert "AwaitingBudget" in names, names
    waiting = next(s for s in states if s.name == "AwaitingBudget")
    assert "blocked by hourly cap of wait" in waiting.message
    after = names[names.index("AwaitingBudget") + 1 :]
    assert after[0] == "Running" and after[-1] == "Completed", names


_PARALLEL_FLOW = """
import subprocess
import sys
from prefect import flow
from prefect_gpu_budget import GpuBudget, GpuJob, SpendLedger, run_gpu_job
from prefect_gpu_budget.admission.ledger import Ledger

url = sys.argv[1]
for scope in ("par", "par/team"):
    GpuBudget(scope=scope, hourly_cap_usd=100).apply(Ledger(url))
job = GpuJob(instance_type="local:box", max_runtime="1m", command=[sys.executable, "-c", "0"])


@flow
def many():
    block = SpendLedger(database_url=url)
    futures = [run_gpu_job.submit(job, scope="par/team/s", ledger=block) for _ in range(8)]
    return [f.result().outcome for f in futures]


print(many())
"""


def test_parallel_jobs_in_a_new_scope_raise_no_server_tracebacks(tmp_path, prices):
    """Eight task threads start at once in a scope whose Prefect limits do not exist yet: the
    limits are created once, and the server logs no error (it logged a long traceback ending in
    `UNIQUE constraint failed: concurrency_limit_v2.name` for each racing create)."""
    from tests.support.prefect_server import PrefectServer

    server = PrefectServer(tmp_path / "home").start()
    try:
        script = tmp_path / "many.py"
        script.write_text(_PARALLEL_FLOW)
        done = subprocess.run(
            [sys.executable, str(script), f"sqlite:///{tmp_path / 'ledger.db'}"],
            env=server.client_env(PREFECT_GPU_BUDGET_PRICES=str(prices)),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().endswith(str(["completed"] * 8)), done.stdout[-2000:]
    finally:
        server.stop()
    log = (tmp_path / "server-1.log").read_text()
    assert "Traceback" not in log and "UNIQUE constraint" not in log, log[-3000:]


class _EndpointDown:
    """A launcher whose cloud endpoint (with credentials in its URL) cannot be reached."""

    kind = "sagemaker"
    ENDPOINT = "https://admin:s3cr@t-key@aws.internal:9443/"

    def preflight(self, job, quote) -> None:
        pass

    def run(self, job, quote, *, on_start, log, env=None, on_submit=None):
        import time

        from prefect_gpu_budget.launchers.base import LaunchResult

        now = time.time()
        detail = f'Could not connect to the endpoint URL: "{self.ENDPOINT}api"'
        return LaunchResult("launch_error", now, now, detail=detail)

    def probe(self, external_id):
        raise AssertionError("not orphaned")

    def stop(self, external_id, grace=10.0) -> None:
        pass


def test_credentials_in_an_endpoint_url_stay_out_of_the_task_state(prefect_api, prices, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    GpuBudget(scope="ep", hourly_cap_usd="3.6").apply(Ledger(url))

    @flow
    def experiment():
        state = run_gpu_job(
            _job(0, max_runtime="1m"),
            scope="ep/a",
            ledger=SpendLedger(database_url=url),
            launcher=_EndpointDown(),
            return_state=True,
        )
        return state.name, state.message

    name, message = experiment()
    assert name == "GpuJobFailed"
    assert "s3cr" not in message and "t-key" not in message, message
    assert 'endpoint URL: "https://***@aws.internal:9443/api"' in message, message


def test_a_ledger_that_cannot_be_opened_yet_is_an_outage_the_job_waits_out(prefect_api, prices):
    """Opening the process's gate (the ledger's engine and schema) is retried like any later
    ledger call: here the job's PostgreSQL database appears only after the job asked, its
    budget already in it (copied from a database set up aside), so the gate that opens it
    knows the job's org."""
    import threading
    import time
    import uuid

    import sqlalchemy as sa

    from prefect_gpu_budget.testing.postgres import (
        drop_database,
        ensure_database,
        name_of,
        server_of,
    )
    from tests.conftest import PG_URL
    from tests.support.postgres import RUN, require_postgres

    require_postgres(PG_URL)
    run = uuid.uuid4().hex[:8]  # named for this run: an interrupted one's are reaped later
    url = f"{server_of(PG_URL)}/gpu_budget_late_{RUN}_{run}"
    aside = f"{server_of(PG_URL)}/gpu_budget_aside_{RUN}_{run}"

    def appear() -> None:
        time.sleep(2.0)
        ensure_database(aside)
        staged = Ledger(aside)
        GpuBudget(scope="late", hourly_cap_usd="3.6", period_budget_usd=5).apply(staged)
        staged.db.dispose()
        admin = sa.create_engine(
            sa.make_url(url).set(database="postgres"),
            isolation_level="AUTOCOMMIT",
            poolclass=sa.NullPool,
        )
        with admin.connect() as conn:  # the database appears at once, with its budget
            conn.execute(sa.text(f'CREATE DATABASE "{name_of(url)}" TEMPLATE "{name_of(aside)}"'))
        admin.dispose()

    threading.Thread(target=appear).start()

    @flow
    def experiment():
        return run_gpu_job(
            _job(0, max_runtime="1m"), scope="late/a", ledger=SpendLedger(database_url=url)
        )

    try:
        result = experiment()
        assert result.outcome == "completed"
        (row,) = Ledger(url).views.jobs("late")
        assert row["state"] == "settled" and row["id"] == result.job_id
    finally:
        drop_database(url)
        drop_database(aside)

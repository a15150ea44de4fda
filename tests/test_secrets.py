"""The ledger's credentials never show in logs, artifacts, CLI output or error messages."""

from __future__ import annotations

import subprocess
import sys

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from prefect_gpu_budget import GpuBudget, GpuJob, SpendLedger, run_gpu_job
from prefect_gpu_budget.admission.ledger import Ledger, metadata

SECRET = "hunter2-not-a-real-password"
URL = f"postgresql://postgres:{SECRET}@127.0.0.1:5432/test"  # trust auth ignores it


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "--ledger-url", args[0], *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_secret_stays_out_of_everything_a_person_sees(prefect_api, prices):
    fresh = Ledger(URL, create=False)
    metadata.drop_all(fresh.engine)
    fresh.dispose()
    ledger = Ledger(URL)
    GpuBudget(scope="sec", hourly_cap_usd="3.6", period_budget_usd=10).apply(ledger)
    block = SpendLedger(database_url=URL)
    assert SECRET not in repr(block) and SECRET not in repr(ledger.engine)

    @flow
    def job_flow():  # two jobs, room for one: the second logs why it waits (a warning)
        job = GpuJob(
            instance_type="local:box",
            max_runtime="1m",
            command=[sys.executable, "-c", "import time; time.sleep(1)"],
        )
        first = run_gpu_job.submit(job, scope="sec/t", ledger=block)
        second = run_gpu_job.submit(job, scope="sec/t", ledger=block)
        return first.result(), second.result()

    state = job_flow(return_state=True)
    assert state.is_completed()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
        artifacts = client.read_artifacts()
    seen = [log.message for log in logs] + [str(a.data) for a in artifacts]
    assert any("blocked by hourly cap of sec" in text for text in seen)
    assert not [text for text in seen if SECRET in text]

    outputs = [
        _cli(URL, "status", "--json"),
        _cli(URL, "ledger", "--json"),
        _cli(URL, "budget", "show"),
    ]
    broken = _cli(URL.replace("5432", "1"), "status")  # nothing listens there
    for done in [*outputs, broken]:
        assert SECRET not in done.stdout + done.stderr
    assert all(done.returncode == 0 for done in outputs)
    assert broken.returncode != 0 and len(broken.stderr.strip().splitlines()) == 1

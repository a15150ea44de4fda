"""The ledger's credentials never show in logs, artifacts, CLI output or error messages."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from prefect_gpu_budget import GpuBudget, GpuJob, SpendLedger, run_gpu_job
from prefect_gpu_budget.admission.ledger import Ledger, metadata
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.conftest import PG_URL
from tests.support.jobs import held_job, until_in
from tests.support.postgres import require_postgres
from tests.support.prefect_server import wait_for

SECRET = "hunter2-not-a-real-password"
URL = PG_URL.replace("postgres@", f"postgres:{SECRET}@", 1)  # trust auth ignores it


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI with the ledger URL `args[0]` in its environment: a password is never typed
    on the command line (where `ps` shows it; `--ledger-url` refuses one)."""
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args[1:]],
        env={**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": args[0]},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_secret_stays_out_of_everything_a_person_sees(prefect_api, prices, tmp_path):
    require_postgres(PG_URL)
    fresh = Ledger(URL, create=False)
    metadata.drop_all(fresh.db.engine)
    fresh.db.dispose()
    ledger = Ledger(URL)
    GpuBudget(scope="sec", hourly_cap_usd="3.6", period_budget_usd=10).apply(ledger)
    block = SpendLedger(database_url=URL)
    assert SECRET not in repr(block) and SECRET not in repr(ledger.db.engine)

    done = tmp_path / "done"

    @flow
    def job_flow():  # two jobs, room for one: the second logs why it waits (a warning)
        first = run_gpu_job.submit(held_job(done, max_runtime="1m"), scope="sec/t", ledger=block)
        until_in(URL, "sec/t", "running")
        job = GpuJob(instance_type="local:box", max_runtime="1m", command=[sys.executable, "-V"])
        second = run_gpu_job.submit(job, scope="sec/t", ledger=block)
        until_in(URL, "sec/t", "queued")
        done.touch()
        return first.result(), second.result()

    state = job_flow(return_state=True)
    assert state.is_completed()

    def seen() -> list[str]:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(
                log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
                )
            )
            artifacts = client.read_artifacts()
        texts = [log.message for log in logs] + [str(a.data) for a in artifacts]
        return texts if any("hourly cap of sec" in text for text in texts) else []  # the wait

    # Prefect sends logs in batches: the waiting line may reach the server after the flow ends
    texts = wait_for(seen, 60, "the waiting line in the flow's logs")
    assert not [text for text in texts if SECRET in text]

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


AWS_SECRET = "wJalrXUtnFEMI-not-a-real-secret-key"


def test_cloud_credentials_and_agent_tokens_stay_out_of_logs_events_and_errors(
    prefect_api, tmp_path, monkeypatch
):
    """A SageMaker job (loopback AWS) that runs, and one that fails, through the Prefect task;
    then every log, event, artifact, error and status line is searched for the secrets."""
    import httpx
    from prefect_aws import AwsCredentials

    from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher
    from tests.support.aws_server import AwsServer

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    GpuBudget(scope="sec2", hourly_cap_usd=100, period_budget_usd=100).apply(ledger)
    ledger.config.set_session_template(BudgetRule("sec2/agents", hourly_cap_cents=360))
    ledger.config.set_budget(BudgetRule("sec2/t"))  # sec2 has teams: the one its jobs run in too
    token = ledger.grants.grant_agent("sec2/agents/a1")
    block = SpendLedger(database_url=ledger.url)
    with AwsServer() as aws:
        aws.set_training_pace(0.1)
        creds = AwsCredentials(
            aws_access_key_id="AKIAEXAMPLEKEY",
            aws_secret_access_key=AWS_SECRET,
            region_name="us-east-1",
            aws_client_parameters={"endpoint_url": aws.url},
        )
        launcher = SageMakerLauncher(
            aws_credentials=creds,
            role_arn="arn:aws:iam::123456789012:role/Training",
            image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1",
            output_s3_uri="s3://lab/out",
            poll_s=0.05,
        )
        broken = SageMakerLauncher(**{**launcher.model_dump(), "role_arn": "not-an-arn"})
        job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="5m", name="secret-run")

        @flow
        def cloud_flow():
            ok = run_gpu_job.submit(job, scope="sec2/t", ledger=block, launcher=launcher)
            bad = run_gpu_job.submit(job, scope="sec2/t", ledger=block, launcher=broken)
            return ok.result(raise_on_failure=False), bad.result(raise_on_failure=False)

        state = cloud_flow(return_state=True)
    assert state.is_completed()
    flow_run_id = state.state_details.flow_run_id
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:  # run logs reach the server in batches: wait for them
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )
            if any("GPU job not launched" in log.message for log in logs):
                break
            assert time.monotonic() < deadline, [log.message for log in logs]
            time.sleep(1)
        task_runs = client.read_task_runs()
        artifacts = client.read_artifacts()
    events = httpx.post(f"{prefect_api}/events/filter", json={"limit": 200}, timeout=30).text
    seen = [log.message for log in logs] + [str(a.data) for a in artifacts] + [events]
    seen += [f"{t.state.name}: {t.state.message}" for t in task_runs if t.state]
    assert any("GPU job not launched" in text for text in seen)  # the logs were read
    assert [r["outcome"] for r in ledger.views.jobs()] == [
        "completed"
    ]  # one ran, one never reserved
    assert any("role" in text and "LaunchConfigError" in text for text in seen)
    status = _cli(ledger.url, "status", "--json")
    seen += [status.stdout, status.stderr, repr(launcher), repr(creds), str(ledger.views.jobs())]
    for secret in (AWS_SECRET, token):
        assert not [text for text in seen if secret in text]


AT_SECRET = "hunter2@tail-of-the-secret"
AT_URL = f"postgresql://postgres:{AT_SECRET}@127.0.0.1:1/test"  # nothing listens on port 1


def test_a_password_with_an_unencoded_at_stays_whole_and_out_of_errors():
    import sqlalchemy as sa

    from prefect_gpu_budget.admission.ledger import normalise_url

    url = sa.engine.make_url(normalise_url(AT_URL))
    assert (url.host, url.port, url.password) == ("127.0.0.1", 1, AT_SECRET)
    done = _cli(AT_URL, "status")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, out
    assert "tail-of-the-secret" not in out and "hunter2" not in out, out


def test_the_gates_outage_warnings_carry_no_url_credentials():
    import sqlalchemy as sa

    from prefect_gpu_budget.admission.limits import DependencyDown
    from prefect_gpu_budget.admission.outages import describe as _outage

    orig = Exception(f"connection to postgresql://postgres:{AT_SECRET}@db:5432/test failed")
    for exc in (sa.exc.OperationalError("SELECT 1", {}, orig), DependencyDown(str(orig))):
        text = _outage(exc)
        assert "hunter2" not in text and "tail-of-the-secret" not in text, text
        assert "://***@db:5432/test" in text, text


def test_credentials_in_an_endpoint_url_stay_out_of_launch_errors():
    from prefect_gpu_budget.launchers.sagemaker_outcome import one_line as sagemaker_line
    from prefect_gpu_budget.launchers.vertex_api import one_line as vertex_line
    from prefect_gpu_budget.units import redact_urls

    error = 'Could not connect to the endpoint URL: "https://admin:s3cr@t-key@aws.local:9/"'
    for text in (sagemaker_line(Exception(error)), vertex_line(error), redact_urls(error)):
        assert "s3cr" not in text and "t-key" not in text, text
        assert 'endpoint URL: "https://***@aws.local:9/"' in text, text


def test_a_password_is_never_taken_from_the_command_line():
    """`ps` and the shell's history show argv: every command refuses a URL password there."""
    typed = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "--ledger-url", URL, "status"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typed.returncode == 2 and SECRET not in typed.stderr + typed.stdout
    assert "PREFECT_GPU_BUDGET_LEDGER_URL" in typed.stderr.strip().splitlines()[-1]

"""Reconcile asks a job's launcher about an orphan (here SageMaker, on loopback AWS): a running
orphan keeps its reservation, a finished one settles from its real times and billed seconds, one
past its max_runtime is stopped."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from prefect_gpu_budget.admission.ledger import Ledger, jobs
from prefect_gpu_budget.admission.reconcile import reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher
from prefect_gpu_budget.units import cost_micro
from tests.support.aws_server import AwsServer
from tests.support.jobs import new_job

SCOPE = "lab/vision/agent-7"
RATE = 1_408_400  # ml.g5.xlarge, micro-dollars per hour


@pytest.fixture(scope="module")
def aws() -> Iterator[AwsServer]:
    with AwsServer() as running:
        yield running


def _orphan(ledger: Ledger, launcher: SageMakerLauncher, max_runtime: float) -> tuple[str, str]:
    """A SageMaker job started by a holder on another host that has since gone silent."""
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime=max_runtime, name="orphan")
    job_id, decision = ledger.queue.request(
        new_job(
            SCOPE,
            name="orphan",
            instance_type=job.instance_type,
            rate_micro_per_hour=RATE,
            rate_cents=141,
            max_runtime_s=max_runtime,
            launcher="sagemaker",
        )
    )
    assert decision.verdict == "admit"
    name = launcher.training_job_name(job)
    launcher._client().create_training_job(**launcher.training_job_request(job, name))
    assert ledger.settlements.mark_started(job_id, time.time(), name)
    return job_id, name


def test_reconcile_asks_the_launcher_about_orphans(aws, tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    ledger.config.set_budget(BudgetRule("lab", period_budget_micro=10**9))
    launcher = SageMakerLauncher(
        aws_credentials=aws.credentials(),
        role_arn="arn:aws:iam::123456789012:role/Training",
        image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1",
        output_s3_uri="s3://lab/out",
        poll_s=0.05,
    )
    aws.set_training_pace(3.0)  # jobs stay in training for a while
    running, _ = _orphan(ledger, launcher, max_runtime=3600)
    overdue, overdue_name = _orphan(ledger, launcher, max_runtime=3600)
    later = time.time() + 300  # their holder has been silent for five minutes
    with ledger.db.engine.begin() as conn:  # and the second one's max runtime has passed
        conn.execute(jobs.update().where(jobs.c.id == overdue).values(max_runtime_s=60.0))
    done = {
        r.job_id: r.action for r in reconcile(ledger, launchers={"sagemaker": launcher}, now=later)
    }
    assert done == {running: "left-running", overdue: "stopped"}
    assert ledger.views.job(running)["state"] == "running"  # still billing: keeps its reservation
    status = launcher._client().describe_training_job(TrainingJobName=overdue_name)
    assert status["TrainingJobStatus"] in ("Stopping", "Stopped")

    aws.set_training_pace(0.05)  # now the first one finishes
    deadline = time.time() + 30
    while launcher.probe(ledger.views.job(running)["external_id"]).state != "finished":
        assert time.time() < deadline
        time.sleep(0.2)
    probe = launcher.probe(ledger.views.job(running)["external_id"])
    [result] = reconcile(ledger, launchers={"sagemaker": launcher}, now=later)
    assert (result.job_id, result.action) == (running, "settled")
    row = ledger.views.job(running)
    assert row["ended_at"] == pytest.approx(probe.ended_at)  # its real end, not a guess
    assert row["billed_seconds"] == probe.billed_seconds
    assert row["actual_micro"] == cost_micro(RATE, probe.billed_seconds, round_up=False)
    assert reconcile(ledger, launchers={"sagemaker": launcher}, now=later) == []  # once only
    aws.reset()


def test_reconcile_cancels_a_flex_start_job_still_waiting_for_capacity(tmp_path):
    from prefect_gcp import GcpCredentials

    from prefect_gpu_budget.launchers.vertex import VertexLauncher
    from prefect_gpu_budget.pricing.catalog import Catalog
    from tests.launchers.fake_vertex import FakeVertex, Script
    from tests.support.gcp_server import service_account_info, serving

    info, public_key = service_account_info()
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    ledger.config.set_budget(BudgetRule("lab", period_budget_micro=10**9))
    job = GpuJob(instance_type="gcp:a2-highgpu-1g", max_runtime="1h", provisioning="flex-start")
    quote = Catalog.load().quote(job.instance_type, 1, "flex-start")
    with serving(FakeVertex(public_key=public_key)) as fake:
        launcher = VertexLauncher(
            gcp_credentials=GcpCredentials(service_account_info=info),
            image_uri="us-docker.pkg.dev/p/train/t:1",
            api_endpoint=fake.url,
        )

        def orphan(script: Script) -> tuple[str, str]:
            """Submitted by a holder that died while Vertex looked for capacity."""
            fake.script = script
            job_id, decision = ledger.queue.request(
                new_job(
                    SCOPE,
                    name="flex",
                    instance_type=job.instance_type,
                    provisioning="flex-start",
                    rate_micro_per_hour=quote.rate_micro_per_hour,
                    rate_cents=100,
                    max_runtime_s=3600.0,
                    launcher="vertex",
                )
            )
            assert decision.verdict == "admit"
            created = launcher._client().create_custom_job(
                parent=launcher._parent(), custom_job=launcher.custom_job(job, quote)
            )
            ledger.settlements.record_submission(job_id, created.name)
            return job_id, created.name

        waiting, waiting_name = orphan(Script(queued_s=60, run_s=1))
        started, started_name = orphan(Script(queued_s=0.2, run_s=60))
        deadline = time.time() + 20
        while launcher.probe(started_name).started_at is None:
            assert time.time() < deadline
            time.sleep(0.1)
        later = time.time() + 300
        done = {
            r.job_id: r.action for r in reconcile(ledger, launchers={"vertex": launcher}, now=later)
        }
        assert done == {waiting: "stopped", started: "left-running"}
        assert waiting_name.rsplit("/", 1)[-1] in " ".join(fake.cancelled)
        assert ledger.views.job(waiting)["actual_micro"] == 0  # it never ran: nothing billed
        row = ledger.views.job(started)  # it runs unwatched: now the ledger knows, and meters it
        assert row["state"] == "running"
        assert row["started_at"] == pytest.approx(launcher.probe(started_name).started_at)


def test_a_dead_holders_queued_job_is_cancelled_before_its_running_one_is_settled(ledger):
    """Settling a dead holder's running job frees the cap its queued job waits for: cancelled
    first, that job is never admitted for a holder that is gone (as Slurm ends a failed
    node's jobs, pending ones with them)."""
    dead = "elsewhere:1:1"
    ledger.config.set_budget(BudgetRule("rq", hourly_cap_cents=360))
    running, first = ledger.queue.request(new_job("rq/s", holder=dead))
    assert first.verdict == "admit" and ledger.settlements.mark_started(running, time.time())
    queued, second = ledger.queue.request(new_job("rq/s", holder=dead))
    assert second.verdict == "wait"
    done = {r.job_id: r.action for r in reconcile(ledger, now=time.time() + 3600)}
    assert done[queued] == "cancelled", done
    rows = {r["id"]: r for r in ledger.views.jobs("rq")}
    assert rows[queued]["state"] == "cancelled" and rows[queued]["admitted_at"] is None
    assert rows[running]["state"] == "settled"

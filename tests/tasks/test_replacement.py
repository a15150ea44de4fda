"""A job that asks for accelerators and has a checkpoint, taken back by its own team's
higher-priority work, is settled for what it ran and placed again on the next offering: two
places, each passing the gate, each settled for its own part."""

from __future__ import annotations

import sys
import time

import pytest
from prefect import flow

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.prices import default_catalog
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import set_local_price
from prefect_gpu_budget.tasks.gpu_job import run_gpu_job
from tests.tasks.test_preemption import TRAINER

NODE = (8, 192, 2048)


@pytest.mark.timeout(300)
def test_a_job_taken_back_is_placed_again_on_the_next_offering(prefect_api, tmp_path, monkeypatch):
    prices = set_local_price("h100a", "8", gpus=8, path=tmp_path / "prices.csv")
    set_local_price("h100b", "12", gpus=8, path=prices)
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    default_catalog.cache_clear()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    for name, machine in (("lab-a", "local:h100a"), ("lab-b", "local:h100b")):
        ledger.config.set_pool(
            Pool("acme", name, 1, NODE, (machine,), "H100"),
            [TeamQuota(name, "acme/b", NODE, borrow_pct=0)],
        )
    block = SpendLedger(database_url=url)
    ckpt = tmp_path / "trainer.ckpt"
    asked = GpuJob(
        accelerators="H100:8",
        checkpoint=str(ckpt),
        max_runtime="2m",
        kill_grace="5s",
        name="trainer",
        priority="low",
        command=[sys.executable, "-c", TRAINER, str(ckpt), "60"],
    )
    urgent = GpuJob(
        instance_type="local:h100a",
        pool="lab-a",
        max_runtime="2m",
        name="urgent",
        priority="high",
        command=[sys.executable, "-c", "import time; time.sleep(1)"],
    )

    @flow
    def contention():
        trainer = run_gpu_job.submit(asked, "acme/b/s", block)
        while not (tmp_path / "trainer.ckpt.ready").exists():  # running, its handler set
            assert not trainer.state.is_final(), trainer.state
            time.sleep(0.1)
        first = run_gpu_job.submit(urgent, "acme/b/s", block)
        return trainer.result(), first.result()

    result, urgent_result = contention()
    assert urgent_result.outcome == "completed"
    rows = sorted(
        (r for r in ledger.views.jobs() if r["name"] == "trainer"), key=lambda r: r["requested_at"]
    )
    assert [(r["instance_type"], r["pool"], r["outcome"]) for r in rows] == [
        ("local:h100a", "lab-a", "preempted"),
        ("local:h100b", "lab-b", "completed"),
    ]
    first, again = rows
    assert ckpt.read_text() == "step 3"  # it checkpointed, and the second place resumed it
    assert 0 < first["actual_micro"] < first["reserved_micro"]  # paid only for what it ran
    assert again["requested_at"] >= first["settled_at"]  # placed again once settled
    assert result.outcome == "completed" and result.job_id == again["id"]
    assert len(result.placements) == 2
    assert result.placements[0].startswith("local:h100a on-demand: preempted, $")
    assert result.placements[1].startswith("local:h100b on-demand: completed, $")


def _spot_history(ledger: Ledger, scope: str, billed: float, jobs: int = 3) -> None:
    """`jobs` earlier SageMaker managed spot jobs, each billed `billed` of the time it trained:
    the history that makes spot the cheaper SageMaker offering (its rate is on-demand's)."""
    from prefect_gpu_budget.admission.gate import Gate

    gate = Gate(ledger)
    for n in range(jobs):
        job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", provisioning="spot", max_runtime="1h")
        admission = gate.admit(job, scope, launcher="sagemaker")
        start = time.time()
        gate.holding.started(admission, start, f"earlier-{n}")
        gate.holding.settle(
            admission, ended_at=start + 600, outcome="completed", billed_seconds=600 * billed
        )


ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1.4"


@pytest.mark.timeout(300)
def test_a_spot_job_the_cloud_takes_back_is_placed_again(prefect_api, tmp_path):
    """SageMaker managed spot, on the stand-in cloud: the first place is taken back and not
    resumed within its wait (`interrupted`), is settled for its billable seconds, and the job
    is placed again through the gate and completes."""
    from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher
    from tests.support.aws_server import AwsServer

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_budget(BudgetRule("acme/b"))
    _spot_history(ledger, "acme/b/history", billed=0.3)
    asked = GpuJob(
        accelerators="A10G:1",
        checkpoint="s3://lab-models/checkpoints/trainer",
        max_runtime="3s",
        name="trainer",
    )
    with AwsServer() as aws:
        aws.set_training_pace(0.3)
        aws.behaviour.interruptions["trainer-"] = 1
        launcher = SageMakerLauncher(
            aws_credentials=aws.credentials("us-east-1"),
            role_arn=ROLE,
            image_uri=IMAGE,
            output_s3_uri="s3://lab-models/out",
            checkpoint_s3_uri="s3://lab-models/checkpoints",
            spot_max_wait=1,
            poll_s=0.05,
        )

        @flow
        def train():
            return run_gpu_job(asked, "acme/b/s", SpendLedger(database_url=url), launcher=launcher)

        result = train()
        described = aws.credentials().get_client("sagemaker").describe_training_job

        ran = [r for r in ledger.views.jobs() if r["scope"] == "acme/b/s"]
        rows = sorted(ran, key=lambda r: r["requested_at"])
        assert [(r["instance_type"], r["provisioning"], r["outcome"]) for r in rows] == [
            ("sagemaker:ml.g5.xlarge", "spot", "interrupted"),
            ("sagemaker:ml.g5.xlarge", "spot", "completed"),
        ]
        first, again = rows
        billed = described(TrainingJobName=first["external_id"])["BillableTimeInSeconds"]
        assert first["billed_seconds"] == billed
        assert 0 < first["actual_micro"] <= first["reserved_micro"]
        assert again["requested_at"] >= first["settled_at"]  # placed again once settled
    assert result.outcome == "completed" and result.job_id == again["id"]
    assert [p.split(":")[0] for p in result.placements] == ["sagemaker", "sagemaker"]
    assert "spot: interrupted, $" in result.placements[0]
    assert "spot: completed, $" in result.placements[1]


@pytest.mark.timeout(300)
def test_a_spot_vm_vertex_takes_back_is_placed_again(prefect_api, tmp_path, monkeypatch):
    """Vertex AI, on the stand-in: spot is the cheapest A100 offering; its first job fails with
    a STOCKOUT after it started (`interrupted`), is billed for what ran, and the job is placed
    again through the gate and completes."""
    from prefect_gcp import GcpCredentials

    from prefect_gpu_budget.launchers.vertex import VertexLauncher
    from tests.launchers.fake_vertex import RESOURCE_EXHAUSTED, FakeVertex, Script
    from tests.support.gcp_server import service_account_info, serving

    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(tmp_path / "none.csv"))  # shipped only
    default_catalog.cache_clear()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    ledger.config.set_budget(BudgetRule("acme/b"))
    asked = GpuJob(
        accelerators="A100:1",
        checkpoint="gs://lab/ckpt/trainer",
        max_runtime="1m",
        expected_runtime="1s",
        name="trainer",
    )
    info, public_key = service_account_info()
    stockout = "Spot VM preempted (STOCKOUT)."
    taken = Script(
        run_s=0.4, final="JOB_STATE_FAILED", error=stockout, error_code=RESOURCE_EXHAUSTED
    )
    with serving(FakeVertex(public_key=public_key, scripts=[taken])) as fake:
        launcher = VertexLauncher(
            gcp_credentials=GcpCredentials(service_account_info=info),
            image_uri="us-docker.pkg.dev/lab/trainer:1",
            api_endpoint=fake.url,
            poll_s=0.05,
        )

        @flow
        def train():
            return run_gpu_job(asked, "acme/b/s", SpendLedger(database_url=url), launcher=launcher)

        result = train()
        strategies = [body["jobSpec"]["scheduling"].get("strategy") for body in fake.created]
    default_catalog.cache_clear()

    rows = sorted(ledger.views.jobs("acme/b/s"), key=lambda r: r["requested_at"])
    assert [(r["instance_type"], r["provisioning"], r["outcome"]) for r in rows] == [
        ("gcp:a2-highgpu-1g", "spot", "interrupted"),
        ("gcp:a2-highgpu-1g", "spot", "completed"),
    ]
    assert len(strategies) == 2 and all(s in ("SPOT", 4) for s in strategies)
    first, again = rows
    assert first["ended_at"] - first["started_at"] == pytest.approx(0.4, abs=1e-3)
    assert 0 < first["actual_micro"] < first["reserved_micro"]
    assert again["requested_at"] >= first["settled_at"]
    assert result.outcome == "completed" and result.job_id == again["id"]
    assert result.placements[0].startswith("gcp:a2-highgpu-1g spot: interrupted, $")

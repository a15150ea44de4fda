"""The gate's race, with a cloud launcher in the loop: processes admit SageMaker training jobs
(on loopback AWS) against one capped budget, run them, and settle from what SageMaker billed."""

from __future__ import annotations

import multiprocessing

import pytest

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.support.aws_server import AwsServer

CAP_CENTS = 300  # ml.g5.xlarge is 141 cents an hour: two at once
PROCESSES, JOBS = 6, 2


def _agent(url: str, aws_url: str, index: int) -> None:
    from prefect_aws import AwsCredentials

    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher

    launcher = SageMakerLauncher(
        aws_credentials=AwsCredentials(
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
            aws_client_parameters={"endpoint_url": aws_url},
        ),
        role_arn="arn:aws:iam::123456789012:role/Training",
        image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1",
        output_s3_uri="s3://lab/out",
        poll_s=0.05,
    )
    gate = Gate(Ledger(url), poll_s=0.02)
    for i in range(JOBS):
        job = GpuJob(
            instance_type="sagemaker:ml.g5.xlarge", max_runtime="10m", name=f"a{index}-{i}"
        )
        quote = gate.quote(job)
        launcher.preflight(job, quote)
        admission = gate.admit(job, f"lab/race/agent-{index}", launcher="sagemaker")
        result = launcher.run(
            job,
            quote,
            on_start=lambda started, name, a=admission: gate.holding.started(a, started, name),
            on_submit=lambda name, a=admission: gate.holding.submitted(a, name),
            log=lambda line: None,
        )
        gate.holding.settle(
            admission,
            ended_at=result.ended_at,
            outcome=result.outcome,
            billed_seconds=result.billed_seconds,
            actual_micro=result.actual_micro,
        )


@pytest.mark.timeout(600)
def test_racing_agents_with_sagemaker_never_over_admit(ledger_url):
    ledger = Ledger(ledger_url)
    ledger.config.set_budget(
        BudgetRule("lab", hourly_cap_cents=CAP_CENTS, period_budget_micro=10**9)
    )
    ledger.config.set_budget(BudgetRule("lab/race"))  # the agents' team; the org's cap binds
    with AwsServer() as aws:
        aws.set_training_pace(0.2)
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_agent, args=(ledger_url, aws.url, i)) for i in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=500)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        names = {
            j["TrainingJobName"]
            for page in launcher_pages(aws)
            for j in page["TrainingJobSummaries"]
        }

    rows = ledger.views.jobs()
    assert len(rows) == PROCESSES * JOBS and all(r["state"] == "settled" for r in rows)
    assert {r["external_id"] for r in rows} == names  # one training job per admission
    assert all(r["outcome"] == "completed" and r["billed_seconds"] > 0 for r in rows)
    for moment in sorted(r["admitted_at"] for r in rows):
        live = [r for r in rows if r["admitted_at"] <= moment < r["settled_at"]]
        assert sum(r["rate_cents"] for r in live) <= CAP_CENTS, moment
    assert (
        max(
            len([r for r in rows if r["admitted_at"] <= m < r["settled_at"]])
            for m in (r["admitted_at"] for r in rows)
        )
        == 2
    )  # the cap was reached: the race was real


def launcher_pages(aws: AwsServer) -> list[dict]:
    import boto3

    client = boto3.client(
        "sagemaker",
        region_name="us-east-1",
        endpoint_url=aws.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return list(client.get_paginator("list_training_jobs").paginate())

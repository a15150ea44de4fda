"""The SageMaker launcher against moto in server mode (with the training-job life moto lacks, from
tests/support/aws_server.py), through a real gate on a SQLite ledger."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import JOB_MARK
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError, Launcher, LaunchResult
from prefect_gpu_budget.launchers.bill_mark import BILL_MARK, sagemaker_tag_problem
from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher
from prefect_gpu_budget.pricing.catalog import SHIPPED, Catalog, read_price_file
from prefect_gpu_budget.settings import JOB_ID_ENV
from prefect_gpu_budget.units import usd_to_micro
from tests.support.aws_server import AwsServer

ROLE = "arn:aws:iam::123456789012:role/SageMakerTraining"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1.4"
SCOPE = "lab/vision/agent-7"
NAME_RULE = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # botocore's TrainingJobName pattern


@pytest.fixture(scope="module")
def server() -> Iterator[AwsServer]:
    with AwsServer() as running:
        yield running


@pytest.fixture
def aws(server: AwsServer) -> Iterator[AwsServer]:
    server.set_training_pace(0.3)
    yield server
    server.reset()


def _catalog() -> Catalog:
    """The shipped prices, plus two rows for settings SageMaker refuses."""
    shipped = read_price_file(SHIPPED)
    g5 = next(r for r in shipped if r.key == "sagemaker:ml.g5.xlarge")
    return Catalog(
        [
            *shipped,
            replace(g5, instance_type="ml.g99.xlarge"),
            replace(g5, provisioning="flex-start"),
        ]
    )


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    ledger = Ledger(f"sqlite:///{tmp_path}/l.db")
    ledger.config.set_budget(
        BudgetRule("lab", hourly_cap_cents=5_000, period_budget_micro=100_000_000)
    )
    ledger.config.set_budget(BudgetRule("lab/vision"))  # SCOPE's team exists; the org's limits bind
    yield Gate(ledger, catalog=_catalog())
    ledger.db.dispose()


def _launcher(aws: AwsServer, region: str = "us-east-1", **fields: Any) -> SageMakerLauncher:
    settings: dict[str, Any] = {
        "aws_credentials": aws.credentials(region),
        "role_arn": ROLE,
        "image_uri": IMAGE,
        "output_s3_uri": "s3://lab-models/out",
        "checkpoint_s3_uri": "s3://lab-models/checkpoints",
        "spot_max_wait": 1800,
        "poll_s": 0.05,
    }
    return SageMakerLauncher(**{**settings, **fields})


class Run:
    """One job through the gate as the Prefect task runs it: preflight, admit, run, settle."""

    def __init__(self, gate: Gate, launcher: SageMakerLauncher, job: GpuJob) -> None:
        self.gate, self.launcher, self.job = gate, launcher, job
        self.logs: list[str] = []
        self.starts: list[tuple[float, str]] = []
        self.result: LaunchResult | None = None
        self.job_id: str | None = None

    def __call__(
        self, env: dict[str, str] | None = None, log: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        quote = self.gate.quote(self.job)
        self.launcher.preflight(self.job, quote)
        admission = self.gate.admit(self.job, SCOPE, launcher=self.launcher.kind)
        self.job_id = admission.job_id

        def on_start(started_at: float, external_id: str) -> None:
            self.starts.append((started_at, external_id))
            self.gate.holding.started(admission, started_at, external_id)

        try:
            self.result = self.launcher.run(
                self.job, quote, on_start=on_start, log=log or self.logs.append, env=env
            )
        except BaseException:
            self.gate.holding.settle(admission, ended_at=time.time(), outcome="cancelled")
            raise
        self.gate.holding.settle(
            admission,
            ended_at=self.result.ended_at,
            outcome=self.result.outcome,
            billed_seconds=self.result.billed_seconds,
            actual_micro=self.result.actual_micro,
        )
        return self.gate.ledger.views.job(admission.job_id)


def _described(aws: AwsServer, name: str) -> dict[str, Any]:
    return aws.credentials().get_client("sagemaker").describe_training_job(TrainingJobName=name)


def _tags(aws: AwsServer, name: str) -> list[dict[str, str]]:
    """The tags SageMaker holds for the training job `name`."""
    arn = _described(aws, name)["TrainingJobArn"]
    return aws.credentials().get_client("sagemaker").list_tags(ResourceArn=arn)["Tags"]


def _cost(billed_s: int, rate_micro_per_hour: int) -> int:
    """What the launcher must charge: billed seconds x rate, rounded up to a micro-dollar."""
    return -(-billed_s * rate_micro_per_hour // 3600)


def _shipped_usd(key: str, provisioning: str = "on-demand") -> Decimal:
    return next(
        r.usd_per_hour
        for r in read_price_file(SHIPPED)
        if (r.key, r.provisioning) == (key, provisioning)
    )


def test_the_job_is_created_as_asked_and_settled_from_billable_time(
    aws: AwsServer, gate: Gate
) -> None:
    job = GpuJob(
        instance_type="sagemaker:ml.g5.xlarge",
        nodes=2,
        max_runtime="10m",
        command=["python", "train.py", "--lr", "0.1"],
        env={"SEED": "7"},
        name="lr sweep/1",
    )
    run = Run(gate, _launcher(aws), job)
    row = run(env={"RUN_ID": "abc"})

    name = row["external_id"]
    assert NAME_RULE.fullmatch(name) and len(name) <= 63 and name.startswith("lr-sweep-1-")
    spec = _described(aws, name)
    assert spec["ResourceConfig"]["InstanceType"] == "ml.g5.xlarge"
    assert spec["ResourceConfig"]["InstanceCount"] == 2
    assert spec["StoppingCondition"] == {"MaxRuntimeInSeconds": 600}
    assert not spec["EnableManagedSpotTraining"]
    assert spec["RoleArn"] == ROLE
    assert spec["AlgorithmSpecification"]["TrainingImage"] == IMAGE
    assert spec["AlgorithmSpecification"]["ContainerEntrypoint"] == ["python"]
    assert spec["AlgorithmSpecification"]["ContainerArguments"] == ["train.py", "--lr", "0.1"]
    assert spec["Environment"] == {"SEED": "7", "RUN_ID": "abc"}
    assert spec["OutputDataConfig"]["S3OutputPath"] == "s3://lab-models/out"
    assert spec["TrainingJobStatus"] == "Completed"
    assert _tags(aws, name) == []  # run without a ledger job id in its env: no mark

    billed = spec["BillableTimeInSeconds"]
    assert run.starts == [(spec["TrainingStartTime"].timestamp(), name)]
    assert run.result is not None and run.result.outcome == "completed"
    assert run.result.ended_at == spec["TrainingEndTime"].timestamp()
    assert row["launcher"] == "sagemaker" and row["outcome"] == "completed"
    assert row["rate_micro_per_hour"] == 2 * usd_to_micro(_shipped_usd("sagemaker:ml.g5.xlarge"))
    assert row["started_at"] == spec["TrainingStartTime"].timestamp()
    assert row["billed_seconds"] == billed > 0
    assert row["actual_micro"] == _cost(billed, row["rate_micro_per_hour"])
    assert 0 < row["actual_micro"] < row["reserved_micro"]
    said = [line for line in run.logs if name in line]
    assert any("(Training)" in line for line in said) and "(Completed)" in said[-1]


def test_a_gated_training_job_is_tagged_with_its_ledger_job_id(aws: AwsServer, gate: Gate) -> None:
    """Run through the gate (`run_admitted`), the training job carries the tag
    gpu-budget-job=<ledger job id> that the bill is matched by; its name, the ledger's external
    id, stays the fallback key; the job's own environment gets the id too."""
    launcher = _launcher(aws)
    job = GpuJob(instance_type=G5, max_runtime="10m", env={"SEED": "7"})
    launcher.preflight(job, gate.quote(job))
    admission = gate.admit(job, SCOPE, launcher=launcher.kind)
    ended = run_admitted(gate, admission, launcher, env={"RUN_ID": "abc"})

    row = ended.row
    assert row["id"] == admission.job_id and row["outcome"] == "completed"
    name = row["external_id"]
    assert _tags(aws, name) == [{"Key": "gpu-budget-job", "Value": row["id"]}]
    assert BILL_MARK == JOB_MARK  # the key the bill readers look for
    environment = _described(aws, name)["Environment"]
    assert environment == {"SEED": "7", "RUN_ID": "abc", JOB_ID_ENV: admission.job_id}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("job#7", "holds '#', which a SageMaker tag cannot"),
        ("a" * 257, "longer than a SageMaker tag value's 256 characters"),
    ],
)
def test_a_job_id_sagemaker_would_refuse_as_a_tag_is_a_launch_error(
    aws: AwsServer, gate: Gate, value: str, problem: str
) -> None:
    job = GpuJob(instance_type=G5, max_runtime="10m")
    result = _launcher(aws).run(
        job, gate.quote(job), on_start=lambda *a: None, log=print, env={JOB_ID_ENV: value}
    )
    assert result.outcome == "launch_error" and problem in result.detail
    assert "\n" not in result.detail
    listed = aws.credentials().get_client("sagemaker").list_training_jobs()
    assert listed["TrainingJobSummaries"] == []


def test_sagemakers_tag_value_rule() -> None:
    """Letters, separators and numbers of any script, and `_.:/=+-@`, up to 256."""
    for good in ["7f1c2d3e-0000-4000-8000-000000000001", "Ünï côde ٣ _.:/=+-@", "a" * 256]:
        assert sagemaker_tag_problem(good) is None, good
    assert sagemaker_tag_problem(None) is None
    for bad in ["a,b", "a;b", "a\nb", "a*b", "a" * 257]:
        assert sagemaker_tag_problem(bad) is not None, bad


def test_a_spot_job_is_billed_less_than_it_trained_and_than_its_reservation(
    aws: AwsServer, gate: Gate
) -> None:
    aws.set_training_pace(0.5)  # long enough to train for 2 s or more
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", provisioning="spot", max_runtime="10m")
    run = Run(gate, _launcher(aws), job)
    row = run()

    spec = _described(aws, row["external_id"])
    assert spec["EnableManagedSpotTraining"]
    assert spec["StoppingCondition"] == {"MaxRuntimeInSeconds": 600, "MaxWaitTimeInSeconds": 2400}
    assert spec["CheckpointConfig"]["S3Uri"] == "s3://lab-models/checkpoints"
    billed, trained = spec["BillableTimeInSeconds"], spec["TrainingTimeInSeconds"]
    assert billed < trained
    assert row["billed_seconds"] == billed
    assert row["actual_micro"] == _cost(billed, row["rate_micro_per_hour"])
    assert row["actual_micro"] < _cost(trained, row["rate_micro_per_hour"])
    assert row["actual_micro"] < row["reserved_micro"]


def test_cancelling_the_run_stops_the_training_job(aws: AwsServer, gate: Gate) -> None:
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="10m", name="cancel-me")
    run = Run(gate, _launcher(aws), job)

    def log(line: str) -> None:
        run.logs.append(line)
        if "(Training)" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(log=log)

    [(_, name)] = run.starts
    assert aws.behaviour.stop_calls == [name]
    deadline = time.monotonic() + 10
    while (spec := _described(aws, name))["TrainingJobStatus"] != "Stopped":
        assert time.monotonic() < deadline, f"still {spec['TrainingJobStatus']}"
        time.sleep(0.05)
    assert gate.ledger.views.job(run.job_id)["state"] == "settled"


def test_stop_and_probe_answer_for_reconcile(aws: AwsServer, gate: Gate) -> None:
    launcher = _launcher(aws)
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="10m")
    run = Run(gate, launcher, job)
    rows: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: rows.append(run()))
    worker.start()
    deadline = time.monotonic() + 10
    while not run.starts:
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.02)
    [(started_at, name)] = run.starts

    running = launcher.probe(name)
    assert (running.state, running.started_at) == ("running", started_at)
    launcher.stop(name, grace=10)
    worker.join(timeout=10)

    spec = _described(aws, name)
    assert spec["TrainingJobStatus"] == "Stopped"
    finished = launcher.probe(name)
    assert finished.state == "finished"
    assert finished.started_at == started_at
    assert finished.ended_at == spec["TrainingEndTime"].timestamp()
    assert finished.billed_seconds == spec["BillableTimeInSeconds"]
    [row] = rows
    assert row["outcome"] == "cancelled" and row["billed_seconds"] == finished.billed_seconds
    assert row["actual_micro"] == _cost(spec["BillableTimeInSeconds"], row["rate_micro_per_hour"])
    assert launcher.probe("no-such-training-job").state == "unknown"
    launcher.stop(name)  # stopping an ended job is a no-op


def test_sagemaker_stopping_it_at_max_runtime_is_a_time_out(aws: AwsServer, gate: Gate) -> None:
    aws.set_training_pace(0.5)
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="1s", kill_grace="5s")
    run = Run(gate, _launcher(aws), job)
    row = run()

    spec = _described(aws, row["external_id"])
    assert (spec["TrainingJobStatus"], spec["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert aws.behaviour.stop_calls == []
    assert row["outcome"] == "timed_out"
    assert row["billed_seconds"] == spec["BillableTimeInSeconds"] == 1
    assert row["actual_micro"] <= row["reserved_micro"]


def test_a_job_the_cloud_fails_to_stop_is_stopped_at_max_runtime_plus_grace(
    aws: AwsServer, gate: Gate
) -> None:
    aws.set_training_pace(1.0)
    aws.behaviour.enforce_max_runtime = False
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="1s", kill_grace="0.5s")
    run = Run(gate, _launcher(aws), job)
    row = run()

    name = row["external_id"]
    spec = _described(aws, name)
    assert aws.behaviour.stop_calls == [name]
    assert (spec["TrainingJobStatus"], spec["SecondaryStatus"]) == ("Stopped", "Stopped")
    assert row["outcome"] == "timed_out"
    assert row["billed_seconds"] == spec["BillableTimeInSeconds"]


def test_a_failed_job_says_why(aws: AwsServer, gate: Gate) -> None:
    aws.behaviour.failures["oom-"] = "AlgorithmError: CUDA out of memory\nTraceback (most recent..."
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="10m", name="oom")
    run = Run(gate, _launcher(aws), job)
    row = run()

    assert run.result is not None
    assert run.result.outcome == row["outcome"] == "failed"
    assert run.result.detail == "AlgorithmError: CUDA out of memory"
    spec = _described(aws, row["external_id"])
    assert row["actual_micro"] == _cost(spec["BillableTimeInSeconds"], row["rate_micro_per_hour"])


def test_a_spot_job_taken_back_and_not_resumed_in_its_wait_is_interrupted(
    aws: AwsServer, gate: Gate
) -> None:
    """SageMaker resumes an interrupted managed spot job by itself while MaxWaitTimeInSeconds
    allows; one that ends at that wait after starting lost its machine: `interrupted`, billed
    SageMaker's billable seconds, never `timed_out` (it did not run its max_runtime)."""
    aws.behaviour.interruptions["taken-"] = 1
    launcher = _launcher(aws, spot_max_wait=1)
    job = GpuJob(instance_type=G5, provisioning="spot", max_runtime="2s", name="taken")
    run = Run(gate, launcher, job)
    row = run()

    spec = _described(aws, row["external_id"])
    steps = [step["Status"] for step in spec["SecondaryStatusTransitions"]]
    assert "Interrupted" in steps and spec["SecondaryStatus"] == "MaxWaitTimeExceeded"
    assert run.result is not None and run.result.outcome == row["outcome"] == "interrupted"
    assert row["billed_seconds"] == spec["BillableTimeInSeconds"]
    assert row["actual_micro"] == _cost(spec["BillableTimeInSeconds"], row["rate_micro_per_hour"])
    assert row["actual_micro"] <= row["reserved_micro"]

    again = Run(gate, launcher, job)()  # the next such job is not taken back
    assert again["outcome"] == "completed"


def test_an_on_demand_job_that_fails_is_never_called_interrupted(
    aws: AwsServer, gate: Gate
) -> None:
    aws.behaviour.interruptions["steady-"] = 1  # only spot jobs are taken back
    aws.behaviour.failures["steady-"] = "AlgorithmError: exit 1"
    job = GpuJob(instance_type=G5, max_runtime="10m", name="steady")
    assert Run(gate, _launcher(aws), job)()["outcome"] == "failed"


G5 = "sagemaker:ml.g5.xlarge"


@pytest.mark.parametrize(
    ("settings", "job", "reason"),
    [
        ({"role_arn": None}, {}, "role_arn is required"),
        ({"role_arn": "SageMakerTraining"}, {}, "role_arn must look like arn:aws:iam::"),
        ({"region": "mars-east-1"}, {}, "region 'mars-east-1' has no SageMaker endpoint"),
        ({}, {"instance_type": "aws:g5.xlarge"}, "instance_type must be 'sagemaker:ml.<type>'"),
        ({}, {"instance_type": "sagemaker:ml.g99.xlarge"}, "does not offer instance type"),
        ({}, {"provisioning": "flex-start"}, "no flex-start"),
        ({"image_uri": None}, {}, "image_uri is required"),
        ({"output_s3_uri": "lab-models/out"}, {}, "output_s3_uri must be an S3 URI"),
        ({"checkpoint_s3_uri": None}, {"provisioning": "spot"}, "spot jobs need checkpoint_s3_uri"),
        ({}, {"env": {"BAD-NAME": "1"}}, "env: 'BAD-NAME' is not a valid"),
        ({}, {"vcpu": 2}, "gpus: SageMaker training runs whole instances"),
        (
            {},
            {"max_runtime": "29d"},
            "max_runtime: SageMaker runs a training job at most 28 days (MaxRuntimeInSeconds "
            "2,419,200), got 2,505,600s",
        ),
    ],
)
def test_wrong_settings_fail_before_anything_is_reserved_or_created(
    aws: AwsServer, gate: Gate, settings: dict[str, Any], job: dict[str, Any], reason: str
) -> None:
    launcher = _launcher(aws, **settings)
    bad = GpuJob(**{"instance_type": G5, "max_runtime": "10m", **job})
    with pytest.raises(LaunchConfigError) as raised:
        Run(gate, launcher, bad)()
    message = str(raised.value)
    assert "\n" not in message and message.startswith("sagemaker launcher: ")
    assert reason in message
    assert (
        aws.credentials().get_client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
    )
    assert gate.ledger.views.jobs() == []


def test_the_longest_training_job_is_28_days(aws: AwsServer, gate: Gate) -> None:
    launcher = _launcher(aws)
    longest = GpuJob(instance_type=G5, max_runtime="28d")
    launcher.preflight(longest, gate.quote(longest))
    assert launcher.training_job_request(longest, "n")["StoppingCondition"] == {
        "MaxRuntimeInSeconds": 2_419_200
    }
    past = GpuJob(instance_type=G5, max_runtime=2_419_200.5)  # a part of a second is a second
    with pytest.raises(LaunchConfigError, match=r"got 2,419,201s$"):
        launcher.preflight(past, gate.quote(past))


def test_training_job_names_are_valid_and_unique() -> None:
    names = [
        SageMakerLauncher.training_job_name(GpuJob(instance_type=G5, max_runtime=60, name=n))
        for n in [None, "Ünïcode run!!", "-" * 30, "x" * 200, "a b/c_d.e"]
    ]
    names.append(SageMakerLauncher.training_job_name(GpuJob(instance_type=G5, max_runtime=60)))
    for name in names:
        assert NAME_RULE.fullmatch(name) and len(name) <= 63, name
    assert len(set(names)) == len(names)


def test_it_is_a_launcher() -> None:
    assert isinstance(SageMakerLauncher(), Launcher)


def test_a_start_the_ledger_cannot_record_in_time_stops_the_job(aws: AwsServer, gate: Gate) -> None:
    """A stalled ledger (an `on_start` that takes 6 s) does not hold up the launcher: once
    the kill grace has passed with the start unrecorded, the training job is stopped."""
    aws.set_training_pace(1.0)
    aws.behaviour.enforce_max_runtime = False
    job = GpuJob(instance_type="sagemaker:ml.g5.xlarge", max_runtime="30s", kill_grace="1s")
    told: list[float] = []
    stopped_by_then: list[list[str]] = []

    def stalled(at: float, name: str) -> None:
        time.sleep(6)
        stopped_by_then.append(list(aws.behaviour.stop_calls))
        told.append(at)

    launched = time.monotonic()
    result = _launcher(aws).run(job, gate.quote(job), on_start=stalled, log=print)
    assert result.outcome == "cancelled" and "could not be recorded" in result.detail, result
    assert aws.behaviour.stop_calls == [result.external_id]
    # stopped at the grace, while the start was still being recorded: not after the stall
    assert stopped_by_then == [[result.external_id]]
    assert time.monotonic() - launched < 30  # not at max_runtime either
    assert told == [result.started_at]

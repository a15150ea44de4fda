"""SageMaker launcher: one GPU job as one SageMaker training job.

Credentials and region come from prefect-aws's `AwsCredentials` block; its
`aws_client_parameters.endpoint_url` points the client at another endpoint when one is set.

Every training job is tagged `gpu-budget-job=<ledger job id>` (`launchers/bill_mark.py`), so that
the bill (CUR 2.0's `resource_tags`, once the tag is activated for cost allocation) can be matched
to the ledger; its TrainingJobName, the ledger's external id, is the fallback key.

Money: SageMaker reports `BillableTimeInSeconds`, the wall-clock seconds it bills for each
instance, so a job costs billable seconds x the quote's rate (which is already x the instance
count). Managed spot bills the on-demand rate for fewer billable seconds than the job trained, so
the catalog's `sagemaker` spot rows carry the on-demand price: the gate reserves the worst case
and a spot job's saving shows up as an actual cost below its reservation.
"""

from __future__ import annotations

import contextlib
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import boto3
from botocore.exceptions import BotoCoreError, ClientError, ProfileNotFound
from prefect.blocks.core import Block
from prefect_aws import AwsCredentials
from pydantic import Field

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    LaunchResult,
    Probe,
    StartHook,
    SubmitHook,
    ignore_submission,
)
from prefect_gpu_budget.launchers.bill_mark import BILL_MARK, ledger_job_id, sagemaker_tag_problem
from prefect_gpu_budget.launchers.follow import Remote, Retry, Seen, Start, Stop, follow, wait_over
from prefect_gpu_budget.launchers.sagemaker_checks import (
    check_container,
    check_job,
    check_region,
    check_role_and_image,
    check_s3,
    runtime_s,
)
from prefect_gpu_budget.launchers.sagemaker_outcome import (
    FINISHED,
    epoch,
    one_line,
    status_message,
    training_job_result,
)
from prefect_gpu_budget.pricing.catalog import Quote

NAME_PART = re.compile(r"[^a-zA-Z0-9]+")
MAX_DESCRIBE_ERRORS = 20
"""Consecutive failed DescribeTrainingJob calls after which `run` stops the job and gives up."""


class SageMakerLauncher(Block):
    """Runs a GPU job as a SageMaker training job, stopped at the job's max_runtime.

    The job's `instance_type` is `sagemaker:<ml instance type>` (e.g. `sagemaker:ml.g5.xlarge`),
    `nodes` is the instance count, `command` becomes the container's entrypoint and arguments and
    `env` its environment. `provisioning="spot"` uses managed spot training with checkpoints.
    The job is settled from SageMaker's BillableTimeInSeconds. A job run through the gate is
    tagged `gpu-budget-job=<its ledger job id>`, which the bill carries once the tag is
    activated for cost allocation.

    Example:
        ```python
        from prefect_gpu_budget.launchers.sagemaker import SageMakerLauncher

        launcher = SageMakerLauncher.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "SageMaker GPU Launcher"
    _block_type_slug = "sagemaker-gpu-launcher"
    _logo_url = "https://cdn.sanity.io/images/3ugk85nk/production/d74b16fe84ce626345adf235a47008fea2869a60-225x225.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = (
        "Runs admitted GPU jobs as SageMaker training jobs and settles their billed time."
    )

    kind: ClassVar[str] = "sagemaker"

    aws_credentials: AwsCredentials = Field(
        default_factory=AwsCredentials,
        description="AWS credentials and region; an endpoint_url in its client parameters is used.",
    )
    role_arn: str | None = Field(
        default=None, description="IAM role that SageMaker assumes to run the training job."
    )
    image_uri: str | None = Field(
        default=None, description="Training container image, e.g. an ECR image URI."
    )
    output_s3_uri: str | None = Field(
        default=None, description="S3 URI under which SageMaker writes the job's output."
    )
    checkpoint_s3_uri: str | None = Field(
        default=None,
        description="S3 URI for checkpoints; required for spot, so an interrupted job resumes.",
    )
    spot_max_wait: int = Field(
        default=3600,
        ge=0,
        description="Seconds a spot job may wait for capacity beyond its max_runtime.",
    )
    volume_size_gb: int = Field(
        default=50, ge=1, description="Size of each instance's training volume, in GB."
    )
    poll_s: float = Field(
        default=10.0, gt=0, description="Seconds between DescribeTrainingJob calls."
    )

    # -- settings --------------------------------------------------------------------------------

    def _fail(self, reason: str) -> LaunchConfigError:
        return LaunchConfigError(self.kind, reason)

    def region(self) -> str:
        """The region jobs run in: the credentials block's, else the AWS profile or environment."""
        name = self.aws_credentials.region_name
        if not name:
            try:
                name = boto3.Session(profile_name=self.aws_credentials.profile_name).region_name
            except ProfileNotFound as exc:
                raise self._fail(f"aws_credentials: {one_line(exc)}") from None
        if not name:
            raise self._fail("no AWS region: set region_name on the AwsCredentials block")
        return name

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        """Raise LaunchConfigError with a one-line reason if the job cannot launch as set up.

        Reads only local settings and botocore's data: nothing is called or created on AWS.
        """
        check_job(job, quote)
        check_region(self.region())
        check_role_and_image(self.role_arn, self.image_uri)
        check_s3("output_s3_uri", self.output_s3_uri, required=True)
        check_s3("checkpoint_s3_uri", self.checkpoint_s3_uri, required=False)
        if job.provisioning == "spot" and not self.checkpoint_s3_uri:
            raise self._fail(
                "spot jobs need checkpoint_s3_uri: an interrupted spot job resumes from it"
            )
        check_container(job.command, job.env)

    # -- the request -----------------------------------------------------------------------------

    @staticmethod
    def training_job_name(job: GpuJob) -> str:
        """A fresh, valid training-job name: the job's name, a UTC stamp and a random suffix."""
        base = NAME_PART.sub("-", job.name or "gpu-budget").strip("-")[:40] or "gpu-budget"
        return f"{base}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"

    def training_job_request(
        self, job: GpuJob, name: str, env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The CreateTrainingJob arguments for a job (after `preflight`); tagged with the
        ledger job id that `env` carries (`bill_mark`), if it carries one."""
        instance = job.instance_type.partition(":")[2]
        algorithm: dict[str, Any] = {"TrainingImage": self.image_uri, "TrainingInputMode": "File"}
        if job.command:
            algorithm["ContainerEntrypoint"] = job.command[:1]
            if job.command[1:]:
                algorithm["ContainerArguments"] = job.command[1:]
        max_runtime = runtime_s(job)
        stopping: dict[str, int] = {"MaxRuntimeInSeconds": max_runtime}
        request: dict[str, Any] = {
            "TrainingJobName": name,
            "RoleArn": self.role_arn,
            "AlgorithmSpecification": algorithm,
            "OutputDataConfig": {"S3OutputPath": self.output_s3_uri},
            "ResourceConfig": {
                "InstanceType": instance,
                "InstanceCount": job.nodes,
                "VolumeSizeInGB": self.volume_size_gb,
            },
            "StoppingCondition": stopping,
        }
        environment = {**job.env, **(env or {})}
        if environment:
            request["Environment"] = environment
        if job.provisioning == "spot":
            request["EnableManagedSpotTraining"] = True
            stopping["MaxWaitTimeInSeconds"] = max_runtime + self.spot_max_wait
        if self.checkpoint_s3_uri:
            request["CheckpointConfig"] = {"S3Uri": self.checkpoint_s3_uri}
        job_id = ledger_job_id(env)
        if job_id is not None:
            request["Tags"] = [{"Key": BILL_MARK, "Value": job_id}]
        return request

    def _client(self) -> Any:
        return self.aws_credentials.get_client("sagemaker")

    # -- running ---------------------------------------------------------------------------------

    def run(
        self,
        job: GpuJob,
        quote: Quote,
        *,
        on_start: StartHook,
        log: Callable[[str], None],
        env: dict[str, str] | None = None,
        on_submit: SubmitHook = ignore_submission,
    ) -> LaunchResult:
        """Create the training job, follow it to its end and report what SageMaker billed.

        Any BaseException while it runs (cancellation, a failing callback) stops the training
        job before it is re-raised. If SageMaker has not ended the job by max_runtime plus the
        job's kill grace (spot: plus spot_max_wait), it is stopped from here.
        """
        try:
            self.preflight(job, quote)
            check_container(None, {**job.env, **(env or {})})
            problem = sagemaker_tag_problem(ledger_job_id(env))
            if problem is not None:
                raise self._fail(problem)
        except LaunchConfigError as exc:
            now = time.time()
            return LaunchResult("launch_error", now, now, detail=exc.reason)
        client = self._client()
        name = self.training_job_name(job)
        try:
            client.create_training_job(**self.training_job_request(job, name, env))
        except (ClientError, BotoCoreError) as exc:
            now = time.time()
            return LaunchResult("launch_error", now, now, detail=one_line(exc))
        except BaseException:  # interrupted mid-call: the job may exist
            self.stop_quietly(client, name, log)
            raise
        log(f"SageMaker training job {name} created ({quote.describe()})")
        try:
            on_submit(name)
            remote = _TrainingJob(self, client, job, quote, name, log)
            start = Start(on_start, name, job.kill_grace)
            retry = Retry((ClientError, BotoCoreError), give_up_after=MAX_DESCRIBE_ERRORS)
            return follow(remote, start, poll_s=self.poll_s, log=log, retry=retry)
        except BaseException:
            self.stop_quietly(client, name, log)
            raise

    def stop_quietly(self, client: Any, name: str, log: Callable[[str], None]) -> None:
        """StopTrainingJob; never raises (the job may have ended, or never been created)."""
        try:
            client.stop_training_job(TrainingJobName=name)
            note = "stop requested"
        except (ClientError, BotoCoreError) as exc:
            note = f"stop not needed or failed: {one_line(exc)}"
        with contextlib.suppress(Exception):  # a failing log must not hide the first error
            log(f"SageMaker training job {name}: {note}")

    # -- reconcile -------------------------------------------------------------------------------

    def probe(self, external_id: str) -> Probe:
        """Is the training job still billing, and when did it run?

        A finished job reports its billable seconds; the ledger prices them at the job's rate.
        """
        try:
            described = self._client().describe_training_job(TrainingJobName=external_id)
        except (ClientError, BotoCoreError):
            return Probe("unknown")
        start = epoch(described.get("TrainingStartTime"))
        if described["TrainingJobStatus"] not in FINISHED:
            return Probe("running", started_at=start)
        end = epoch(described.get("TrainingEndTime") or described.get("LastModifiedTime"))
        if start is None:
            return Probe("finished", started_at=end, ended_at=end, billed_seconds=0.0)
        billed = described.get("BillableTimeInSeconds")
        return Probe(
            "finished",
            started_at=start,
            ended_at=end,
            billed_seconds=float(billed) if billed is not None else None,
        )

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        """StopTrainingJob, then wait up to `grace` seconds for SageMaker to report it ended."""
        client = self._client()
        try:
            client.stop_training_job(TrainingJobName=external_id)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "ValidationException":
                return  # not running any more
            raise

        def over() -> bool:
            described = client.describe_training_job(TrainingJobName=external_id)
            return described["TrainingJobStatus"] in FINISHED

        wait_over(over, grace, self.poll_s)


@dataclass
class _TrainingJob(Remote[dict[str, Any]]):
    """A training job as `follow` reads and stops it."""

    launcher: SageMakerLauncher
    client: Any
    job: GpuJob
    quote: Quote
    job_name: str
    log: Callable[[str], None]

    def __post_init__(self) -> None:
        self.name = f"SageMaker training job {self.job_name}"
        self.began = time.time()  # a spot job's limit counts from here, started or not

    def read(self) -> Seen[dict[str, Any]]:
        described = self.client.describe_training_job(TrainingJobName=self.job_name)
        status, secondary = described["TrainingJobStatus"], described.get("SecondaryStatus", "")
        line = f"{self.name}: {status} ({secondary}){status_message(described)}"
        started = epoch(described.get("TrainingStartTime"))
        return Seen(described, (status, secondary), line, started, status in FINISHED)

    def limit(self, started: float | None) -> tuple[float, Stop] | None:
        """max_runtime plus kill grace from its start, if SageMaker has not ended it by then;
        a spot job's from its creation, plus spot_max_wait."""
        limit = math.ceil(self.job.max_runtime) + self.job.kill_grace
        if self.job.provisioning == "spot":
            return self.began + limit + self.launcher.spot_max_wait, _OVERRAN
        return None if started is None else (started + limit, _OVERRAN)

    def stop(self, stop: Stop) -> bool:
        self.log(f"{self.name}: {stop.why}")
        self.launcher.stop_quietly(self.client, self.job_name, self.log)
        return True  # asked once: it never raises

    def end(
        self, seen: Seen[dict[str, Any]], started: float | None, stopped: Stop | None, now: float
    ) -> LaunchResult | None:
        """What SageMaker billed, once it ended; `cancelled` (unless it completed) when it was
        stopped because its start could not be recorded."""
        if not seen.over:
            return None
        why = stopped.outcome if stopped else None
        result = training_job_result(seen.job, self.quote, stopped_here=why == "timed_out")
        if stopped is not None and why == "cancelled" and result.outcome != "completed":
            result = replace(result, outcome="cancelled", detail=stopped.why)
        return result


_OVERRAN = Stop("timed_out", "it passed max_runtime plus grace: stopping it")

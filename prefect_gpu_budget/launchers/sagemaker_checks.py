"""What SageMaker training accepts, checked before anything is called or created on AWS: the
instance types and regions it offers (from botocore's data), a job's shape and runtime, the role
and image it runs with, the S3 URIs it writes to, and the container's command and environment.
Each check raises a one-line `LaunchConfigError`."""

from __future__ import annotations

import math
import re

import botocore.session

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import shown

KIND = "sagemaker"
_MODEL = botocore.session.get_session().get_service_model("sagemaker")
TRAINING_INSTANCE_TYPES = frozenset(_MODEL.shape_for("TrainingInstanceType").enum)
"""The instance types CreateTrainingJob accepts, from botocore's SageMaker service model."""
SAGEMAKER_REGIONS = frozenset(
    region
    for partition in botocore.session.get_session().get_available_partitions()
    for region in botocore.session.get_session().get_available_regions("sagemaker", partition)
)
"""Regions with a SageMaker endpoint, from botocore's endpoint data."""
ROLE_ARN = re.compile(r"arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+")
S3_URI = re.compile(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/\S*)?")
ENV_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
MAX_RUNTIME_S = 28 * 86400
"""SageMaker's limit on a training job's StoppingCondition.MaxRuntimeInSeconds: 28 days."""


def refused(reason: str) -> LaunchConfigError:
    """The SageMaker launcher's one-line refusal."""
    return LaunchConfigError(KIND, reason)


def runtime_s(job: GpuJob) -> int:
    """The job's MaxRuntimeInSeconds: its max_runtime in whole seconds, rounded up."""
    return math.ceil(job.max_runtime)


def check_job(job: GpuJob, quote: Quote) -> None:
    """The job is a whole SageMaker training instance type, quoted as such, provisioned
    on-demand or spot, and runs at most SageMaker's 28 days."""
    cloud, _, instance = job.instance_type.partition(":")
    if cloud != "sagemaker" or not instance.startswith("ml."):
        raise refused(
            f"instance_type must be 'sagemaker:ml.<type>', got {shown(job.instance_type)}"
        )
    if instance not in TRAINING_INSTANCE_TYPES:
        raise refused(f"SageMaker training does not offer instance type {shown(instance)}")
    if not job.share_of(quote.row).whole:
        raise refused(
            "gpus: SageMaker training runs whole instances; a part of one (gpus, vcpu, "
            "memory_gib) is for a capacity pool's own machines"
        )
    if (quote.row.key, quote.row.provisioning) != (job.instance_type, job.provisioning):
        raise refused(f"the quote is for {quote.row.key} ({quote.row.provisioning}), not this job")
    if job.provisioning == "flex-start":
        raise refused("SageMaker training has no flex-start provisioning: use on-demand or spot")
    if runtime_s(job) > MAX_RUNTIME_S:
        raise refused(
            "max_runtime: SageMaker runs a training job at most 28 days "
            f"(MaxRuntimeInSeconds {MAX_RUNTIME_S:,}), got {runtime_s(job):,}s"
        )


def check_region(region: str) -> None:
    if region not in SAGEMAKER_REGIONS:
        raise refused(f"region {shown(region)} has no SageMaker endpoint")


def check_role_and_image(role_arn: str | None, image_uri: str | None) -> None:
    """An IAM role ARN for SageMaker to assume, and one training image URI."""
    if not role_arn:
        raise refused("role_arn is required: the IAM role SageMaker assumes to run the job")
    if not ROLE_ARN.fullmatch(role_arn):
        raise refused(
            f"role_arn must look like arn:aws:iam::<12-digit account>:role/<name>, "
            f"got {shown(role_arn)}"
        )
    if not image_uri:
        raise refused("image_uri is required: the training container image")
    if len(image_uri) > 255 or any(c.isspace() for c in image_uri):
        raise refused("image_uri must be one word of at most 255 characters")


def check_s3(name: str, uri: str | None, *, required: bool) -> None:
    """`uri` (the setting `name`) is an S3 URI, or unset where it is not `required`."""
    if uri is None and not required:
        return
    if not uri:
        raise refused(f"{name} is required: an S3 URI like s3://bucket/prefix")
    if len(uri) > 1024 or not S3_URI.fullmatch(uri):
        raise refused(f"{name} must be an S3 URI like s3://bucket/prefix, got {shown(uri)}")


def check_container(command: list[str] | None, env: dict[str, str]) -> None:
    """The container's command and environment fit SageMaker's limits."""
    if command and (len(command) > 101 or any(len(part) > 256 for part in command)):
        raise refused("command: SageMaker takes at most 100 arguments of 256 characters")
    if len(env) > 100:
        raise refused(f"env: SageMaker takes at most 100 variables, got {len(env)}")
    for key, value in env.items():
        if not ENV_KEY.fullmatch(key) or len(key) > 512:
            raise refused(f"env: {shown(key)} is not a valid environment variable name")
        if len(value) > 512:
            raise refused(f"env: the value of {key} is longer than 512 characters")

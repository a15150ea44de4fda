"""Vertex AI launcher: an admitted job runs as a Vertex AI custom job.

A job names a Compute Engine machine type, `gcp:<machine-type>` (the catalog prices GCP machines
under cloud `gcp`), e.g. `gcp:a3-highgpu-8g`. The launcher submits one CustomJob through
google-cloud-aiplatform with that machine type, the accelerator of the catalog row's GPU model
and its GPU count, `job.nodes` replicas that Vertex starts together (the primary replica in the
first worker pool, as Vertex requires, the others in a second pool of the same shape), the
scheduling strategy of the job's provisioning (on-demand STANDARD, spot SPOT, flex-start
FLEX_START with `maxWaitDuration`) and `scheduling.timeout` = the job's max_runtime, never a
default.

A job run through the gate carries the label `gpu-budget-job=<ledger job id>`
(`launchers/bill_mark.py`), which reaches the Cloud Billing export's `labels`, so that the bill
can be matched to the ledger.

google-cloud-aiplatform comes with the `vertex` extra and is imported when the launcher is used
(preflight, run, probe, stop): the block itself imports, registers and loads without it.

It polls the job, logs its state changes (and, while it waits for capacity, how long so far),
reports the start to the gate when Vertex sets the job's start time, and returns the real start
and end times. While a FLEX_START or SPOT job waits for capacity it holds its reservation but is
not billed; the wait comes back as `capacity_wait_s`. The job is cancelled when the run is
cancelled, and, as a backstop to Vertex's own timeout, when it runs past max_runtime.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar

from google.api_core import exceptions as api_errors
from google.auth import exceptions as auth_errors
from prefect.blocks.core import Block
from prefect_gcp import GcpCredentials
from pydantic import BeforeValidator, Field

from prefect_gpu_budget.job import GpuJob, check_flex_start_runtime
from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    LaunchResult,
    Probe,
    StartHook,
    SubmitHook,
    ignore_submission,
)
from prefect_gpu_budget.launchers.bill_mark import BILL_MARK, gcp_label_problem, ledger_job_id
from prefect_gpu_budget.launchers.follow import Remote, Seen, Start, Stop, follow, wait_over
from prefect_gpu_budget.launchers.vertex_api import (
    ENDED,
    POLL_RETRY,
    WAITING,
    api_error,
    duration,
    epoch,
    job_state,
    one_line,
    sdk,
)
from prefect_gpu_budget.launchers.vertex_machines import (
    STRATEGIES,
    VERTEX_TRAINING_REGIONS,
    vertex_machine,
)
from prefect_gpu_budget.launchers.vertex_outcome import job_line, job_result
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import BudgetInputError, fmt_duration, parse_duration

if TYPE_CHECKING:
    from google.cloud import aiplatform_v1 as vertex

WAIT_LOG_S = 300.0
"""While a job waits for capacity, say so again this often."""
FLEX_WAIT_SLACK_S = 60.0
"""How long past its max wait a FLEX_START job may still be queued before we cancel it."""
LAUNCH_LABEL = "gpu-budget-launch"


class VertexLauncher(Block):
    """Runs admitted GPU jobs as Vertex AI custom jobs (on-demand, spot or flex-start).

    Jobs name `gcp:<machine-type>`; the accelerator comes from the price catalog's row. The
    job's max_runtime becomes the custom job's timeout, `nodes` its replica count, and its
    provisioning the scheduling strategy (FLEX_START waits for capacity for at most
    `capacity_max_wait`, cut to the job's own `max_wait` when it names one; 0 = forever).
    """

    _block_type_name = "Vertex AI GPU Launcher"
    _block_type_slug = "vertex-ai-gpu-launcher"
    _logo_url = "https://cdn.sanity.io/images/3ugk85nk/production/10424e311932e31c477ac2b9ef3d53cefbaad708-250x250.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "Runs budget-gated GPU jobs as Vertex AI custom jobs."

    kind: ClassVar[str] = "vertex"

    gcp_credentials: GcpCredentials = Field(
        description="The GCP credentials the custom jobs are submitted with."
    )
    project: str | None = Field(
        default=None, description="GCP project to run in; the credentials' project when empty."
    )
    region: str = Field(default="us-central1", description="Vertex AI region, e.g. us-central1.")
    image_uri: str | None = Field(
        default=None, description="Container image the job runs, e.g. in Artifact Registry."
    )
    service_account: str | None = Field(
        default=None, description="Service account the job runs as; Vertex's default if empty."
    )
    api_endpoint: str | None = Field(
        default=None,
        description="Vertex AI API endpoint; `{region}-aiplatform.googleapis.com` when empty.",
    )
    capacity_max_wait: Annotated[
        float, BeforeValidator(lambda v: parse_duration(v, "capacity_max_wait", allow_zero=True))
    ] = Field(
        default=86400.0,
        description=(
            "Longest a flex-start or spot job waits for capacity, in seconds or like '6h'; "
            "0 waits forever."
        ),
    )
    poll_s: float = Field(
        default=15.0, gt=0, le=600, description="Seconds between reads of the job's state."
    )

    # -- settings ---------------------------------------------------------------------------

    def _project(self) -> str | None:
        return self.project or self.gcp_credentials.project

    def _parent(self) -> str:
        return f"projects/{self._project()}/locations/{self.region}"

    def _client(self) -> vertex.JobServiceClient:
        vertex = sdk()
        endpoint = self.api_endpoint or f"{self.region}-aiplatform.googleapis.com"
        return vertex.JobServiceClient(
            credentials=self.gcp_credentials.get_credentials_from_service_account(),
            transport="rest",
            client_options={"api_endpoint": endpoint},
        )

    def _error(self, reason: str) -> LaunchConfigError:
        return LaunchConfigError(self.kind, reason)

    def _machine(self, quote: Quote) -> tuple[str, str]:
        return vertex_machine(quote)

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        """One-line `LaunchConfigError` for a setting Vertex would refuse; creates nothing.

        Checks what needs no network first: the region, the machine type and accelerator, the
        image, the project and the flex-start 7-day limit (a job copied past the check of its
        own fields included); then, with one read-only list call, that the credentials may use
        Vertex AI in this project and region.
        """
        sdk()  # a missing `vertex` extra first: no setting can be right without it
        if self.region not in VERTEX_TRAINING_REGIONS:
            raise self._error(f"region: {self.region!r} is not a Vertex AI training region")
        self._machine(quote)
        if not job.share_of(quote.row).whole:
            raise self._error(
                "gpus: Vertex AI runs whole machines; a part of one (gpus, vcpu, memory_gib) "
                "is for a capacity pool's own machines"
            )
        if not self.image_uri:
            raise self._error("image_uri: required, the container image the job runs")
        if not self._project():
            raise self._error("project: not set on the launcher nor in its GCP credentials")
        try:
            check_flex_start_runtime(job.provisioning, job.max_runtime)
        except BudgetInputError as exc:
            raise self._error(str(exc)) from None
        try:
            self._client().list_custom_jobs(request={"parent": self._parent(), "page_size": 1})
        except auth_errors.GoogleAuthError as exc:
            raise self._error(f"gcp_credentials: {one_line(str(exc))}") from None
        except (api_errors.GoogleAPICallError, OSError) as exc:
            field = {
                api_errors.Unauthorized: "gcp_credentials",
                api_errors.Forbidden: "gcp_credentials or project",
            }.get(type(exc), "region or api_endpoint")
            raise self._error(
                f"{field}: cannot use Vertex AI in {self._parent()}: {api_error(exc)}"
            ) from None

    # -- the job -----------------------------------------------------------------------------

    def custom_job(
        self, job: GpuJob, quote: Quote, env: dict[str, str] | None = None
    ) -> vertex.CustomJob:
        """The CustomJob this launcher submits for `job`, labelled with the ledger job id that
        `env` carries (`bill_mark`), if it carries one."""
        vertex = sdk()
        machine, accelerator = self._machine(quote)
        container = vertex.ContainerSpec(
            image_uri=self.image_uri or "",
            command=list(job.command or []),
            env=[vertex.EnvVar(name=k, value=v) for k, v in {**job.env, **(env or {})}.items()],
        )
        shape = vertex.MachineSpec(
            machine_type=machine, accelerator_type=accelerator, accelerator_count=quote.row.gpus
        )
        pools = [
            vertex.WorkerPoolSpec(machine_spec=shape, replica_count=1, container_spec=container)
        ]
        if job.nodes > 1:
            pools.append(
                vertex.WorkerPoolSpec(
                    machine_spec=shape, replica_count=job.nodes - 1, container_spec=container
                )
            )
        scheduling = vertex.Scheduling(
            strategy=STRATEGIES[job.provisioning], timeout=duration(job.max_runtime)
        )
        if job.provisioning == "flex-start":  # sent even when 0: left out, Vertex waits 1 day
            scheduling.max_wait_duration = duration(self.capacity_wait(job))
        labels = {"managed-by": "prefect-gpu-budget", LAUNCH_LABEL: uuid.uuid4().hex}
        job_id = ledger_job_id(env)
        if job_id is not None:
            labels[BILL_MARK] = job_id
        return vertex.CustomJob(
            display_name=(job.name or f"gpu-budget {machine}")[:128],
            job_spec=vertex.CustomJobSpec(
                worker_pool_specs=pools,
                scheduling=scheduling,
                service_account=self.service_account or "",
            ),
            labels=labels,
        )

    def run(
        self,
        job: GpuJob,
        quote: Quote,
        *,
        on_start: StartHook,
        log: Callable[[str], None] = print,
        env: dict[str, str] | None = None,
        on_submit: SubmitHook = ignore_submission,
    ) -> LaunchResult:
        """Submit the custom job and follow it to its end; cancel it if interrupted."""
        problem = gcp_label_problem(ledger_job_id(env))
        if problem is not None:
            now = time.time()
            return LaunchResult("launch_error", now, now, detail=problem)
        spec = self.custom_job(job, quote, env)
        client = self._client()
        try:
            created = client.create_custom_job(parent=self._parent(), custom_job=spec)
        except Exception as exc:
            if not isinstance(exc, api_errors.ClientError):  # it may exist even so
                self._cancel_launch(client, spec.labels[LAUNCH_LABEL], log)
            now = time.time()
            return LaunchResult("launch_error", now, now, detail=api_error(exc))
        except BaseException:  # cancelled mid-create: the job may exist
            self._cancel_launch(client, spec.labels[LAUNCH_LABEL], log)
            raise
        name = created.name
        try:
            on_submit(name)
            log(
                f"Vertex AI custom job {name} created: {job.nodes} x {quote.row.instance_type}, "
                f"{STRATEGIES[job.provisioning]}, timeout {fmt_duration(job.max_runtime)}"
            )
            remote = _CustomJob(self, client, name, job, log)
            start = Start(on_start, name, job.kill_grace)
            return follow(remote, start, poll_s=self.poll_s, log=log, remind_s=WAIT_LOG_S)
        except BaseException:
            self.cancel_job(client, name, log, "the run was cancelled")
            raise

    def wait_deadline(self, created: float, job: GpuJob) -> float | None:
        """When we give up on capacity: Vertex enforces FLEX_START's max wait (we only back it
        up); nothing enforces a wait for SPOT capacity but us."""
        wait = self.capacity_wait(job)
        if job.provisioning == "on-demand" or wait == 0:
            return None
        slack = FLEX_WAIT_SLACK_S if job.provisioning == "flex-start" else 0.0
        return created + wait + slack

    def capacity_wait(self, job: GpuJob) -> float:
        """How long `job` may wait for capacity (0: forever): `capacity_max_wait`, or the job's
        own `max_wait` when that is shorter, as a DWS user sets maxWaitDuration per job (the
        job's max_wait bounds its wait at the gate and, again, this one)."""
        waits = [w for w in (self.capacity_max_wait, job.max_wait or 0.0) if w > 0]
        return min(waits) if waits else 0.0

    # -- stopping ------------------------------------------------------------------------------

    def cancel_job(
        self, client: vertex.JobServiceClient, name: str, log: Callable[[str], None], why: str
    ) -> None:
        """Ask Vertex to cancel the job; an ended or missing job needs nothing."""
        try:
            client.cancel_custom_job(name=name, retry=POLL_RETRY)
            log(f"Vertex AI job {name}: cancel requested because {why}")
        except (api_errors.FailedPrecondition, api_errors.NotFound, api_errors.BadRequest):
            pass
        except Exception as exc:  # the caller re-raises its own error; say ours
            log(f"Vertex AI job {name}: could not cancel it: {api_error(exc)}")

    def _cancel_launch(
        self, client: vertex.JobServiceClient, launch: str, log: Callable[[str], None]
    ) -> None:
        """A create whose answer was lost may still have made the job: find it and cancel it."""
        try:
            found = client.list_custom_jobs(
                request={"parent": self._parent(), "filter": f'labels.{LAUNCH_LABEL}="{launch}"'},
                retry=POLL_RETRY,
            )
            for made in found:
                self.cancel_job(client, made.name, log, "its create call failed")
        except Exception as exc:
            log(f"Vertex AI: could not look for a half-created job: {api_error(exc)}")

    def probe(self, external_id: str) -> Probe:
        """`running` while the job waits or runs (it may start billing), `finished` with its
        real times once it ended, `unknown` if Vertex has no such job."""
        try:
            current = self._client().get_custom_job(name=external_id, retry=POLL_RETRY)
        except api_errors.NotFound:
            return Probe("unknown")
        start, end = epoch(current.start_time), epoch(current.end_time)
        if job_state(current) in ENDED:
            return Probe("finished", started_at=start, ended_at=end)
        return Probe("running", started_at=start)

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        """Cancel the job and wait up to `grace` seconds for Vertex to end it."""
        client = self._client()
        self.cancel_job(client, external_id, lambda line: None, "it was asked to stop")

        def over() -> bool:
            try:
                return job_state(client.get_custom_job(name=external_id)) in ENDED
            except api_errors.NotFound:
                return True

        wait_over(over, grace, min(self.poll_s, 1.0))


@dataclass
class _CustomJob(Remote["vertex.CustomJob"]):
    """A custom job as `follow` reads and stops it."""

    launcher: VertexLauncher
    client: vertex.JobServiceClient
    job_name: str
    job: GpuJob
    log: Callable[[str], None]

    def __post_init__(self) -> None:
        self.name = f"Vertex AI job {self.job_name}"
        self.created = time.time()  # when Vertex created it: a wait for capacity counts from it

    def read(self) -> Seen[vertex.CustomJob]:
        # passing errors are ridden out here, for 5 minutes; what remains ends the run
        current = self.client.get_custom_job(name=self.job_name, retry=POLL_RETRY)
        now, state, started = time.time(), job_state(current), epoch(current.start_time)
        self.created = epoch(current.create_time) or now
        line = job_line(current, self.job, self.launcher.capacity_wait(self.job), now)
        return Seen(current, state, line, started, state in ENDED, waiting=state in WAITING)

    def limit(self, started: float | None) -> tuple[float, Stop] | None:
        """Past max_runtime and half the kill grace (a backstop to Vertex's own timeout), or a
        wait for capacity past its deadline (`VertexLauncher.wait_deadline`)."""
        if started is not None:
            return started + self.job.max_runtime + self.job.kill_grace / 2, _OVERRAN
        deadline = self.launcher.wait_deadline(self.created, self.job)
        return None if deadline is None else (deadline, _WAITED_OUT)

    def stop(self, stop: Stop) -> bool:
        self.launcher.cancel_job(self.client, self.job_name, self.log, stop.why)
        return True  # asked once: the cancel rides out passing errors itself, says the rest

    def end(
        self, seen: Seen[vertex.CustomJob], started: float | None, stopped: Stop | None, now: float
    ) -> LaunchResult | None:
        outcome = stopped.outcome if stopped else None
        return job_result(seen.job, self.job, outcome) if seen.over else None


_OVERRAN = Stop("timed_out", "it ran past max_runtime")
_WAITED_OUT = Stop("wait_expired", "its wait for capacity ran out")

"""`gpu-budget-vertex-ai`: prefect-gcp's Vertex AI worker, with every flow run passing the gate
before its custom job is submitted.

```bash
prefect work-pool create gpu --type gpu-budget-vertex-ai
prefect worker start --pool gpu
```

The same job variables as `gpu-budget-process` (`instance_type`, `scope`, `max_runtime`, and
`nodes`, `priority`, `max_wait`, `provisioning`, `run_may_set`), the same wait in
`AwaitingBudget`, the same refusals and the same rule for a run's own job variables
(`workers.job_variables`): a run may narrow the scope, carry an agent's token, and set what its
deployment lists in `run_may_set`; an `image`, `env`, `command`, `credentials`,
`api_endpoint` or any other variable of its own ends it `GateRefused` before anything is
submitted. What the gate priced is
what Vertex runs: the custom job's machine type and accelerators come from `instance_type`
(`gcp:<machine-type>`, its catalog row), its replicas from `nodes`, its scheduling strategy
from `provisioning`, and its `scheduling.timeout` is max_runtime (prefect-gcp's
`maximum_run_time_hours` no longer sets it). The run's clock starts at the job's own start
time (a flex-start or spot job waiting for capacity is not billed), the worker cancels the job
if it is still running at max_runtime (a backstop to Vertex's own timeout), when the capacity
it borrowed in a pool is taken back (settled `preempted`; the run ends `Preempted`, or is
scheduled again with `requeue`) or when its owner stops it (`lifecycle.Running`, as every
runner), and settles it from the job's start and end times.

`api_endpoint` (a job variable) sends the worker's Vertex AI calls to another endpoint, over
REST (a private endpoint, or a local stand-in in tests); empty, prefect-gcp's own client talks
to `{region}-aiplatform.googleapis.com`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.logging import get_logger
from prefect_gcp.workers.vertex import (
    VertexAIWorker,
    VertexAIWorkerJobConfiguration,
    VertexAIWorkerResult,
    VertexAIWorkerVariables,
)
from pydantic import Field

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.launchers.bill_mark import BILL_MARK
from prefect_gpu_budget.launchers.vertex_api import DEADLINE_EXCEEDED, duration, epoch, sdk
from prefect_gpu_budget.launchers.vertex_machines import STRATEGIES, vertex_machine
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import parse_duration
from prefect_gpu_budget.worker_types import VERTEX_TYPE
from prefect_gpu_budget.workers.gating import (
    NOT_STARTED,
    GatedWorker,
    WorkerRun,
)
from prefect_gpu_budget.workers.job_variables import GateConfiguration, GateVariables

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

logger = get_logger("prefect_gpu_budget.workers.vertex")
ENDPOINT_HELP = (
    "Vertex AI API endpoint to call over REST instead of `{region}-aiplatform.googleapis.com`."
)


class GpuBudgetVertexVariables(GateVariables, VertexAIWorkerVariables):
    api_endpoint: str | None = Field(default=None, description=ENDPOINT_HELP)


class GpuBudgetVertexJobConfiguration(GateConfiguration, VertexAIWorkerJobConfiguration):
    api_endpoint: str | None = Field(default=None)

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        vertex_machine(quote)
        if not job.share_of(quote.row).whole:
            raise LaunchConfigError("vertex", "gpus: Vertex AI runs whole machines")

    def shape(self, job: GpuJob, quote: Quote, job_id: str) -> None:
        """Make the custom job the one the gate priced: machine type, accelerators, replicas
        and scheduling strategy from the job, whatever the pool's own variables say; and the
        label that names its ledger job (`job_id`) on the bill (`BILL_MARK`)."""
        self.labels = {**(self.labels or {}), BILL_MARK: job_id}
        machine, accelerator = vertex_machine(quote)
        pools = self.job_spec["worker_pool_specs"]
        primary = {
            **pools[0],
            "replica_count": 1,
            "machine_spec": {
                "machine_type": machine,
                "accelerator_type": accelerator,
                "accelerator_count": quote.row.gpus,
            },
        }
        others = [{**primary, "replica_count": job.nodes - 1}] if job.nodes > 1 else []
        self.job_spec["worker_pool_specs"] = [primary, *others]
        scheduling = {
            k: v
            for k, v in (self.job_spec.get("scheduling") or {}).items()
            if job.provisioning == "flex-start" or k != "max_wait_duration"
        }
        self.job_spec["scheduling"] = {**scheduling, "strategy": STRATEGIES[job.provisioning]}


class _WatchedJobs:
    """The job client prefect-gcp's worker submits and watches the custom job with, seen by
    the gate: the created job's name is recorded, the job's start time starts the run's clock
    (with a cancel at max_runtime, on preemption or its owner's stop), its end time settles
    it. With an
    `api_endpoint`, the calls go over REST to it (google-cloud-aiplatform's sync client, in a
    thread), else to prefect-gcp's own async client."""

    def __init__(self, inner: Any, threaded: bool, run: WorkerRun) -> None:
        self.inner, self.run, self.threaded = inner, run, threaded
        self.last: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _call(self, method: str, **kwargs: Any) -> Any:
        self._loop = asyncio.get_running_loop()
        call = getattr(self.inner, method)
        if self.threaded:
            return await anyio.to_thread.run_sync(functools.partial(call, **kwargs))
        return await call(**kwargs)

    async def create_custom_job(self, **kwargs: Any) -> Any:
        created = await self._call("create_custom_job", **kwargs)
        try:  # never raise past a create that worked: prefect-gcp would create it again
            await anyio.to_thread.run_sync(self.run.submitted, created.name)
        except Exception as exc:
            logger.warning("could not record the submission of %s: %s", created.name, exc)
        return created

    async def get_custom_job(self, **kwargs: Any) -> Any:
        job = await self._call("get_custom_job", **kwargs)
        self.last = job
        start = epoch(job.start_time)
        if start is not None and self.run.started_at is None:
            await anyio.to_thread.run_sync(self.run.started, start, job.name, self._stopper(job))
        return job

    async def cancel_custom_job(self, **kwargs: Any) -> Any:
        return await self._call("cancel_custom_job", **kwargs)

    def _stopper(self, job: Any) -> Any:
        loop, name = self._loop, job.name

        def stop() -> None:  # from the timer's thread, on the worker's loop
            assert loop is not None
            asyncio.run_coroutine_threadsafe(self.cancel_custom_job(name=name), loop)

        return stop

    def ended(self) -> tuple[float, float | None]:
        """(ended_at, billed seconds): the job's own times where Vertex gave them."""
        job, now = self.last, time.time()
        start = epoch(job.start_time) if job is not None else None
        end = (epoch(job.end_time) if job is not None else None) or now
        return end, (max(0.0, end - start) if start is not None else 0.0)

    def outcome(self, result: VertexAIWorkerResult) -> str:
        job = self.last
        if job is not None and job.error and job.error.code == DEADLINE_EXCEEDED:
            return "timed_out"
        if job is not None and sdk().JobState(job.state).name == "JOB_STATE_CANCELLED":
            return "cancelled"
        return "completed" if not result.status_code else "failed"


class _Credentials:
    """Stands in for the run's `GcpCredentials` where prefect-gcp's worker asks it for a job
    client: hands out the watched one; everything else is the credentials' own."""

    def __init__(self, credentials: Any, jobs: _WatchedJobs) -> None:
        self._credentials, self._jobs = credentials, jobs

    def get_job_service_async_client(self, client_options: Any = None) -> _WatchedJobs:
        return self._jobs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._credentials, name)


class GpuBudgetVertexWorker(GatedWorker, VertexAIWorker):
    """prefect-gcp's Vertex AI worker, gated: see the module's docstring."""

    type = VERTEX_TYPE
    job_configuration = GpuBudgetVertexJobConfiguration  # type: ignore[assignment]
    job_configuration_variables = GpuBudgetVertexVariables  # type: ignore[assignment]
    _display_name = "GPU Budget Vertex AI"
    _description = (
        "prefect-gcp's Vertex AI worker with a budget gate: each flow run waits until it fits "
        "the hourly caps and period budgets of its scope before its custom job is submitted, "
        "runs at most max_runtime, and is settled from the job's own start and end times."
    )

    async def run(
        self,
        flow_run: FlowRun,
        configuration: GpuBudgetVertexJobConfiguration,  # type: ignore[override]
        task_status: anyio.abc.TaskStatus[str] | None = None,
    ) -> VertexAIWorkerResult:
        gated = await self.admit(flow_run, configuration, task_status, NOT_STARTED)
        if gated is None:
            return VertexAIWorkerResult(status_code=0, identifier=NOT_STARTED)
        configuration.shape(gated.job, gated.admission.quote, gated.admission.job_id)
        jobs = _WatchedJobs(*_job_client(configuration), gated)
        watched = configuration.model_copy(
            update={"credentials": _Credentials(configuration.credentials, jobs)}
        )
        return await gated.until_settled(
            super().run(flow_run, watched, task_status), jobs.outcome, jobs.ended
        )

    def _build_job_spec(self, configuration: Any) -> Any:
        """prefect-gcp's spec, with `scheduling.timeout` = max_runtime (not whole hours)."""
        spec = super()._build_job_spec(configuration)
        if configuration.max_runtime:
            runtime = parse_duration(configuration.max_runtime, "max_runtime")
            spec.scheduling.timeout = duration(runtime)
        return spec

    async def _watch_job_run(self, *args: Any, **kwargs: Any) -> Any:
        """Watch until the job ends: its own timeout and our stop bound it, not the watch."""
        return await super()._watch_job_run(*args, **{**kwargs, "timeout": None})

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: Any, grace_seconds: int = 30
    ) -> None:
        if not getattr(configuration, "api_endpoint", None):
            return await super().kill_infrastructure(
                infrastructure_pid, configuration, grace_seconds
            )
        client, _ = _job_client(configuration)
        await anyio.to_thread.run_sync(
            functools.partial(client.cancel_custom_job, name=infrastructure_pid)
        )


def _job_client(configuration: GpuBudgetVertexJobConfiguration) -> tuple[Any, bool]:
    """(the job client, whether it is a sync one to call in a thread)."""
    from google.api_core.client_options import ClientOptions

    if configuration.api_endpoint:
        client = sdk().JobServiceClient(
            credentials=configuration.credentials.get_credentials_from_service_account(),
            transport="rest",
            client_options={"api_endpoint": configuration.api_endpoint},
        )
        return client, True
    options = ClientOptions(api_endpoint=f"{configuration.region}-aiplatform.googleapis.com")
    return configuration.credentials.get_job_service_async_client(client_options=options), False

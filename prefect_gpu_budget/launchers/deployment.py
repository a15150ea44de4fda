"""Deployment launcher: a GPU job as a flow run of any Prefect deployment.

The deployment's work pool decides where the job runs (a `process` pool on this machine, or
vertex-ai, ecs, kubernetes pools in a cloud). The launcher creates the flow run with
`run_deployment`, passes it the job, watches it through the Prefect API, and cancels it at
the job's max_runtime, as `prefect flow-run cancel` does; its worker or runner ends it.

Billing ends only on evidence the job cannot forge. The job's own code holds its flow run's
Prefect API access, and through it can write everything this launcher can read of the run:
its state (a forced Completed while the process runs on), its end time, its
`infrastructure_pid`, its parameters, and any event, the worker's
`prefect.worker.executed-flow-run` included. Whether the process is still there cannot be
seen either: a process leaves its environment, or runs on another host. So what the launcher
reads can only make a job cost more, never less:

- a started job is billed from the flow run's start (its first `Running`, noted once) to the
  later of its start plus max_runtime (the reservation's runtime) and any later end that is
  reported (its end time, its worker's event) or seen: from max_runtime on, the launcher
  looks on its own host for the run's processes (`PREFECT__FLOW_RUN_ID`, which every Prefect
  worker and runner gives the flow run's process), and bills until the moment it finds none;
- a flow run deleted (through the same API access) is billed as one that says it is over, as
  if it started then if it was not seen to start before;
- the job keeps its slot until then: `run` returns no earlier than max_runtime, however early
  the flow run says it ended, and says so (`END_NOT_OBSERVED` in its detail and log);
- at max_runtime a flow run that is not over is cancelled; one that says it is over while its
  processes are still seen here, or without its worker's report that its process ended
  (waited for `kill_grace` + `cancel_wait_s`: events land late), is called suspicious, billed
  as above and set to Cancelling so that its worker kills it; what
  of it is still seen here `kill_grace` + `cancel_wait_s` after that is SIGKILLed by the
  launcher itself (a child that left its process group, which the worker's kill misses);
- `probe` (reconcile's view of an orphan) answers `running` for any started flow run: the
  ledger's row then keeps it metered until its max runtime, and reconcile settles it no
  earlier than that.

A gated job's flow run is tagged `gpu-budget-job:<ledger job id>`, and gets that label where its
pool's template takes `labels` (its worker puts them on the cloud's job, for the bill: `bill_mark`).

So a short job costs its max_runtime here: give deployment jobs a tight one. What this does not
close: code that runs as the worker's user on the worker's host can kill or deceive anything
there (this launcher's view of that host included, when it runs there too), and a job on
another host that forges its end can run on past max_runtime, billed to max_runtime, until its
infrastructure stops it. A job whose caller is interrupted in its process (the calling flow
run cancelled, Ctrl-C) is cancelled and waited for until it says it is over, at most
`kill_grace` + `cancel_wait_s`, what of it still runs here is killed, and the caller bills it
until then: a job that has its caller cancelled (its API access reaches that flow run too) and
forges its end at once is billed to that moment. (A caller whose process is killed leaves an
orphan, which reconcile meters to its max runtime.) The ends this launcher could bill early
on, and does not have yet: a cloud's own record of the job (as the Vertex AI and SageMaker
launchers bill), or a gated worker's own observation of the process tree's end, written where
the flow run's code cannot write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar
from uuid import UUID

from prefect.blocks.core import Block
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import Deployment, FlowRun, StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling
from pydantic import Field, field_validator

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers import flow_runs
from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    LaunchResult,
    Probe,
    StartHook,
    SubmitHook,
    ignore_submission,
)
from prefect_gpu_budget.launchers.bill_mark import flow_run_tag, ledger_job_id, pool_labels
from prefect_gpu_budget.launchers.follow import (
    Retry,
    Start,
    first_line,
    follow,
    wait_over,
)
from prefect_gpu_budget.launchers.followed_flow_run import FollowedFlowRun
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import shown
from prefect_gpu_budget.worker_types import GATED_TYPES


class DeploymentLauncher(Block):
    """Runs each GPU job as a flow run of a Prefect deployment, on whatever its work pool is.

    The job reaches the flow as a dict in the parameter named by `job_parameter`. It is billed
    from the flow run's start to its max_runtime at least, and holds its slot until then: the
    end of its process is nothing the launcher can observe that the job could not forge (see
    the module's docstring); a later end, reported or seen on this host, is billed too. It is
    cancelled at the job's max_runtime, and when the calling run is cancelled.
    """

    _block_type_name = "GPU Deployment Launcher"
    _block_type_slug = "gpu-deployment-launcher"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark.png"  # noqa: E501
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"
    _description = "Runs budgeted GPU jobs as flow runs of a deployment on any work pool."

    kind: ClassVar[str] = "deployment"

    deployment: str = Field(
        description="The deployment to run, as 'flow-name/deployment-name' (or its id)."
    )
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Fixed parameters for every flow run, over the deployment's defaults.",
    )
    job_parameter: str | None = Field(
        default="job",
        description="The flow parameter that receives the job as a dict; empty to not pass it.",
    )
    job_variables: dict[str, Any] = Field(
        default_factory=dict,
        description="Work pool job variables for every flow run (e.g. image, machine type).",
    )
    work_queue_name: str | None = Field(
        default=None, description="The work queue to use instead of the deployment's own."
    )
    tags: list[str] = Field(default_factory=list, description="Tags for every flow run.")
    as_subflow: bool = Field(
        default=True,
        description=(
            "Link the flow run under the calling flow run, when there is one, so that it shows "
            "there and the server cancels it if the calling run is cancelled."
        ),
    )
    poll_s: float = Field(
        default=2.0, gt=0, description="Seconds between reads of the flow run's state."
    )
    start_timeout: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Seconds a flow run may wait for a worker (or cloud capacity) before it is "
            "cancelled as wait_expired; unset waits as long as it takes."
        ),
    )
    cancel_wait_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "Seconds, beyond the job's kill_grace, to wait for a cancelled flow run to end "
            "when the calling run is being cancelled; past max_runtime, what of the run still "
            "runs on this host that long after it was asked to end is killed."
        ),
    )

    @field_validator("deployment")
    @classmethod
    def _name(cls, value: str) -> str:
        try:
            UUID(value)
            return value
        except ValueError:
            pass
        flow_name, sep, name = value.partition("/")
        if not (sep and flow_name and name) or "/" in name:
            raise ValueError(f"must be 'flow-name/deployment-name', got {shown(value)}")
        return value

    # -- the Launcher protocol --------------------------------------------------------------

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        """The deployment exists, takes every parameter this launcher passes, and runs on a
        work pool that does not gate its runs again (its job would be reserved twice)."""
        with get_client(sync_client=True) as client:
            deployment = self._read_deployment(client)
            pool = deployment.work_pool_name
            kind = client.read_work_pool(pool).type if pool else ""
        if kind in GATED_TYPES:
            raise LaunchConfigError(
                self.kind,
                f"deployment {self.deployment!r} runs on work pool {pool!r} of type {kind}, "
                "which passes each run through the gate itself: run the job there directly, "
                "or deploy the target to a pool of another type",
            )
        schema = deployment.parameter_openapi_schema or {}
        known = schema.get("properties")
        if not isinstance(known, dict):
            return
        passed = set(self.parameters) | ({self.job_parameter} if self.job_parameter else set())
        unknown = sorted(passed - set(known))
        if unknown:
            raise LaunchConfigError(
                self.kind,
                f"deployment {self.deployment!r} has no parameter {unknown[0]!r} "
                f"(it takes {', '.join(sorted(known)) or 'none'}); check job_parameter and "
                "parameters",
            )
        given = passed | set(deployment.parameters or {})
        missing = sorted(set(schema.get("required") or ()) - given)
        if missing:
            raise LaunchConfigError(
                self.kind,
                f"deployment {self.deployment!r} requires parameter {missing[0]!r}, which "
                "neither it nor this launcher's parameters set",
            )

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
        """Create the flow run, follow it to its final state, and cancel it at max_runtime.

        `env` (with the job's own `env`) reaches the flow run as the work pool's `env` job
        variable. Returns no earlier than max_runtime after the flow run started (see the
        module's docstring). If interrupted (the calling run is cancelled), the flow run is
        cancelled and waited for (what of it is still seen on this host then is killed) before
        the interruption is raised again.
        """
        try:
            flow_run = self._create_flow_run(job, env)
        except Exception as exc:  # refused (a bad parameter), or the API is down
            now = time.time()
            detail = f"could not create a flow run of {self.deployment}: {first_line(exc)}"
            return LaunchResult("launch_error", now, now, detail=detail)
        start = Start(on_start, str(flow_run.id), job.kill_grace)  # told once, by either below
        try:  # from here on, whatever interrupts us cancels the flow run
            on_submit(str(flow_run.id))
            log(f"created {flow_runs.state_line(flow_run)} of deployment {self.deployment}")
            with get_client(sync_client=True) as client:
                # an unreadable API is waited out: the job may still be running and billing
                followed = FollowedFlowRun(self, client, flow_run, job, log)
                return follow(
                    followed, start, poll_s=self.poll_s, log=log, retry=Retry((Exception,))
                )
        except BaseException:
            self._cancel_interrupted(flow_run, job, start, log)
            raise

    def _create_flow_run(self, job: GpuJob, env: dict[str, str] | None) -> FlowRun:
        """The job's flow run of the deployment, created and not waited for."""
        from prefect.deployments import run_deployment

        job_variables, tags = self._marked(job, env)
        return run_deployment(
            self.deployment,
            parameters=self._parameters(job),
            timeout=0,
            as_subflow=self.as_subflow,
            job_variables=job_variables,
            tags=tags,
            work_queue_name=self.work_queue_name,
            flow_run_name=job.name,
            _sync=True,  # a plain call even from inside an async flow or task
        )

    def _cancel_interrupted(
        self, flow_run: FlowRun, job: GpuJob, start: Start, log: Callable[[str], None]
    ) -> None:
        """The caller was interrupted: cancel the flow run and wait for it to end; if it
        started meanwhile, bill it from its start and kill what of it still runs here. Never
        raises: the interruption, not this, is the caller's error."""
        try:
            self.cancel_flow_run(flow_run.id, "the calling run was interrupted", log)
            last = self._wait_final(flow_run.id, job.kill_grace + self.cancel_wait_s)
            if flow_runs.ran(last) and last.start_time is not None:
                # it may have started since: bill from then; what runs on here is killed
                record = start.note(last.start_time.timestamp())
                flow_runs.kill_left(flow_run.id, flow_runs.seen_here(flow_run.id), log)
                record.finish()
            elif start.record is not None:
                start.record.finish()
        except Exception as exc:  # keep the interruption, not this, as the error
            log(f"could not cancel flow run {flow_run.id}: {exc}")

    def probe(self, external_id: str) -> Probe:
        """`running` for a flow run that started (its end cannot be observed: reconcile keeps
        it metered until its max runtime and settles it no earlier), or that may still start
        (started_at None: it may bill at any moment and no one watches it); `finished` at no
        cost for one over without ever running; `unknown` when the flow run cannot be read."""
        try:
            with get_client(sync_client=True) as client:
                flow_run = client.read_flow_run(UUID(external_id))
        except Exception:  # a bad id, a deleted run, an unreachable API: reconcile must wait
            return Probe("unknown")
        if not flow_runs.ran(flow_run):
            if flow_runs.over(flow_run):
                ended = flow_runs.ended_at(flow_run)
                return Probe("finished", started_at=ended, ended_at=ended)
            return Probe("running")
        return Probe("running", started_at=flow_runs.epoch(flow_run.start_time))

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        """Cancel the flow run and wait up to `grace` plus `cancel_wait_s` for it to end."""
        self.cancel_flow_run(UUID(external_id), "stop requested", lambda line: None)
        self._wait_final(UUID(external_id), grace + self.cancel_wait_s)

    # -- helpers ------------------------------------------------------------------------------

    def _read_deployment(self, client: SyncPrefectClient) -> Deployment:
        try:
            try:
                return client.read_deployment(UUID(self.deployment))
            except ValueError:
                return client.read_deployment_by_name(self.deployment)
        except ObjectNotFound:
            reason = f"no deployment {self.deployment!r} at {client.api_url}"
        except Exception as exc:  # unreachable API, refused credentials
            reason = (
                f"cannot read deployment {self.deployment!r} at {client.api_url}: "
                + first_line(exc)
            )
        raise LaunchConfigError(self.kind, reason)

    def _parameters(self, job: GpuJob) -> dict[str, Any]:
        parameters = dict(self.parameters)
        if self.job_parameter:
            # env goes to the job's environment (see `_marked`), not into parameters
            parameters[self.job_parameter] = job.model_dump(mode="json", exclude={"env"})
        return parameters

    def _marked(
        self, job: GpuJob, env: dict[str, str] | None
    ) -> tuple[dict[str, Any] | None, list[str] | None]:
        """The flow run's job variables (`env`: the job's and `env`) and tags, marked with the
        ledger job id in `env` (`bill_mark`): a tag; a label, where the pool takes `labels`."""
        extra_env = {**job.env, **(env or {})}
        variables = {**self.job_variables}
        if extra_env:
            variables["env"] = {**self.job_variables.get("env", {}), **extra_env}
        job_id = ledger_job_id(env)
        if job_id is None:
            return variables or None, self.tags or None
        with get_client(sync_client=True) as client:
            deployment = self._read_deployment(client)
            name = deployment.work_pool_name
            template = client.read_work_pool(name).base_job_template if name else {}
        if labels := pool_labels(job_id, template, deployment.job_variables, self.job_variables):
            variables["labels"] = labels
        return variables, [*self.tags, flow_run_tag(job_id)]

    def cancel_flow_run(self, flow_run_id: UUID, why: str, log: Callable[[str], None]) -> None:
        """Ask for cancellation, as `prefect flow-run cancel` does. A run that has not started
        is cancelled at once by the server; a running one by its worker or runner."""
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state is None or flow_runs.over(flow_run):
                return
            if flow_run.state.type != StateType.CANCELLING:
                client.set_flow_run_state(flow_run_id, Cancelling(message=f"Cancelled: {why}"))
        log(f"cancelling flow run {flow_run.name} ({flow_run_id}): {why}")

    def _wait_final(self, flow_run_id: UUID, timeout: float) -> FlowRun:
        """The flow run once it is `over`, or as it is after `timeout` seconds."""
        read: list[FlowRun] = []
        with get_client(sync_client=True) as client:

            def over() -> bool:
                read.append(client.read_flow_run(flow_run_id))
                return flow_runs.over(read[-1])

            wait_over(over, timeout, min(self.poll_s, 1.0))
        return read[-1]

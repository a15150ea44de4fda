"""Deployment launcher: a GPU job as a flow run of any Prefect deployment.

The deployment's work pool decides where the job runs (a `process` pool on this machine, or
vertex-ai, ecs, kubernetes pools in a cloud). The launcher creates the flow run with
`run_deployment`, passes it the job, watches it through the Prefect API, and reports the flow
run's own start and end times, which the gate then settles from. Stopping a flow run means
setting it to Cancelling, as `prefect flow-run cancel` does; its worker or runner ends it.

A flow run's state is client-settable: anyone with API access can force it to Completed while
its process runs on. So a final state alone never ends billing. The launcher settles only when
the infrastructure reports that the run's process ended, and the strongest such evidence a
Prefect worker gives is its `prefect.worker.executed-flow-run` event: the worker emits it once
its own `run()` has returned, i.e. once the process it started has exited (the event names the
flow run as a related resource, with the process's identifier and exit code). The other
candidates are weaker: `infrastructure_pid` says where the process was started, not that it
ended (and can be checked only on the worker's host); state history and the
`prefect.flow-run.*` events record every state change but not who asked for it (a forced
`set_state` looks like the run's own). Events can be emitted by API clients too, but forging
one takes a deliberate second step, and the worker's event carries its worker resource.
A final state with no such event is metered on until the event arrives or max_runtime passes;
then it is billed to max_runtime, logged as suspicious, and set to Cancelling so that its
worker kills the process if it still runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar
from uuid import UUID

from prefect.blocks.core import Block
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import Deployment, FlowRun, StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling
from pydantic import Field, field_validator

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import (
    LaunchConfigError,
    LaunchResult,
    Probe,
    StartHook,
    StartNotRecorded,
    StartRecord,
    SubmitHook,
    ignore_submission,
)
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import shown

logger = logging.getLogger("prefect_gpu_budget.launchers.deployment")

PROCESS_ENDED_EVENT = "prefect.worker.executed-flow-run"
"""What a worker emits once the process of a flow run it started has exited."""

OUTCOME_OF = {
    StateType.COMPLETED: "completed",
    StateType.FAILED: "failed",
    StateType.CRASHED: "failed",
    StateType.CANCELLED: "cancelled",
    StateType.CANCELLING: "cancelled",  # only when it never ran: see `_over`
}


def _epoch(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def _ran(flow_run: FlowRun) -> bool:
    """Whether the flow run ever entered Running. (At a final state the server fills in a
    never-run flow run's start_time with its end time, so start_time alone cannot tell.)"""
    return flow_run.run_count > 0


def _over(flow_run: FlowRun) -> bool:
    """Final, or cancelled before it ever ran. The server refuses Running after Cancelling, so
    such a run can never start; with no worker-side cancellation
    (PREFECT_WORKER_ENABLE_CANCELLATION) it would stay Cancelling until the server's
    cancelling timeout."""
    state = flow_run.state
    return state is not None and (
        state.is_final() or (state.type == StateType.CANCELLING and not _ran(flow_run))
    )


def _ended_at(flow_run: FlowRun) -> float:
    """When an `_over` flow run ended: its end time, else when it was set to Cancelling."""
    state = flow_run.state
    return _epoch(flow_run.end_time) or _epoch(state.timestamp if state else None) or time.time()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _state_line(flow_run: FlowRun) -> str:
    state = flow_run.state
    if state is None:
        return f"flow run {flow_run.name}: no state"
    message = f": {state.message}" if state.message else ""
    return f"flow run {flow_run.name} ({flow_run.id}): {state.name}{message}"


class DeploymentLauncher(Block):
    """Runs each GPU job as a flow run of a Prefect deployment, on whatever its work pool is.

    The job reaches the flow as a dict in the parameter named by `job_parameter`. It is billed
    from the flow run's start until its worker reports the run's process ended (a final state
    alone is client-settable and is not enough: see the module's docstring); it is cancelled at
    the job's max_runtime, and when the calling run is cancelled. Deployments served by
    `flow.serve` (a runner, not a worker) send no such report: their jobs bill to max_runtime.
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
            "when the calling run is being cancelled."
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
        """The deployment exists and takes every parameter this launcher passes."""
        with get_client(sync_client=True) as client:
            deployment = self._read_deployment(client)
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
        variable. If interrupted (the calling run is cancelled), the flow run is cancelled and
        waited for before the interruption is raised again.
        """
        from prefect.deployments import run_deployment

        try:
            flow_run = run_deployment(
                self.deployment,
                parameters=self._parameters(job),
                timeout=0,
                as_subflow=self.as_subflow,
                job_variables=self._job_variables(job, env),
                tags=self.tags or None,
                work_queue_name=self.work_queue_name,
                flow_run_name=job.name,
                _sync=True,  # a plain call even from inside an async flow or task
            )
        except Exception as exc:  # refused (a bad parameter), or the API is down
            now = time.time()
            detail = f"could not create a flow run of {self.deployment}: {_first_line(exc)}"
            return LaunchResult("launch_error", now, now, detail=detail)
        noted: list[StartRecord] = []  # the start, once on_start has been told

        def note_start(seen: FlowRun) -> StartRecord | None:
            """Tell `on_start` in a thread of its own (a stalled ledger never delays the
            max_runtime clock); the record, once there is one."""
            if not noted and _ran(seen) and seen.start_time is not None:
                started = seen.start_time.timestamp()
                noted.append(StartRecord(on_start, started, str(seen.id), job.kill_grace))
            return noted[0] if noted else None

        try:  # from here on, whatever interrupts us cancels the flow run
            on_submit(str(flow_run.id))
            log(f"created {_state_line(flow_run)} of deployment {self.deployment}")
            with get_client(sync_client=True) as client:
                return self._follow(client, flow_run, job, note_start, log)
        except BaseException:
            try:
                self._cancel(flow_run.id, "the calling run was interrupted", log)
                last = self._wait_final(flow_run.id, job.kill_grace + self.cancel_wait_s)
                record = note_start(last)  # it may have started since: bill from then
                if record is not None:
                    record.finish()
            except Exception as exc:  # keep the interruption, not this, as the error
                log(f"could not cancel flow run {flow_run.id}: {exc}")
            raise

    def probe(self, external_id: str) -> Probe:
        """`running` (started_at None while it still waits to start: it may bill at any
        moment and no one watches it), `finished` with its real times, or `unknown` when the
        flow run cannot be read."""
        try:
            with get_client(sync_client=True) as client:
                flow_run = client.read_flow_run(UUID(external_id))
        except Exception:  # a bad id, a deleted run, an unreachable API: reconcile must wait
            return Probe("unknown")
        if _over(flow_run):
            ended = _ended_at(flow_run)
            if not _ran(flow_run):
                return Probe("finished", started_at=ended, ended_at=ended)
            with get_client(sync_client=True) as client:  # its process's end, as its worker saw
                ended = max(ended, self._process_ended(client, flow_run.id) or ended)
            return Probe("finished", started_at=_epoch(flow_run.start_time), ended_at=ended)
        return Probe("running", started_at=_epoch(flow_run.start_time) if _ran(flow_run) else None)

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        """Cancel the flow run and wait up to `grace` plus `cancel_wait_s` for it to end."""
        self._cancel(UUID(external_id), "stop requested", lambda line: None)
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
                + _first_line(exc)
            )
        raise LaunchConfigError(self.kind, reason)

    def _parameters(self, job: GpuJob) -> dict[str, Any]:
        parameters = dict(self.parameters)
        if self.job_parameter:
            # env goes to the job's environment (see `_job_variables`), not into parameters
            parameters[self.job_parameter] = job.model_dump(mode="json", exclude={"env"})
        return parameters

    def _job_variables(self, job: GpuJob, env: dict[str, str] | None) -> dict[str, Any] | None:
        extra_env = {**job.env, **(env or {})}
        if not extra_env:
            return self.job_variables or None
        return {**self.job_variables, "env": {**self.job_variables.get("env", {}), **extra_env}}

    def _follow(
        self,
        client: SyncPrefectClient,
        flow_run: FlowRun,
        job: GpuJob,
        note_start: Callable[[FlowRun], StartRecord | None],
        log: Callable[[str], None],
    ) -> LaunchResult:
        """Poll until the flow run is final and its process has ended (see the module's
        docstring). An unreadable API is waited out (the job may still be running and
        billing); only a deleted flow run ends the wait early."""
        created = _epoch(flow_run.created) or time.time()
        run_id = flow_run.id
        started: float | None = None
        record: StartRecord | None = None
        cancelled_until = float("inf")  # how long a run we cancelled may take to end
        told_final = False
        stopped_for: str | None = None  # `timed_out` or `wait_expired` once we cancel it
        overdue = float("inf")  # when to say that a cancelled run has not ended
        seen: tuple[Any, ...] = ()
        unreadable = False
        while True:
            try:
                flow_run = client.read_flow_run(run_id)
            except ObjectNotFound:
                ended = time.time()
                began = ended if started is None else started
                detail = "the flow run was deleted; its infrastructure may still run"
                return LaunchResult("failed", began, ended, detail=detail, external_id=str(run_id))
            except Exception as exc:  # the API is down: keep watching, the job may run on
                if not unreadable:
                    log(f"cannot read flow run {run_id}, retrying: {_first_line(exc)}")
                unreadable = True
                time.sleep(self.poll_s)
                continue
            unreadable = False
            state = flow_run.state
            if started is None and _ran(flow_run) and flow_run.start_time is not None:
                started = flow_run.start_time.timestamp()  # max_runtime counts from here
                record = note_start(flow_run)  # before anything else can interrupt
            if state is not None and (state.type, state.name, state.message) != seen:
                seen = (state.type, state.name, state.message)
                log(_state_line(flow_run))
            now = time.time()
            if _over(flow_run) and started is None:  # it never ran: nothing to meter
                return self._result(flow_run, created, started, stopped_for)
            if _over(flow_run):
                assert started is not None
                ended = self._process_ended(client, run_id)
                until = started + job.max_runtime if stopped_for is None else cancelled_until
                if ended is not None or now >= until:
                    if record is not None:
                        record.finish()  # on record before the gate settles
                    if ended is not None:
                        return self._result(
                            flow_run, created, started, stopped_for, ended=max(ended, started)
                        )
                    return self._unproven(client, flow_run, job, created, started, log)
                if not told_final:
                    told_final = True
                    log(
                        f"flow run {run_id} is {state.name if state else '?'} but its worker "
                        "has not reported its process ended: still metered"
                    )
                time.sleep(self.poll_s)
                continue
            if record is not None and stopped_for is None:
                try:
                    record.check(now)
                except StartNotRecorded as late:
                    stopped_for = "cancelled"
                    self._cancel(run_id, str(late), log)
                    cancelled_until = now + job.kill_grace + self.cancel_wait_s
            why = None
            if stopped_for is None and started is not None and now >= started + job.max_runtime:
                stopped_for, why = "timed_out", f"max_runtime {job.max_runtime:.0f}s reached"
            elif (
                stopped_for is None
                and started is None
                and self.start_timeout is not None
                and now >= created + self.start_timeout
            ):
                stopped_for, why = "wait_expired", f"not started within {self.start_timeout:.0f}s"
            if why is not None:
                try:
                    self._cancel(run_id, why, log)
                    overdue = now + job.kill_grace + self.cancel_wait_s
                    cancelled_until = overdue
                except Exception as exc:  # try again on the next poll
                    log(f"could not cancel flow run {run_id}, retrying: {_first_line(exc)}")
                    stopped_for = None
            elif now >= overdue:
                overdue = float("inf")  # say it once; keep metering until it really ends
                log(f"flow run {run_id} has not ended since it was cancelled; still metered")
            time.sleep(self.poll_s)

    def _process_ended(self, client: SyncPrefectClient, flow_run_id: UUID) -> float | None:
        """When the worker reported the flow run's process ended (its executed-flow-run
        event), or None while it has not (or the events cannot be read)."""
        from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

        wanted = EventFilter(
            event=EventNameFilter(name=[PROCESS_ENDED_EVENT]),
            related=EventRelatedFilter(
                resources_in_roles=[(f"prefect.flow-run.{flow_run_id}", "flow-run")]
            ),
        )
        try:
            page = client.read_events(filter=wanted, limit=5)
        except Exception:  # the API is down: no evidence yet, keep metering
            return None
        times = [event.occurred.timestamp() for event in page.events]
        return min(times) if times else None

    def _unproven(
        self,
        client: SyncPrefectClient,
        flow_run: FlowRun,
        job: GpuJob,
        created: float,
        started: float,
        log: Callable[[str], None],
    ) -> LaunchResult:
        """A final state with no report from the infrastructure that the process ended, by
        max_runtime: billed to max_runtime, said loudly, and its worker asked to stop it."""
        assert flow_run.state is not None
        warning = (
            f"suspicious final state: flow run {flow_run.name} ({flow_run.id}) is "
            f"{flow_run.state.name}, but its worker never reported its process ended; the "
            "state may have been set through the API while the job ran on. Billed to "
            f"max_runtime {job.max_runtime:.0f}s"
        )
        logger.warning("%s", warning)
        log(warning)
        try:  # the worker's cancellation kills the process by its infrastructure_pid
            client.set_flow_run_state(
                flow_run.id, Cancelling(message="Cancelled: unproven final state"), force=True
            )
        except Exception as exc:  # billed to max_runtime either way
            log(f"could not cancel flow run {flow_run.id}: {_first_line(exc)}")
        result = self._result(flow_run, created, started, "timed_out", ended=started)
        return LaunchResult(
            "timed_out",
            started,
            started + job.max_runtime,
            detail=warning,
            external_id=result.external_id,
            capacity_wait_s=result.capacity_wait_s,
        )

    def _result(
        self,
        flow_run: FlowRun,
        created: float,
        started: float | None,
        stopped_for: str | None,
        ended: float | None = None,
    ) -> LaunchResult:
        """`ended`: when its process ended, as its worker reported; else its end time."""
        assert flow_run.state is not None
        ended = _ended_at(flow_run) if ended is None else max(ended, _ended_at(flow_run))
        outcome = OUTCOME_OF.get(flow_run.state.type, "failed")
        if outcome != "completed" and stopped_for == "timed_out":
            outcome = "timed_out"
        elif outcome == "cancelled" and stopped_for == "wait_expired" and started is None:
            outcome = "wait_expired"
        began = ended if started is None else started
        detail = flow_run.state.name + (
            f": {flow_run.state.message}" if flow_run.state.message else ""
        )
        return LaunchResult(
            outcome,
            began,
            ended,
            detail=detail,
            external_id=str(flow_run.id),
            capacity_wait_s=max(0.0, began - created),
        )

    def _cancel(self, flow_run_id: UUID, why: str, log: Callable[[str], None]) -> None:
        """Ask for cancellation, as `prefect flow-run cancel` does. A run that has not started
        is cancelled at once by the server; a running one by its worker or runner."""
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state is None or _over(flow_run):
                return
            if flow_run.state.type != StateType.CANCELLING:
                client.set_flow_run_state(flow_run_id, Cancelling(message=f"Cancelled: {why}"))
        log(f"cancelling flow run {flow_run.name} ({flow_run_id}): {why}")

    def _wait_final(self, flow_run_id: UUID, timeout: float) -> FlowRun:
        """The flow run once it is `_over`, or as it is after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with get_client(sync_client=True) as client:
            while True:
                flow_run = client.read_flow_run(flow_run_id)
                if _over(flow_run) or time.monotonic() >= deadline:
                    return flow_run
                time.sleep(min(self.poll_s, 1.0))

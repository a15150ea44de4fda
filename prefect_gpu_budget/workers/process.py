"""`gpu-budget-process`: Prefect's process worker, with every flow run passing the gate first.

```bash
prefect work-pool create gpu --type gpu-budget-process
prefect worker start --pool gpu
```

The pool's job variables `instance_type`, `scope`, `max_runtime` (and `nodes`, `priority`,
`max_wait`, `provisioning`) are set on the pool or the deployment. Before the worker starts a
flow run, the run passes the gate: while it waits it is in `AwaitingBudget` with the reason as
its message, and the worker goes on serving other runs. A refused run ends `OverBudget` or
`AdmissionTimeout` without starting. An admitted run is stopped at `max_runtime` (SIGTERM,
`kill_grace`, SIGKILL) and settled from its process's real start and end; if the worker dies,
`reconcile` settles it from the ledger's heartbeats.

A run cancelled while it waits gives up its place within about a second.

A flow run's own job variables may narrow the deployment's scope (to a sub-scope) and nothing
else of the gate's: another scope, another instance type, a longer run or a higher priority is
refused in one line with nothing reserved.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.client.orchestration import get_client
from prefect.states import Failed, Pending, Scheduled
from prefect.workers.process import (
    ProcessJobConfiguration,
    ProcessVariables,
    ProcessWorker,
    ProcessWorkerResult,
)
from pydantic import Field

from prefect_gpu_budget.admission.gate import AdmissionRefused, GateEvents
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.policy import Decision
from prefect_gpu_budget.job import GpuJob, one_line
from prefect_gpu_budget.launchers.local import stop_pid
from prefect_gpu_budget.tasks.gpu_job import AWAITING_BUDGET, _gate
from prefect_gpu_budget.units import BudgetInputError, validate_scope

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import State

CANCEL_POLL_S = 1.0
"""How often a waiting run's state is read to see whether it was cancelled."""
GATE_VARIABLES = (
    "instance_type",
    "scope",
    "max_runtime",
    "nodes",
    "priority",
    "max_wait",
    "provisioning",
)


class GpuBudgetProcessVariables(ProcessVariables):
    instance_type: str | None = Field(
        default=None, description="What the run's machine is priced as, e.g. `local:a100x1`."
    )
    scope: str | None = Field(default=None, description="The budget scope the run spends in.")
    max_runtime: str | None = Field(
        default=None, description="The longest the run may take, e.g. '2h'; it is stopped then."
    )
    nodes: int = Field(default=1, description="Machines the run takes.")
    priority: str | int = Field(default=0, description="A priority class or -1000..1000.")
    max_wait: str | None = Field(
        default=None, description="The longest the run waits at the gate (default: the budget's)."
    )
    provisioning: str = Field(default="on-demand", description="on-demand, spot or flex-start.")


class GpuBudgetProcessJobConfiguration(ProcessJobConfiguration):
    instance_type: str | None = Field(default=None)
    scope: str | None = Field(default=None)
    max_runtime: str | None = Field(default=None)
    nodes: int = Field(default=1)
    priority: str | int = Field(default=0)
    max_wait: str | None = Field(default=None)
    provisioning: str = Field(default="on-demand")

    def gpu_job(self, name: str) -> tuple[GpuJob, str]:
        """The job and scope this run asks for; a one-line `BudgetInputError` if unusable."""
        if not self.scope or not self.instance_type or not self.max_runtime:
            raise BudgetInputError(
                "job_variables",
                "instance_type, scope and max_runtime must be set on the pool or the deployment",
            )
        job = GpuJob(
            instance_type=self.instance_type,
            max_runtime=self.max_runtime,
            nodes=self.nodes,
            priority=self.priority,
            max_wait=self.max_wait,
            provisioning=self.provisioning,
            name=name,
        )
        return job, validate_scope(self.scope)


def overrides_refusal(run_variables: dict[str, Any], deployed_scope: str | None) -> str:
    """Why a flow run's own job variables may not be used ("" if they may): a run may narrow
    its deployment's scope to a sub-scope, and change nothing else of the gate's."""
    for key in GATE_VARIABLES:
        if key not in run_variables:
            continue
        if key != "scope":
            return f"job variable {key} is the deployment's to set, not a run's"
        scope = str(run_variables["scope"])
        if (
            deployed_scope
            and scope != deployed_scope
            and not scope.startswith(deployed_scope + "/")
        ):
            return f"scope {scope!r} is not within the deployment's scope {deployed_scope!r}"
    return ""


class _StartWatch:
    """Passes the process's pid on to the worker, and records the start and the stop timer."""

    def __init__(self, inner: anyio.abc.TaskStatus[int], on_start: Any) -> None:
        self.inner, self.on_start = inner, on_start

    def started(self, value: int | None = None) -> None:
        if value is not None:
            self.on_start(value)
        self.inner.started(value)


class GpuBudgetProcessWorker(ProcessWorker):
    """Prefect's process worker, gated: see the module's docstring."""

    type = "gpu-budget-process"
    job_configuration = GpuBudgetProcessJobConfiguration
    job_configuration_variables = GpuBudgetProcessVariables
    _display_name = "GPU Budget Process"
    _description = (
        "Prefect's process worker with a budget gate: each flow run waits until it fits the "
        "hourly caps and period budgets of its scope, runs at most max_runtime, and is settled "
        "from its real start and end."
    )
    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"

    async def run(
        self,
        flow_run: FlowRun,
        configuration: GpuBudgetProcessJobConfiguration,  # type: ignore[override]
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> ProcessWorkerResult:
        status = task_status or anyio.TASK_STATUS_IGNORED
        deployed = None
        if flow_run.deployment_id:
            deployment = await self.client.read_deployment(flow_run.deployment_id)
            deployed = (deployment.job_variables or {}).get("scope") or _pool_default(
                self.work_pool
            )
        refusal = overrides_refusal(dict(flow_run.job_variables or {}), deployed)
        try:
            job, scope = configuration.gpu_job(flow_run.name)
        except (BudgetInputError, ValueError) as bad:
            refusal = refusal or one_line(bad)
        if refusal:
            return await self._end(flow_run, status, Failed(name="GateRefused", message=refusal))

        def waiting(_job_id: str, decision: Decision, _rules: object) -> None:
            message = f"waiting for budget: {decision.reason}"
            _set_state(
                flow_run.id,
                Scheduled(scheduled_time=_later(), name=AWAITING_BUDGET, message=message),
            )

        run_gate = _gate(None).with_events(GateEvents(queued=waiting))
        admitted = threading.Event()
        watch = threading.Thread(
            target=_give_up_when_cancelled,
            args=(run_gate.ledger, flow_run.id, scope, admitted),
            daemon=True,
        )
        watch.start()
        try:
            admission = await anyio.to_thread.run_sync(
                lambda: run_gate.admit(job, scope, flow_run_id=str(flow_run.id), launcher="worker")
            )
        except AdmissionRefused as refused:
            if not await anyio.to_thread.run_sync(lambda: _still_wanted(flow_run.id)):
                return await self._end(flow_run, status)  # cancelled: its place was given up
            state = Failed(name=refused.state_name, message=refused.reason)
            return await self._end(flow_run, status, state)
        finally:
            admitted.set()
        if not await anyio.to_thread.run_sync(lambda: _still_wanted(flow_run.id)):
            await anyio.to_thread.run_sync(  # cancelled as it was admitted: nothing ran
                lambda: run_gate.settle(admission, ended_at=time.time(), outcome="cancelled")
            )
            return await self._end(flow_run, status)
        await anyio.to_thread.run_sync(
            lambda: _set_state(flow_run.id, Pending(message=f"admitted: {admission.reason}"))
        )
        stopped: list[float] = []
        started: list[float] = []

        def on_start(pid: int) -> None:
            started.append(time.time())
            run_gate.started(admission, started[0], f"pid:{pid}")
            timer = threading.Timer(job.max_runtime, _stop, (pid, job.kill_grace, stopped))
            timer.daemon = True
            timer.start()
            watchers.append(timer)

        watchers: list[threading.Timer] = []
        outcome = "cancelled"
        try:
            result = await super().run(flow_run, configuration, _StartWatch(status, on_start))
            outcome = (
                "timed_out" if stopped else ("completed" if not result.status_code else "failed")
            )
            return result
        finally:
            for timer in watchers:
                timer.cancel()
            ended = time.time()
            await anyio.to_thread.run_sync(
                lambda: run_gate.settle(admission, ended_at=ended, outcome=outcome)
            )

    async def _end(
        self, flow_run: FlowRun, status: anyio.abc.TaskStatus[int], state: State | None = None
    ) -> ProcessWorkerResult:
        """End a run that never starts: in `state`, or as it stands (cancelled)."""
        if state is not None:
            await anyio.to_thread.run_sync(lambda: _set_state(flow_run.id, state))
        status.started(0)
        return ProcessWorkerResult(status_code=0, identifier="not-started")


def _pool_default(work_pool: Any) -> str | None:
    variables = (getattr(work_pool, "base_job_template", None) or {}).get("variables", {})
    return (variables.get("properties", {}).get("scope") or {}).get("default")


def _later() -> Any:
    from prefect.types._datetime import now

    return now("UTC") + timedelta(hours=1)  # never marked Late while it waits at the gate


def _give_up_when_cancelled(
    ledger: Ledger, flow_run_id: Any, scope: str, admitted: threading.Event
) -> None:
    """While the run waits at the gate, look every `CANCEL_POLL_S` whether it was cancelled,
    and if so give its place in the queue up (the waiting admission then ends refused)."""
    while not admitted.wait(CANCEL_POLL_S):
        try:
            if _still_wanted(flow_run_id):
                continue
            for row in ledger.jobs(flow_run_id=str(flow_run_id)):
                if row["state"] == "queued":
                    ledger.cancel_queued(row["id"], scope, "its flow run was cancelled")
            return
        except Exception:  # the API or the ledger is down: the gate's own patience applies
            continue


def _still_wanted(flow_run_id: Any) -> bool:
    """False once the run was cancelled (or otherwise ended) while it waited at the gate."""
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state is None or not (state.is_final() or state.is_cancelling())


def _set_state(flow_run_id: Any, state: State) -> None:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, state, force=True)


def _stop(pid: int, grace: float, stopped: list[float]) -> None:
    """SIGTERM the run's process (its group, when it leads one) at max_runtime, SIGKILL it
    after the grace."""
    stopped.append(time.time())
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    stop_pid(pid, grace, group=group)

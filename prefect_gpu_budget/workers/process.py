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
refused in one line with nothing reserved. With `require_agent_token` set on the deployment or
pool, a run must carry an agent's token (`agent_token`) and spends in its session only.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.workers.process import (
    ProcessJobConfiguration,
    ProcessVariables,
    ProcessWorker,
    ProcessWorkerResult,
)

from prefect_gpu_budget.launchers.local import stop_pid
from prefect_gpu_budget.workers.gating import GATE_VARIABLES as GATE_VARIABLES
from prefect_gpu_budget.workers.gating import (
    GateConfiguration,
    GateVariables,
    RunNotStarted,
    admit_flow_run,
)
from prefect_gpu_budget.workers.gating import overrides_refusal as overrides_refusal

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


class GpuBudgetProcessVariables(GateVariables, ProcessVariables):
    pass


class GpuBudgetProcessJobConfiguration(GateConfiguration, ProcessJobConfiguration):
    pass


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
        try:
            gated = await admit_flow_run(self, flow_run, configuration)
        except RunNotStarted:
            status.started(0)
            return ProcessWorkerResult(status_code=0, identifier="not-started")
        grace = gated.job.kill_grace

        def on_start(pid: int) -> None:
            gated.started(time.time(), f"pid:{pid}", lambda: _stop(pid, grace))

        return await gated.until_settled(
            super().run(flow_run, configuration, _StartWatch(status, on_start)),
            lambda result: "completed" if not result.status_code else "failed",
        )


def _stop(pid: int, grace: float) -> None:
    """SIGTERM the run's process (its group, when it leads one) at max_runtime, SIGKILL it
    after the grace."""
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    stop_pid(pid, grace, group=group)

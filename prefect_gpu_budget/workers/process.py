"""`gpu-budget-process`: Prefect's process worker, with every flow run passing the gate first.

```bash
prefect work-pool create gpu --type gpu-budget-process
prefect worker start --pool gpu
```

The pool's job variables `instance_type`, `scope`, `max_runtime` (and `nodes`, `priority`,
`max_wait`, `provisioning`, `requeue`) are set on the pool or the deployment. Before the worker starts a
flow run, the run passes the gate: while it waits it is in `AwaitingBudget` with the reason as
its message, and the worker goes on serving other runs. A refused run ends `OverBudget` or
`AdmissionTimeout` without starting. If the worker dies, `reconcile` settles its runs from the
ledger's heartbeats.

A run cancelled while it waits gives up its place within about a second.

The run is the whole process tree it starts. Its process runs under the local launcher's job
holder (`sandbox/holder.py`), in a session of its own: a child subreaper, so every
descendant that leaves the tree (`setsid`, `nohup ... &`, a double fork) is adopted by it, and
the holder ends only when the last of them has. At `max_runtime` (counted from the holder's
start) the whole tree gets SIGTERM and, `kill_grace` (10 s) later, SIGKILL (up to half a
second sooner: `KILL_MARGIN_S`, so that the kill lands within the reservation, max_runtime +
kill_grace); the run is billed from the holder's start until its last descendant ended;
anything still carrying the run's mark (`GPU_BUDGET_JOB_MARK`) once the holder is gone is
killed before the run is settled; if the worker dies, the holder kills the tree at once.
The same stop ends a run whose borrowed capacity in a pool is taken back (settled `preempted`,
the run ends `Preempted`, or is scheduled again to pass the gate anew when `requeue` is set, as
it is by default) or whose owner stops it (settled and ended `cancelled`): `lifecycle.Running`.

A flow run's own job variables may narrow the deployment's scope (to a sub-scope), carry an
agent's token, and set what the deployment lists in `run_may_set`; nothing else: another scope,
instance type, longer run or higher priority, and any `command`, `env`, `working_dir` or other
variable the deployment did not list, ends the run `GateRefused` in one line with nothing
reserved. With `require_agent_token` set on the deployment or pool, a run must carry an agent's
token (`agent_token`) and spends in its session only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.runner import _starter_engine
from prefect.workers.process import (
    ProcessJobConfiguration,
    ProcessVariables,
    ProcessWorker,
    ProcessWorkerResult,
)

from prefect_gpu_budget.launchers.local import (
    JOB_MARK_ENV,
    kill_marked,
    marked_processes,
    stop_pid,
)
from prefect_gpu_budget.sandbox.isolation import HOLDER_SCRIPT
from prefect_gpu_budget.worker_types import PROCESS_TYPE
from prefect_gpu_budget.workers.gating import (
    NOT_STARTED,
    GatedWorker,
)
from prefect_gpu_budget.workers.job_variables import GateConfiguration, GateVariables

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


class GpuBudgetProcessVariables(GateVariables, ProcessVariables):
    pass


class GpuBudgetProcessJobConfiguration(GateConfiguration, ProcessJobConfiguration):
    pass


KILL_MARGIN_S = 0.5
"""How much sooner than `kill_grace` after its SIGTERM the holder SIGKILLs the tree (at most
half the grace): the time a stop takes to arrive and a kill to land, so that the tree is gone,
and billed, within the run's reservation (max_runtime + kill_grace)."""


class _ProcessTree:
    """How one gated run's process is started (`_run_under_holder`): under the job holder,
    with the run's mark in its environment, in a session of its own; when it started, and when
    the holder (so the last process of the tree) ended."""

    def __init__(self, kill_grace: float) -> None:
        self.grace = max(0.0, kill_grace - min(KILL_MARGIN_S, kill_grace / 2))
        self.mark = uuid.uuid4().hex
        self.pid: int | None = None
        self.started_at: float | None = None
        self.exited_at: float | None = None
        self.ended_at: float | None = None

    def command(self, command: list[str]) -> list[str]:
        holder = [sys.executable, "-I", "-S", HOLDER_SCRIPT, "--grace", str(self.grace)]
        return [*holder, "--holder", str(os.getpid()), "--", *command]

    def watch_exit(self) -> threading.Thread:
        """Note when the holder exits, to the millisecond (without reaping it: its
        worker's `wait` does that), in a thread of its own."""

        def wait() -> None:
            assert self.pid is not None
            with contextlib.suppress(OSError):  # reaped already: it has exited by now
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            self.exited_at = time.time()

        thread = threading.Thread(
            target=wait, name=f"gpu-budget-holder-exit-{self.pid}", daemon=True
        )
        thread.start()
        return thread

    def ended(self) -> tuple[float, float | None]:
        """(ended_at, billed seconds) for the settlement: the tree's end, billed from the
        holder's start (`WorkerRun.started`)."""
        return (self.ended_at or time.time()), None


_PROCESS_TREE: ContextVar[_ProcessTree | None] = ContextVar("gpu_budget_process_tree", default=None)
"""The process tree of the gated run whose task this is (None in any other task)."""
_prefect_run_process = _starter_engine.run_process


async def _run_under_holder(command: list[str], **kwargs: Any) -> Any:
    """Prefect's `run_process` as its engine starter calls it (both of the process worker's
    ways, an explicit `command` or the workspace supervisor), but for a gated run's task: the
    command under the job holder, marked, in a new session, its clock started just before it
    is; once the holder has ended, whatever escaped it (it was SIGKILLed, say) is killed by its
    mark, and the tree's end is noted: the holder's exit, or the kill of an escaped process."""
    tree = _PROCESS_TREE.get()
    if tree is None or tree.pid is not None:
        return await _prefect_run_process(command, **kwargs)
    given = kwargs.get("task_status_handler")
    watch: list[threading.Thread] = []

    def spawned(process: Any) -> Any:
        tree.pid = process.pid
        watch.append(tree.watch_exit())
        return given(process) if given is not None else process.pid

    env = {**(kwargs.get("env") or os.environ), JOB_MARK_ENV: tree.mark}
    held = {**kwargs, "env": env, "start_new_session": True, "task_status_handler": spawned}
    tree.started_at = time.time()
    try:
        return await _prefect_run_process(tree.command(command), **held)
    finally:
        for thread in watch:
            thread.join(timeout=1.0)
        escaped = marked_processes(JOB_MARK_ENV, tree.mark)
        if escaped:
            kill_marked(tree.mark)
        tree.ended_at = time.time() if escaped or tree.exited_at is None else tree.exited_at


def _route_through_holder() -> None:
    """Route Prefect's engine starter through `_run_under_holder` (the seam Prefect names for
    it: the starter calls its module's `run_process`). Only a task with a `_PROCESS_TREE` is changed."""
    if _starter_engine.run_process is not _run_under_holder:
        _starter_engine.run_process = _run_under_holder


class NotHeld(RuntimeError):
    """The run's process was not started under its job holder: it is not run."""


class _StartWatch:
    """Passes the process's pid on to the worker, and records the start and the stop timer;
    a process that is not its run's holder is refused (`NotHeld`) before the worker sees it."""

    def __init__(self, inner: anyio.abc.TaskStatus[int], on_start: Any) -> None:
        self.inner, self.on_start = inner, on_start

    def started(self, value: int | None = None) -> None:
        if value is not None:
            self.on_start(value)
        self.inner.started(value)


class GpuBudgetProcessWorker(GatedWorker, ProcessWorker):
    """Prefect's process worker, gated: see the module's docstring."""

    type = PROCESS_TYPE
    job_configuration = GpuBudgetProcessJobConfiguration
    job_configuration_variables = GpuBudgetProcessVariables
    _display_name = "GPU Budget Process"
    _description = (
        "Prefect's process worker with a budget gate: each flow run waits until it fits the "
        "hourly caps and period budgets of its scope, runs at most max_runtime with every "
        "process it starts, and is settled from its real start to its last process's end."
    )

    async def run(
        self,
        flow_run: FlowRun,
        configuration: GpuBudgetProcessJobConfiguration,  # type: ignore[override]
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> ProcessWorkerResult:
        status = task_status or anyio.TASK_STATUS_IGNORED
        gated = await self.admit(flow_run, configuration, status, 0)
        if gated is None:
            return ProcessWorkerResult(status_code=0, identifier=NOT_STARTED)
        _route_through_holder()
        tree = _ProcessTree(gated.job.kill_grace)

        def on_start(pid: int) -> None:
            gated.started(tree.started_at or time.time(), f"pid:{pid}", lambda: _stop(tree))
            if pid != tree.pid:  # Prefect started it some other way: never run it unheld
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise NotHeld(f"process {pid} is not under the job holder: not run")

        token = _PROCESS_TREE.set(tree)
        try:
            return await gated.until_settled(
                super().run(flow_run, configuration, _StartWatch(status, on_start)),
                lambda result: "completed" if not result.status_code else "failed",
                tree.ended,
            )
        finally:
            _PROCESS_TREE.reset(token)


def _stop(tree: _ProcessTree) -> None:
    """Stop the run's tree when it must stop (at max_runtime, when the capacity it borrowed is
    taken back, or when its owner stops it: `lifecycle.Running`): SIGTERM to the holder and its group (the holder
    passes it to every descendant, and SIGKILLs them its grace later: `_ProcessTree.grace`), SIGKILL
    to the group if the holder has not ended shortly after that (what escaped the holder then
    is killed by its mark, `_run_under_holder`)."""
    pid = tree.pid
    if pid is None or tree.ended_at is not None:
        return
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    stop_pid(pid, tree.grace, group=group)

"""The budget gate of the worker types, one for all: a run's job bound to its agent's session
(`bind_to_agent`), the wait at the gate (`AwaitingBudget`, cancel gives
its place up), the stop at max_runtime, and the settlement once the run's infrastructure ends.

A worker type mixes `GateVariables` into its variables, `GateConfiguration` into its job
configuration and `GatedWorker` into the worker, and runs each flow run as

```python
run = await self.admit(flow_run, configuration, task_status, not_started)
if run is None:
    return Result(status_code=0, identifier=NOT_STARTED)  # refused, or cancelled while it waited
return await run.until_settled(super().run(...), outcome_of_the_result)
```

calling `run.started(at, external_id, stop)` when its infrastructure really starts. The job
variables and the rule for a run's own are `workers/job_variables.py`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
import anyio.abc
from prefect.client.orchestration import get_client
from prefect.states import Cancelled, Failed, Pending, Scheduled, State

from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.holding import Admission, GateEvents
from prefect_gpu_budget.admission.lifecycle import CANCELLED, COMPLETED, Running
from prefect_gpu_budget.job import GpuJob, one_line
from prefect_gpu_budget.launchers.base import LaunchConfigError
from prefect_gpu_budget.tasks.events import AWAITING_BUDGET, stopped_state
from prefect_gpu_budget.tasks.gpu_job import open_gate
from prefect_gpu_budget.units import BudgetInputError, narrowing_refusal

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.rules.policy import Decision

R = TypeVar("R")
log = logging.getLogger("prefect_gpu_budget.worker")
CANCEL_POLL_S = 1.0
"""How often a waiting run's state is read to see whether it was cancelled."""


def bind_to_agent(
    ledger: Ledger, token: str | None, job: GpuJob, scope: str, required: bool
) -> tuple[GpuJob, str]:
    """An agent's run spends in its token's session, as the agents' deployments do: the
    session must lie within the run's scope, and the job carries the grant, so it queues only
    while the grant is live. Without a token the run goes on as it is, unless one is
    `required`. A one-line `BudgetInputError` otherwise (nothing reserved)."""
    if not token:
        if required:
            raise BudgetInputError(
                "agent_token", "this deployment's runs must carry an agent's token"
            )
        return job, scope
    session, grant = ledger.grants.agent_grant(token)
    if why := narrowing_refusal(session, scope, "the run's"):
        raise BudgetInputError("agent_token", f"the token's session: {why}")
    return job.model_copy(update={"grant": grant}), session


class RunNotStarted(Exception):
    """The flow run ended at the gate, in the state it was given (or cancelled)."""


def refuse_shared_state(worker: Any) -> None:
    """At a gated worker's start (`setup`): refuse to run (exit 2) while PREFECT_HOME or a
    SQLite ledger is open to other users (`settings.check_private_state`); with
    PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME=1, warn loudly instead (`prefect worker start` owns
    the command line, so only the environment can allow it)."""
    from prefect_gpu_budget import settings

    try:
        warning = settings.check_private_state()
    except settings.SharedStateError as exc:
        worker._logger.error("%s", exc)
        raise SystemExit(2) from None
    if warning:
        worker._logger.warning("running with shared state, as allowed: %s", warning)


NOT_STARTED = "not-started"
"""The identifier of a flow run's result when it ended at the gate: no infrastructure ran."""


class GatedWorker:
    """What every gated worker type shares, first in its bases (`class
    GpuBudgetProcessWorker(GatedWorker, ProcessWorker)`): its documentation, its refusal to
    start on shared state (`refuse_shared_state`), and the gate each flow run passes before
    the worker type runs it (`admit`)."""

    _documentation_url = "https://github.com/prefect-gpu-budget/prefect-gpu-budget#readme"

    async def setup(self) -> None:
        refuse_shared_state(self)  # before anything polls: a shared home leaks the auth string
        await super().setup()  # type: ignore[misc]

    async def admit(
        self,
        flow_run: FlowRun,
        configuration: Any,
        task_status: anyio.abc.TaskStatus[Any] | None,
        not_started: Any,
    ) -> WorkerRun | None:
        """`flow_run` admitted (`admit_flow_run`); None when it ended at the gate, `task_status`
        then told `not_started` (what the worker type says for no infrastructure), and the
        worker type returns its result with the identifier `NOT_STARTED`."""
        try:
            return await admit_flow_run(self, flow_run, configuration)
        except RunNotStarted:
            (task_status or anyio.TASK_STATUS_IGNORED).started(not_started)
            return None


class WorkerRun:
    """One admitted flow run, its life after admission as every runner's (`lifecycle.Running`):
    its start recorded once; a graceful stop (the worker type's own: a process tree's SIGTERM,
    kill grace, SIGKILL; a cloud job's cancel) at max_runtime, when the capacity it borrowed
    in a pool is reclaimed, or when its owner stops it; settled once, for what ran."""

    def __init__(self, gate: Gate, admission: Admission, flow_run_id: Any = None) -> None:
        self.gate, self.admission, self.job = gate, admission, admission.job
        self.flow_run_id = flow_run_id
        self.running = Running(gate, admission, deadline=True)

    @property
    def started_at(self) -> float | None:
        """When its infrastructure started (None until it has)."""
        return self.running.started_at

    def started(self, at: float, external_id: str, stop: Callable[[], None]) -> None:
        """Its infrastructure started at `at`: record it, and call `stop` (once) at max_runtime
        (counted from `at`) or when its admission must stop (`Running`), once the flow run
        shows why (`_say_why`)."""
        self.running.started(at, external_id, partial(self._say_why, stop))

    def _say_why(self, stop: Callable[[], None]) -> None:
        """Before `stop`: put the flow run in the final state its stop names (`Preempted`,
        `TimedOut`, Cancelled: `stopped_state`), so that what the stopped process and
        Prefect's runner report of its end (Crashed) does not take its place; once settled,
        `until_settled` sets it again with the cost (or schedules the run again)."""
        if self.flow_run_id is not None:
            try:
                row = self.gate.ledger.views.job(self.admission.job_id)
                _set_state(self.flow_run_id, stopped_state(self.running, row))
            except Exception as exc:  # the stop goes on; the final state follows once settled
                log.warning("could not show why flow run %s stops: %s", self.flow_run_id, exc)
        stop()

    def submitted(self, external_id: str) -> None:
        """The cloud's id of a job that may still wait for capacity, for reconcile."""
        self.gate.holding.submitted(self.admission, external_id)

    async def until_settled(
        self,
        body: Awaitable[R],
        outcome: Callable[[R], str],
        ended: Callable[[], tuple[float, float | None]] | None = None,
    ) -> R:
        """Await `body` (the worker's own run), then settle once, whatever way it ends
        (`Running.ended`): named by the stop that ended it (`timed_out`, `preempted`, or
        `cancelled` by its owner), else `outcome` names how from its result, "failed" if it
        raised an error, "cancelled" if it was cancelled. `ended` gives (ended_at,
        billed_seconds) where the infrastructure reports them (Vertex: the job's times); else
        now and the gate's own.

        A run a stop ended ends in the state that names it (`events.stopped_state`); one
        scheduled again (preempted, its job asking to be requeued) passes the gate anew, and
        its result reports no crash."""
        error: BaseException | None = None
        returned = COMPLETED
        result: Any = None
        state: State | None = None
        try:
            result = await body
            returned = outcome(result)
        except BaseException as raised:
            error = raised
            raise
        finally:
            ended_at, billed = ended() if ended else (time.time(), None)
            with anyio.CancelScope(shield=True):  # a worker shutting down settles first
                row = await anyio.to_thread.run_sync(
                    partial(
                        self.running.ended,
                        error,
                        returned=returned,
                        ended_at=ended_at,
                        billed_seconds=billed,
                    )
                )
                if self.running.stopped_before(ended_at) is not None:  # a stop ended it
                    state = stopped_state(self.running, row)
                if state is not None and self.flow_run_id is not None:
                    try:
                        await anyio.to_thread.run_sync(_set_state, self.flow_run_id, state)
                    except Exception as exc:  # settled: only the run's shown state is lost
                        log.warning(
                            "could not set flow run %s %s: %s", self.flow_run_id, state.name, exc
                        )
        if state is not None and state.is_scheduled() and hasattr(result, "status_code"):
            result = result.model_copy(update={"status_code": 0})  # requeued, not crashed
        return result


async def admit_flow_run(worker: Any, flow_run: FlowRun, configuration: Any) -> WorkerRun:
    """Pass the gate before `worker` starts `flow_run`: refuse bad or widening variables in one
    line with nothing reserved (`GateRefused`), wait in `AwaitingBudget` (a cancel gives the
    place up), end `OverBudget` / `AdmissionTimeout` when refused. Raises `RunNotStarted` when
    the run does not start (its state is set); else the run is Pending, admitted."""
    run_gate = await anyio.to_thread.run_sync(open_worker_gate)
    job, scope = await _checked_job(run_gate, flow_run, configuration)
    run_gate = run_gate.with_events(GateEvents(queued=partial(_show_waiting, flow_run.id)))
    admission = await _wait_at_gate(run_gate, flow_run, job, scope, f"worker:{worker.type}")
    run = WorkerRun(run_gate, admission, flow_run.id)
    if not await anyio.to_thread.run_sync(_still_wanted, flow_run.id):
        # cancelled as it was admitted: nothing ran
        await anyio.to_thread.run_sync(run.running.settlement.settle, CANCELLED)
        await _end(flow_run)
    await anyio.to_thread.run_sync(
        _set_state, flow_run.id, Pending(message=f"admitted: {admission.reason}")
    )
    return run


async def _checked_job(run_gate: Gate, flow_run: FlowRun, configuration: Any) -> tuple[GpuJob, str]:
    """The run's job and scope, bound to its agent and checked by the worker type; the run
    ends `GateRefused` (`RunNotStarted`) for its own variables or a job that cannot run."""
    refusal = configuration.run_refusal
    if refusal is None:  # built some other way: its variables' origin is unknown
        refusal = "the run's own job variables could not be checked: not run"
    try:
        job, scope = configuration.gpu_job(flow_run.name)
        job, scope = await anyio.to_thread.run_sync(
            bind_to_agent,
            run_gate.ledger,
            configuration.agent_token,
            job,
            scope,
            configuration.require_agent_token,
        )
        configuration.preflight(job, run_gate.quote(job))
    except (BudgetInputError, LaunchConfigError, ValueError) as bad:
        refusal = refusal or one_line(bad)
    if refusal:
        await _end(flow_run, Failed(name="GateRefused", message=refusal))
    return job, scope


def _show_waiting(flow_run_id: Any, _job_id: str, decision: Decision, _rules: object) -> None:
    """The run waits at the gate: shown `AwaitingBudget`, with the reason."""
    message = f"waiting for budget: {decision.reason}"
    waits = Scheduled(scheduled_time=_later(), name=AWAITING_BUDGET, message=message)
    # proposed, not forced: a cancel that came first (the run's row was queued a moment
    # before) stands, and the watcher then gives the place up
    _set_state(flow_run_id, waits, force=False)


async def _wait_at_gate(
    run_gate: Gate, flow_run: FlowRun, job: GpuJob, scope: str, launcher: str
) -> Admission:
    """The job admitted, while a watcher gives its place up if the run is cancelled; a
    refused run ends in the refusal's state (`RunNotStarted`), a cancelled one cancelled."""
    admitted = threading.Event()
    watch = threading.Thread(
        target=_give_up_when_cancelled,
        args=(run_gate.ledger, flow_run.id, scope, admitted),
        daemon=True,
    )
    watch.start()
    try:
        return await anyio.to_thread.run_sync(
            partial(run_gate.admit, job, scope, flow_run_id=str(flow_run.id), launcher=launcher)
        )
    except AdmissionRefused as refused:
        if not await anyio.to_thread.run_sync(_still_wanted, flow_run.id):
            await _end(flow_run)  # cancelled: its place was given up
        await _end(flow_run, Failed(name=refused.state_name, message=refused.reason))
    finally:
        admitted.set()


def open_worker_gate() -> Gate:
    """The worker process's gate: opening it (the ledger's engine and schema check) is retried
    while the ledger is down, as every later call is, saying so in the worker's log."""
    return open_gate(None, log.warning)


async def _end(flow_run: FlowRun, state: State | None = None) -> NoReturn:
    """End a run that never starts: in `state`, or cancelled."""
    if state is not None:
        await anyio.to_thread.run_sync(_set_state, flow_run.id, state)
    else:
        try:
            await anyio.to_thread.run_sync(_cancelled, flow_run.id)
        except Exception as exc:  # the API down: Prefect's worker sets it when it hears
            log.warning("could not set cancelled run %s Cancelled: %s", flow_run.id, exc)
    raise RunNotStarted(state.name if state else "cancelled")


def _cancelled(flow_run_id: Any) -> None:
    """Set a run left Cancelling Cancelled, as Prefect's worker does for a run with no
    infrastructure: that worker hears of a cancel from an event, which it may miss."""
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    if state is not None and state.is_cancelling():
        _set_state(flow_run_id, Cancelled(message="cancelled while it waited: nothing ran"))


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
            for row in ledger.views.jobs(flow_run_id=str(flow_run_id)):
                if row["state"] == "queued":
                    ledger.queue.cancel_queued(row["id"], scope, "its flow run was cancelled")
            return
        except Exception:  # the API or the ledger is down: the gate's own patience applies
            continue


def _still_wanted(flow_run_id: Any) -> bool:
    """False once the run was cancelled (or otherwise ended) while it waited at the gate."""
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state is None or not (state.is_final() or state.is_cancelling())


def _set_state(flow_run_id: Any, state: State, force: bool = True) -> None:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, state, force=force)

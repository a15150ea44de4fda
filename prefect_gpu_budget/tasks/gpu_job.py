"""The Prefect tasks: `admit` (the gate), `settle`, and `run_gpu_job` (gate -> launch -> settle).

Prefect sits here, at the edge: the job's life itself (run it, settle it once, requeue it when
preempted) is `admission/lifecycle.py`, which knows no Prefect; the gate's events become run
logs, Prefect events and a notification in `tasks/events.py`; here are the tasks, the run's
process-wide gate and the custom-named final states (`OverBudget`, `AdmissionTimeout`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.states import Cancelled, Failed, State

from prefect_gpu_budget.admission.admin_settings import limits_for
from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.ledger import PREEMPTED, STOPPED
from prefect_gpu_budget.admission.lifecycle import TIMED_OUT, Ended, run_job
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.outages import patiently
from prefect_gpu_budget.admission.rules.timing import REQUEST_PATIENCE_S
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import INTERRUPTED, LaunchConfigError, Launcher
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.placement.history import TAKEN_BACK
from prefect_gpu_budget.placement.recorded import place_line
from prefect_gpu_budget.settings import METRICS_ENV
from prefect_gpu_budget.tasks.events import prefect_events
from prefect_gpu_budget.tasks.logs import install as _reason_once
from prefect_gpu_budget.units import (
    BudgetInputError,
    fmt_duration,
    fmt_usd,
    micro_to_usd,
    org_of,
    redact_urls,
)

_reason_once()  # a failed task's reason once in its run's logs (tasks/logs.py)


@dataclass(frozen=True)
class JobResult:
    """What a finished GPU job reports back to its flow."""

    job_id: str
    scope: str
    outcome: str
    exit_code: int | None
    runtime_s: float
    waited_s: float
    """Time from request to start: the gate's queue plus any wait for cloud capacity."""
    rate_usd_per_hour: float
    reserved_usd: float
    actual_usd: float
    detail: str = ""
    placements: tuple[str, ...] = ()
    """Each place a job asking for accelerators ran in, its outcome and cost, in order."""


_gates: dict[str | None, Gate] = {}
_gates_lock = threading.Lock()


def _gate(ledger_url: str | None) -> Gate:
    """One gate per process and ledger: its engine, Prefect client and limit cache are shared by
    every job of the process, and built once even when many task threads start at the same
    moment (otherwise each built its own and they raced to create the same Prefect limits)."""
    with _gates_lock:
        if ledger_url not in _gates:
            ledger = SpendLedger(database_url=ledger_url).ledger()
            from prefect.client.orchestration import get_client

            client = get_client(sync_client=True, httpx_settings={"timeout": 30})
            client.__enter__()
            _gates[ledger_url] = Gate(ledger, RateLimits(client))
        return _gates[ledger_url]


def gate_for_run(scope: str, job: GpuJob, ledger: SpendLedger | None) -> Gate:
    """The process's gate telling this run's events. Opening it (the ledger's engine and
    schema check, the Prefect client) is retried while a dependency is down, as every later
    call is: the run says so in its log and goes on once it is back."""
    events = prefect_events(scope, job)
    return open_gate(ledger.url() if ledger else None, events.warning).with_events(events)


def open_gate(url: str | None, warning: Callable[[str], None]) -> Gate:
    """The process's gate for the ledger at `url` (None: the configured one), opened
    patiently: while the ledger is down, `warning` hears so and opening is retried."""
    return patiently("opening the ledger", lambda: _gate(url), warning, REQUEST_PATIENCE_S)


_ENDINGS = {TIMED_OUT: "TimedOut", PREEMPTED: "Preempted", INTERRUPTED: "Interrupted"}
"""The Failed state's name for a launcher job a stop ended (not requeued)."""


def current_flow_run_id() -> str | None:
    ctx = TaskRunContext.get()
    return str(ctx.task_run.flow_run_id) if ctx and ctx.task_run.flow_run_id else None


@task(
    name="gpu-budget-admit",
    task_run_name="admit {job.instance_type} in {scope}",
    cache_policy=NO_CACHE,
)
def admit(job: GpuJob, scope: str, ledger: SpendLedger | None = None) -> Admission:
    """The gate: wait until the job fits every budget on its path, or end in a named state.

    Returns the `Admission` to hand to `settle` once the job ends; its rate slots stay leased
    and its reservation stays held until then.
    """
    gate = gate_for_run(scope, job, ledger)
    try:
        return gate.admit(job, scope, flow_run_id=current_flow_run_id())
    except AdmissionRefused as refused:
        return Failed(name=refused.state_name, message=refused.reason)  # type: ignore[return-value]


@task(name="gpu-budget-settle", cache_policy=NO_CACHE)
def settle(
    admission: Admission,
    started_at: float,
    ended_at: float,
    outcome: str,
    actual_usd_micro: int | None = None,
    ledger: SpendLedger | None = None,
) -> dict[str, Any]:
    """Settle an admitted job once: actual cost replaces the reservation; slots are released."""
    gate = gate_for_run(admission.scope, admission.job, ledger)
    if started_at is not None:
        gate.holding.started(admission, started_at)
    return gate.holding.settle(
        admission, ended_at=ended_at, outcome=outcome, actual_micro=actual_usd_micro
    )


# Never cached: a cached result would skip the gate and the spend it guards.
@task(
    name="run-gpu-job",
    task_run_name="gpu-job {job.instance_type} in {scope}",
    cache_policy=NO_CACHE,
)
def run_gpu_job(
    job: GpuJob,
    scope: str,
    ledger: SpendLedger | None = None,
    metrics_file: str | None = None,
    launcher: Launcher | None = None,
) -> JobResult:
    """Gate -> launch -> settle, whatever way the job ends.

    `launcher` runs the admitted job: the local launcher by default, or a Vertex AI, SageMaker
    or deployment launcher block. Its settings are checked before anything is reserved
    (`LaunchConfigError`). A job refused by the gate ends in `OverBudget` or `AdmissionTimeout`
    with the reason. The command finds `GPU_BUDGET_METRICS_FILE` in its environment.

    A job that asks for accelerators is placed first (`placed`); one with a checkpoint whose
    machine is taken back is settled for what it ran and placed again, each place passing the
    gate, at most `max_placements` times while its deadline allows (`JobResult.placements`).
    """
    logger = get_run_logger()
    gate = gate_for_run(scope, job, ledger)
    env = {METRICS_ENV: metrics_file} if metrics_file else {}
    asked: GpuJob | None = job
    parts: list[str] = []
    since = time.time()
    while asked is not None:
        ran = _run_once(asked, scope, gate, launcher, env, logger)
        if isinstance(ran, State):
            return ran  # type: ignore[return-value]
        admission, ended = ran
        parts.append(place_line(ended.row))
        asked = _placed_again(job, ended, len(parts), time.time() - since, logger)
    if ended.result.outcome != "completed":
        return _unfinished_state(ended)  # type: ignore[return-value]
    return replace(_job_result(admission, ended, scope), placements=tuple(parts))


def _run_once(
    job: GpuJob, scope: str, gate: Gate, launcher: Launcher | None, env: dict, logger: Any
) -> State | tuple[Admission, Ended]:
    """One place of the job: placed (if it asks for accelerators), checked by its launcher,
    admitted, run and settled; or the state it ends in without running."""
    try:
        job, placed_on = placed(job, scope, gate, logger.info, launcher)
    except BudgetInputError as unplaceable:  # nothing is reserved for a job that has no place
        logger.error("GPU job not placed: %s", unplaceable)
        return Failed(name="Unplaceable", message=str(unplaceable))
    launcher = launcher or placed_on or LocalLauncher()
    try:
        launcher.preflight(job, gate.quote(job))
    except LaunchConfigError as bad:
        logger.error("GPU job not launched: %s", redact_urls(str(bad)))
        return Failed(name="LaunchConfigError", message=redact_urls(str(bad)))
    try:
        return run_job(
            gate,
            job,
            scope,
            launcher,
            flow_run_id=current_flow_run_id(),
            env=env,
            log=lambda line: logger.info("| %s", line),
            requeued=partial(_say_requeued, logger),
        )
    except AdmissionRefused as refused:
        if refused.state_name == "Cancelled":  # its owner cancelled it while it waited
            return Cancelled(message=refused.reason)
        return Failed(name=refused.state_name, message=refused.reason)


def _placed_again(
    job: GpuJob, ended: Ended, places: int, elapsed_s: float, logger: Any
) -> GpuJob | None:
    """The job to place again after its machine was taken back (a pool's preemption, a cloud's
    spot interruption), or None: it asked for accelerators and has a checkpoint, has places
    left, and its deadline leaves a whole run."""
    if job.placed or job.checkpoint is None or ended.result.outcome not in TAKEN_BACK:
        return None
    left = None if job.deadline is None else job.deadline - elapsed_s
    if places >= job.max_placements or (left is not None and left < job.max_runtime):
        return None
    logger.warning(
        "GPU job was interrupted after %s (cost %s); placing it again (place %d of at most %d)",
        fmt_duration(ended.result.runtime_s),
        fmt_usd(ended.row["actual_micro"] or 0),
        places + 1,
        job.max_placements,
    )
    return job.model_copy(update={"deadline": left})


def placed(
    job: GpuJob, scope: str, gate: Gate, say: Callable[[str], Any], launcher: Any = None
) -> tuple[GpuJob, Any]:
    """A job that asks for accelerators, placed on the cheapest offering that fits (every
    offering considered said on the run's log), with the saved launcher block that starts it
    (None: a pool's machine, or a job that named its machine, returned as it is). Given a
    `launcher`, only its own offerings: a cloud launcher's, or the org's pools for one that runs
    here (the local launcher; `"local"` for a task's own body). An agent's job (`grant`) given
    no launcher is placed only on the routes its team's limits grant (`AgentLimits.launchers`):
    a launcher it names was held to them when its sweep was checked."""
    if job.placed:
        return job, None
    from prefect_gpu_budget.placement.placing import place_job
    from prefect_gpu_budget.placement.routes import launcher_route, pool_routes

    routes = None
    if launcher is not None:
        own = launcher_route("the job's launcher", launcher)
        routes = [own] if own else pool_routes(gate.ledger, org=org_of(scope))
    # an agent's job: only where its team's limits let its agents launch
    allowed = (
        limits_for(gate.ledger.grants, scope).launchers if job.grant and routes is None else None
    )
    where = place_job(job, scope, gate.ledger, routes=routes, allowed=allowed)
    for line in where.lines():
        say(f"placement: {line}")
    return where.job, where.launcher


def _say_requeued(logger: Any, admission: Admission, ended: Ended) -> None:
    """A preempted job that asked to be requeued is queued again: say so, with its cost."""
    logger.warning(
        "GPU job %s was preempted after %s (cost %s); queued again",
        admission.job_id[:8],
        fmt_duration(ended.result.runtime_s),
        fmt_usd(ended.row["actual_micro"] or 0),
    )


def _job_result(admission: Admission, ended: Ended, scope: str) -> JobResult:
    """What the task returns for a job that ran: its outcome, times and costs."""
    result, row = ended.result, ended.row
    return JobResult(
        job_id=admission.job_id,
        scope=scope,
        outcome=result.outcome,
        exit_code=result.exit_code,
        runtime_s=result.runtime_s,
        waited_s=admission.waited_s + result.capacity_wait_s,
        rate_usd_per_hour=micro_to_usd(admission.quote.rate_micro_per_hour),
        reserved_usd=micro_to_usd(row["reserved_micro"]),
        actual_usd=micro_to_usd(row["actual_micro"] or 0),
        detail=redact_urls(result.detail),
    )


def _unfinished_state(ended: Ended) -> State:
    """The task's final state for a job that did not complete: Cancelled by its owner's stop,
    else one name per ending, as @gpu_task's and the worker types' (`events.stopped_state`)."""
    result, row = ended.result, ended.row
    message = redact_urls(
        f"{result.outcome}: {result.detail}; cost {fmt_usd(row['actual_micro'] or 0)}"
    )
    if ended.stopped == STOPPED:  # its owner's stop (`lifecycle.owner_stop_words`)
        return Cancelled(message=message)
    return Failed(name=_ENDINGS.get(result.outcome, "GpuJobFailed"), message=message)

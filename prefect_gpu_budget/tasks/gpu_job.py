"""The Prefect tasks: `admit` (the gate), `settle`, and `run_gpu_job` (gate -> launch -> settle).

Prefect sits here, at the edge: the gate's events become run logs, Prefect events
(`gpu-budget.job.queued|admitted|rejected|settled`), a notification to the researcher when a job
starts waiting, and custom-named final states (`OverBudget`, `AdmissionTimeout`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import StateType
from prefect.context import TaskRunContext
from prefect.events import emit_event
from prefect.states import Failed, Running, State
from prefect.utilities.engine import emit_task_run_state_change_event

from prefect_gpu_budget.admission import periods
from prefect_gpu_budget.admission.gate import Admission, AdmissionRefused, Gate, GateEvents
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.outages import patiently
from prefect_gpu_budget.admission.policy import BudgetRule, Decision
from prefect_gpu_budget.admission.timing import REQUEST_PATIENCE_S
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.job import METRICS_ENV, GpuJob
from prefect_gpu_budget.launchers.base import LaunchConfigError, Launcher, LaunchResult
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.launchers.registry import launcher_ref
from prefect_gpu_budget.units import fmt_duration, fmt_usd, micro_to_usd, redact_urls


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


_warned: set[str] = set()


def _refresh_hint(admission: Admission) -> str:
    cloud = admission.quote.row.key.split(":")[0]
    if cloud in ("aws", "gcp"):
        return f" (refresh with `prefect-gpu-budget prices refresh --{cloud}`)"
    return " (set it with `prefect-gpu-budget prices set-local`)"


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


def _resource(job_id: str, scope: str) -> dict[str, str]:
    return {
        "prefect.resource.id": f"gpu-budget.job.{job_id}",
        "prefect.resource.name": scope,
        "gpu-budget.scope": scope,
    }


def _notify_once(rules: list[BudgetRule], body: str, subject: str) -> None:
    from prefect.blocks.core import Block

    targets = [r.notify_block for r in reversed(rules) if r.notify_block]
    if not targets:
        return
    block = Block.load(targets[0])
    block.notify(body=body, subject=subject)


AWAITING_BUDGET = "AwaitingBudget"
"""The state a task run shows while its job waits at the gate (as Prefect shows
`AwaitingConcurrencySlot`): a Scheduled-type state whose message is the reason."""


def _show_state(ctx: TaskRunContext | None, state: State) -> None:
    """Show `state` on the task run in the UI while its body goes on (the task engine keeps its
    own state: it still ends the run Completed or Failed, later and so on top)."""
    if ctx is None:
        return
    emit_task_run_state_change_event(
        task_run=ctx.task_run, initial_state=ctx.task_run.state, validated_state=state
    )


def prefect_events(scope: str, job: GpuJob) -> GateEvents:
    """Gate events as Prefect logs, events and notifications for the current run."""
    logger = get_run_logger()
    ctx = TaskRunContext.get()
    shown_waiting: list[bool] = []

    def queued(job_id: str, decision: Decision, rules: list[BudgetRule]) -> None:
        resumes = ""
        if decision.resumes_at:
            resumes = f" (resets {periods.fmt_instant(decision.resumes_at, 'UTC')})"
        logger.warning("GPU job %s queued in %s: %s%s", job_id[:8], scope, decision.reason, resumes)
        shown_waiting.append(True)
        _show_state(
            ctx,
            State(
                type=StateType.SCHEDULED,
                name=AWAITING_BUDGET,
                message=f"waiting for budget: {decision.reason}{resumes}",
            ),
        )
        emit_event(
            event="gpu-budget.job.queued",
            resource=_resource(job_id, scope),
            payload={
                "reason": decision.reason,
                "limit": decision.limit,
                "blocking_scope": decision.scope,
                "instance_type": job.instance_type,
                "nodes": job.nodes,
            },
        )
        try:
            _notify_once(
                rules,
                f"GPU job {job.name or job.instance_type} in {scope} is waiting: {decision.reason}",
                subject=f"GPU budget: job waiting in {scope}",
            )
        except Exception as exc:  # a failed notification never blocks the gate
            logger.warning("could not send the waiting notification: %s", exc)

    def waiting(job_id: str, decision: Decision) -> None:
        logger.info("GPU job %s still waiting: %s", job_id[:8], decision.reason)

    def admitted(admission: Admission) -> None:
        if shown_waiting:
            _show_state(ctx, Running(message=f"admitted after {fmt_duration(admission.waited_s)}"))
        logger.info(
            "GPU job %s admitted in %s after %s: %s",
            admission.job_id[:8],
            scope,
            fmt_duration(admission.waited_s),
            admission.reason,
        )
        for warning in admission.quote.warnings:
            if warning not in _warned:  # once per process, not once per trial
                _warned.add(warning)
                logger.warning("price warning: %s%s", warning, _refresh_hint(admission))
        emit_event(
            event="gpu-budget.job.admitted",
            resource=_resource(admission.job_id, scope),
            payload={
                "reserved_usd": micro_to_usd(admission.reserved_micro),
                "rate_usd_per_hour": micro_to_usd(admission.quote.rate_micro_per_hour),
                "waited_s": round(admission.waited_s, 3),
            },
        )

    def refused(job_id: str, refused: AdmissionRefused) -> None:
        logger.error("GPU job %s in %s: %s", job_id[:8], scope, refused)
        emit_event(
            event="gpu-budget.job.rejected",
            resource=_resource(job_id, scope),
            payload={"state": refused.state_name, "reason": refused.reason},
        )

    def settled(admission: Admission, row: dict[str, Any]) -> None:
        logger.info(
            "GPU job %s settled (%s): %s of %s reserved",
            admission.job_id[:8],
            row["outcome"],
            fmt_usd(row["actual_micro"] or 0),
            fmt_usd(row["reserved_micro"]),
        )
        emit_event(
            event="gpu-budget.job.settled",
            resource=_resource(admission.job_id, scope),
            payload={
                "outcome": row["outcome"],
                "actual_usd": micro_to_usd(row["actual_micro"] or 0),
                "reserved_usd": micro_to_usd(row["reserved_micro"]),
                "billed_seconds": row["billed_seconds"],
            },
        )

    def warning(message: str) -> None:
        logger.warning("GPU budget gate: %s", message)

    return GateEvents(
        queued=queued,
        waiting=waiting,
        admitted=admitted,
        refused=refused,
        settled=settled,
        warning=warning,
    )


def gate_for_run(scope: str, job: GpuJob, ledger: SpendLedger | None) -> Gate:
    """The process's gate telling this run's events. Opening it (the ledger's engine and
    schema check, the Prefect client) is retried while a dependency is down, as every later
    call is: the run says so in its log and goes on once it is back."""
    events, url = prefect_events(scope, job), ledger.url() if ledger else None
    gate = patiently("opening the ledger", lambda: _gate(url), events.warning, REQUEST_PATIENCE_S)
    return gate.with_events(events)


def _flow_run_id() -> str | None:
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
        return gate.admit(job, scope, flow_run_id=_flow_run_id())
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
        gate.started(admission, started_at)
    return gate.settle(admission, ended_at=ended_at, outcome=outcome, actual_micro=actual_usd_micro)


def _launch(
    gate: Gate,
    admission: Admission,
    launcher: Launcher,
    env: dict[str, str],
    log: Callable[[str], None],
) -> tuple[LaunchResult, dict[str, Any]]:
    """Run an admitted job and settle it once, whatever way it ends. A job asked to give its
    capacity back (preempted) is stopped gracefully: SIGTERM or the cloud's stop, then its
    grace period to checkpoint, then a kill; it pays for what it used."""
    job = admission.job
    started_as: list[str] = []

    stopped: list[float] = []

    def stop() -> None:
        if started_as:
            stopped.append(time.time())
            launcher.stop(started_as[0], grace=job.kill_grace)

    def on_start(started: float, external_id: str) -> None:
        started_as.append(external_id)
        gate.started(admission, started, external_id)
        if admission.preempted.is_set():  # asked before it even started
            threading.Thread(target=stop, daemon=True).start()

    admission.on_preempt = stop
    result = None
    try:
        result = launcher.run(
            job,
            admission.quote,
            on_start=on_start,
            log=log,
            env=env,
            on_submit=lambda external_id: gate.submitted(admission, external_id),
        )
    finally:
        if result is None:  # cancelled or crashed mid-run: bill until now
            row = gate.settle(admission, ended_at=time.time(), outcome="cancelled")
        else:
            if stopped and stopped[0] < result.ended_at:  # it ended because it was stopped
                result = replace(result, outcome="preempted", detail="preempted: " + result.detail)
            row = gate.settle(
                admission,
                ended_at=result.ended_at,
                outcome=result.outcome,
                billed_seconds=result.billed_seconds,
                actual_micro=result.actual_micro,
            )
    return result, row


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
    """
    logger = get_run_logger()
    gate = gate_for_run(scope, job, ledger)
    launcher = launcher or LocalLauncher()
    try:
        launcher.preflight(job, gate.quote(job))
    except LaunchConfigError as bad:
        logger.error("GPU job not launched: %s", redact_urls(str(bad)))
        return Failed(name="LaunchConfigError", message=redact_urls(str(bad)))  # type: ignore[return-value]
    env = {METRICS_ENV: metrics_file} if metrics_file else {}
    while True:
        try:
            admission = gate.admit(
                job, scope, flow_run_id=_flow_run_id(), launcher=launcher_ref(launcher)
            )
        except AdmissionRefused as refused:
            return Failed(name=refused.state_name, message=refused.reason)  # type: ignore[return-value]
        result, row = _launch(
            gate, admission, launcher, env, lambda line: logger.info("| %s", line)
        )
        if result.outcome != "preempted" or not job.requeue:
            break
        logger.warning(
            "GPU job %s was preempted after %s (cost %s); queued again",
            admission.job_id[:8],
            fmt_duration(result.runtime_s),
            fmt_usd(row["actual_micro"] or 0),
        )
    out = JobResult(
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
    if result.outcome != "completed":
        message = redact_urls(
            f"{result.outcome}: {result.detail}; cost {fmt_usd(row['actual_micro'] or 0)}"
        )
        return Failed(name="GpuJobFailed", message=message)  # type: ignore[return-value]
    return out

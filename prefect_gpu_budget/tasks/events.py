"""The Prefect event adapter: a gate's events (`GateEvents`) as the current run's logs, Prefect
events (`gpu-budget.job.queued|admitted|rejected|settled`), the task run's shown state while a
job waits (`AwaitingBudget`), a notification to the researcher when a job starts waiting, and
the state a run ends in when a stop ended its job (`stopped_state`).
"""

from __future__ import annotations

import re
from typing import Any

from prefect import get_run_logger
from prefect.client.schemas.objects import StateType
from prefect.context import TaskRunContext
from prefect.events import emit_event
from prefect.states import Cancelled, Failed, Running, Scheduled, State
from prefect.utilities.engine import emit_task_run_state_change_event

from prefect_gpu_budget.admission.gate import AdmissionRefused
from prefect_gpu_budget.admission.holding import Admission, GateEvents
from prefect_gpu_budget.admission.ledger import PREEMPTED
from prefect_gpu_budget.admission.lifecycle import TIMED_OUT
from prefect_gpu_budget.admission.lifecycle import Running as RunningJob
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Decision
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.units import fmt_duration, fmt_usd, micro_to_usd

_warned: set[str] = set()


def _refresh_hint(admission: Admission) -> str:
    cloud = admission.quote.row.key.split(":")[0]
    if cloud in ("aws", "gcp"):
        return f" (refresh with `prefect-gpu-budget prices refresh --{cloud}`)"
    return " (set it with `prefect-gpu-budget prices set-local`)"


def _why(decision: Decision) -> str:
    """What blocks a job, said once: its reason, and when the period that blocks it resets
    unless the reason says so already."""
    if not decision.resumes_at or "resets" in decision.reason:
        return decision.reason
    return f"{decision.reason} (resets {periods.fmt_instant(decision.resumes_at, 'UTC')})"


_BY = re.compile(r"\((?:over|short) by [^)]*\)")
_PLACE = re.compile(r" \(priority [^)]*\)")


def short_why(decision: Decision) -> str:
    """What blocks a job, as a log line says it: the first limit that blocks it, by how much,
    and when a period that blocks it resets; `(and N more limits)` for the others. The whole reason
    stays in the run's state and the `queued` event."""
    first, *more = decision.reason.split("; blocked by ")
    head, _, detail = first.partition(": ")
    if head.startswith("blocked by ") and detail:
        by = _BY.search(detail)
        said = head.removeprefix("blocked by ") + (f" {by.group(0)}" if by else "")
    else:  # waiting behind another job, an agent's limit ...: its own words, less its place
        said = _PLACE.sub("", first)
    if decision.limit == "period_budget" and decision.resumes_at:
        said += f", resets {periods.fmt_instant(decision.resumes_at, 'UTC')}"
    if more:
        said += f" (and {len(more)} more limit{'s' if len(more) > 1 else ''})"
    return said


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


def stopped_state(running: RunningJob, row: dict[str, Any]) -> State:
    """The state of a run (a `@gpu_task`'s task run, a worker type's flow run) whose job a stop
    ended, its ledger row `row`: `Preempted` (Failed: the capacity it borrowed in a pool was
    taken back), or once settled Scheduled again (`AwaitingBudget`) when its job asks to be
    queued again (`GpuJob.requeue`); `TimedOut` (Failed) at max_runtime; Cancelled when its
    owner stopped it. Its message says who stopped it, why, and what it cost
    (`Running.stop_message`)."""
    message, outcome = running.stop_message(row), running.stopped_as(row)
    if outcome == PREEMPTED and running.requeue:
        return Scheduled(name=AWAITING_BUDGET, message=f"{message}; queued again")
    if outcome == PREEMPTED:
        return Failed(name="Preempted", message=message)
    if outcome == TIMED_OUT:
        return Failed(name="TimedOut", message=message)
    return Cancelled(message=message)


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
    said = RunEvents(scope, job, get_run_logger(), TaskRunContext.get())
    return GateEvents(
        queued=said.queued,
        waiting=said.waiting,
        admitted=said.admitted,
        refused=said.refused,
        settled=said.settled,
        warning=said.warning,
    )


class RunEvents:
    """What the gate says of one job, said for the current run: each event a log line, a
    Prefect event, and while the job waits the task run's `AwaitingBudget` state."""

    def __init__(self, scope: str, job: GpuJob, logger: Any, ctx: TaskRunContext | None) -> None:
        self.scope, self.job, self.logger, self.ctx = scope, job, logger, ctx
        self.shown_waiting = False

    def show_waiting(self, decision: Decision) -> None:
        """The task run's `AwaitingBudget` state, its message what blocks the job now."""
        self.shown_waiting = True
        _show_state(
            self.ctx,
            State(
                type=StateType.SCHEDULED,
                name=AWAITING_BUDGET,
                message=f"waiting for budget: {_why(decision)}",
            ),
        )

    def queued(self, job_id: str, decision: Decision, rules: list[BudgetRule]) -> None:
        self.logger.warning("GPU job %s waits: %s", job_id[:8], short_why(decision))
        self.show_waiting(decision)
        emit_event(
            event="gpu-budget.job.queued",
            resource=_resource(job_id, self.scope),
            payload={
                "reason": decision.reason,
                "limit": decision.limit,
                "blocking_scope": decision.scope,
                "instance_type": self.job.instance_type,
                "nodes": self.job.nodes,
            },
        )
        try:
            _notify_once(
                rules,
                f"GPU job {self.job.name or self.job.instance_type} in {self.scope} is waiting: "
                f"{decision.reason}",
                subject=f"GPU budget: job waiting in {self.scope}",
            )
        except Exception as exc:  # a failed notification never blocks the gate
            self.logger.warning("could not send the waiting notification: %s", exc)

    def waiting(self, job_id: str, decision: Decision) -> None:
        self.logger.info("GPU job %s still waits: %s", job_id[:8], short_why(decision))
        self.show_waiting(decision)  # the UI follows what blocks it, not its first reason

    def admitted(self, admission: Admission) -> None:
        if self.shown_waiting:
            _show_state(
                self.ctx, Running(message=f"admitted after {fmt_duration(admission.waited_s)}")
            )
        self.logger.info(
            "GPU job %s admitted in %s after %s: %s",
            admission.job_id[:8],
            self.scope,
            fmt_duration(admission.waited_s),
            admission.reason.removeprefix("admitted: "),
        )
        for warning in admission.quote.warnings:
            if warning not in _warned:  # once per process, not once per trial
                _warned.add(warning)
                self.logger.warning("price warning: %s%s", warning, _refresh_hint(admission))
        emit_event(
            event="gpu-budget.job.admitted",
            resource=_resource(admission.job_id, self.scope),
            payload={
                "reserved_usd": micro_to_usd(admission.reserved_micro),
                "rate_usd_per_hour": micro_to_usd(admission.quote.rate_micro_per_hour),
                "waited_s": round(admission.waited_s, 3),
            },
        )

    def refused(self, job_id: str, refused: AdmissionRefused) -> None:
        say = self.logger.warning if refused.state_name == "Cancelled" else self.logger.error
        # its reason is the run's final state's message, logged next: said once
        say("GPU job %s in %s ends %s", job_id[:8], self.scope, refused.state_name)
        emit_event(
            event="gpu-budget.job.rejected",
            resource=_resource(job_id, self.scope),
            payload={"state": refused.state_name, "reason": refused.reason},
        )

    def settled(self, admission: Admission, row: dict[str, Any]) -> None:
        self.logger.info(
            "GPU job %s settled (%s): %s of %s reserved",
            admission.job_id[:8],
            row["outcome"],
            fmt_usd(row["actual_micro"] or 0),
            fmt_usd(row["reserved_micro"]),
        )
        emit_event(
            event="gpu-budget.job.settled",
            resource=_resource(admission.job_id, self.scope),
            payload={
                "outcome": row["outcome"],
                "actual_usd": micro_to_usd(row["actual_micro"] or 0),
                "reserved_usd": micro_to_usd(row["reserved_micro"]),
                "billed_seconds": row["billed_seconds"],
            },
        )

    def warning(self, message: str) -> None:
        self.logger.warning("GPU budget gate: %s", message)

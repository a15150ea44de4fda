"""What a Vertex AI custom job's record says: the line logged while it waits or runs
(`job_line`), and once it ended, its outcome and times as a `LaunchResult` (`job_result`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import INTERRUPTED, LaunchResult
from prefect_gpu_budget.launchers.vertex_api import (
    ABORTED,
    DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    epoch,
    job_state,
    one_line,
)
from prefect_gpu_budget.launchers.vertex_machines import STRATEGIES
from prefect_gpu_budget.units import fmt_duration

if TYPE_CHECKING:
    from google.cloud import aiplatform_v1 as vertex


def job_line(current: vertex.CustomJob, job: GpuJob, capacity_wait: float, now: float) -> str:
    """The job as it stands: waiting for capacity (for how long, at most `capacity_wait`, 0:
    forever), running since when, or ended and how."""
    state = job_state(current).removeprefix("JOB_STATE_")
    created = epoch(current.create_time) or now
    start = epoch(current.start_time)
    end = epoch(current.end_time)
    if start is None and end is None:
        limit = "forever" if capacity_wait == 0 else fmt_duration(capacity_wait)
        limit = "" if job.provisioning == "on-demand" else f", max wait {limit}"
        return (
            f"Vertex AI job {state}: waiting for capacity "
            f"({STRATEGIES[job.provisioning]}{limit}), {fmt_duration(now - created)} so far"
        )
    if end is None:
        return (
            f"Vertex AI job {state} since {current.start_time.isoformat()}, after "
            f"{fmt_duration((start or now) - created)} waiting for capacity"
        )
    ran = f"after {fmt_duration(end - start)} running" if start else "without starting"
    error = f": {one_line(current.error.message)}" if current.error.message else ""
    return f"Vertex AI job {state} {ran}{error}"


def _unstarted_outcome(state: str, code: int, job: GpuJob, stopped: str | None) -> str:
    """How a job that never started ended: its wait for capacity ran out (ours, or Vertex's
    for a flex-start or spot job), cancelled, completed, or failed."""
    capacity_job = job.provisioning in ("flex-start", "spot")
    expired = stopped == "wait_expired" or state == "JOB_STATE_EXPIRED"
    expired |= (
        state == "JOB_STATE_FAILED"
        and capacity_job
        and code in (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED)
    )
    if expired:
        return "wait_expired"
    return {"JOB_STATE_CANCELLED": "cancelled", "JOB_STATE_SUCCEEDED": "completed"}.get(
        state, "failed"
    )


def taken_back(job: GpuJob, state: str, code: int, message: str) -> bool:
    """A started Spot job failed because its VMs were taken back: Vertex ends it FAILED with a
    STOCKOUT (RESOURCE_EXHAUSTED), UNAVAILABLE or ABORTED, or says it was preempted."""
    if job.provisioning != "spot" or state != "JOB_STATE_FAILED":
        return False
    said = message.lower()
    return code in (RESOURCE_EXHAUSTED, UNAVAILABLE, ABORTED) or "preempt" in said


def _started_outcome(
    state: str, error: tuple[int, str], job: GpuJob, stopped: str | None, ran: float
) -> str:
    """How a job that ran for `ran` seconds ended (`error`: its code and message): completed,
    timed out (stopped at, or run to, max_runtime), interrupted (a Spot VM taken back),
    cancelled, or failed."""
    code, message = error
    reached = ran >= job.max_runtime - min(1.0, job.max_runtime / 100)
    if state == "JOB_STATE_SUCCEEDED":
        return "completed"
    if stopped == "timed_out" or code == DEADLINE_EXCEEDED or reached:
        return "timed_out"
    if stopped is None and taken_back(job, state, code, message):
        return INTERRUPTED
    return "cancelled" if state == "JOB_STATE_CANCELLED" else "failed"


def job_result(current: vertex.CustomJob, job: GpuJob, stopped: str | None) -> LaunchResult:
    """The ended job's outcome (`stopped`: the outcome of our own stop, if we stopped it), its
    real start and end, and how long it waited for capacity."""
    state = job_state(current)
    created = epoch(current.create_time)
    start = epoch(current.start_time)
    end = epoch(current.end_time) or time.time()
    code, message = current.error.code, one_line(current.error.message)
    if start is None:
        outcome = _unstarted_outcome(state, code, job, stopped)
    else:
        outcome = _started_outcome(state, (code, message), job, stopped, end - start)
    detail = message or ("" if outcome == "completed" else state)
    if outcome == "timed_out":
        detail = f"stopped at max_runtime {fmt_duration(job.max_runtime)}" + (
            f" ({message})" if message else ""
        )
    began = start if start is not None else end
    return LaunchResult(
        outcome,
        began,
        end,
        detail=detail,
        external_id=current.name,
        capacity_wait_s=max(0.0, began - (created or end)),
    )

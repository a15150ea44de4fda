"""What SageMaker says of a training job: its status message, and once it ended, its outcome,
times and billed seconds as a `LaunchResult` (`training_job_result`); and its errors in one line,
without the credentials an endpoint URL may carry."""

from __future__ import annotations

import time
from typing import Any

from prefect_gpu_budget.launchers.base import INTERRUPTED, LaunchResult
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.units import cost_micro, redact_urls

FINISHED = ("Completed", "Failed", "Stopped")
STOP_REASONS = ("MaxRuntimeExceeded", "MaxWaitTimeExceeded")


def one_line(exc: BaseException) -> str:
    """An error's first line (its type's name if it says nothing)."""
    return first_line(str(exc)) or type(exc).__name__


def first_line(text: str) -> str:
    """The first line of `text`, without the credentials of any URL in it (an endpoint_url
    may carry them)."""
    text = redact_urls(text).strip()
    return text.splitlines()[0] if text else ""


def epoch(value: Any) -> float | None:
    """A boto3 timestamp (an aware datetime) as epoch seconds."""
    return None if value is None else value.timestamp()


def status_message(described: dict[str, Any]) -> str:
    """`: <the latest status message>`, or "" when SageMaker gave none."""
    transitions = described.get("SecondaryStatusTransitions") or []
    message = first_line(transitions[-1].get("StatusMessage") or "") if transitions else ""
    return f": {message}" if message else ""


def interrupted(described: dict[str, Any], stopped_here: bool) -> bool:
    """A managed spot job that started and was taken back: SageMaker resumes an interrupted
    job by itself while its MaxWaitTimeInSeconds allows, so a started spot job that ends at
    that wait (or ends failed or stopped, not by us, after an `Interrupted` status) lost its
    machine rather than ran its course."""
    if not described.get("EnableManagedSpotTraining") or stopped_here:
        return False
    if described.get("TrainingJobStatus") == "Completed":
        return False
    transitions = described.get("SecondaryStatusTransitions") or []
    said = {step.get("Status") for step in transitions}
    return described.get("SecondaryStatus") == "MaxWaitTimeExceeded" or "Interrupted" in said


def _outcome(described: dict[str, Any], started: bool, stopped_here: bool) -> str:
    status, secondary = described["TrainingJobStatus"], described.get("SecondaryStatus", "")
    if status == "Completed":
        return "completed"
    if secondary == "MaxWaitTimeExceeded" and not started:
        return "wait_expired"
    if started and interrupted(described, stopped_here):
        return INTERRUPTED
    if secondary in STOP_REASONS or (status == "Stopped" and stopped_here):
        return "timed_out"
    return "failed" if status == "Failed" else "cancelled"


def training_job_result(
    described: dict[str, Any], quote: Quote, stopped_here: bool
) -> LaunchResult:
    """The ended job (DescribeTrainingJob's answer) as a result: billed SageMaker's
    BillableTimeInSeconds at the quote's rate (the whole training time where it leaves that
    out; nothing for a job that never started); `stopped_here`: we stopped it at its limit."""
    secondary = described.get("SecondaryStatus", "")
    created = epoch(described.get("CreationTime"))
    start = epoch(described.get("TrainingStartTime"))
    end = epoch(described.get("TrainingEndTime") or described.get("LastModifiedTime"))
    end = time.time() if end is None else end
    billed = described.get("BillableTimeInSeconds")
    if start is None:
        billed, actual = 0.0, 0
    else:
        if billed is None:  # SageMaker leaves it out: bill the whole training time
            billed = max(0.0, end - start)
        actual = cost_micro(quote.rate_micro_per_hour, billed, round_up=True)
    outcome = _outcome(described, start is not None, stopped_here)
    detail = described.get("FailureReason") or ("" if outcome == "completed" else secondary)
    first = start if start is not None else end
    return LaunchResult(
        outcome,
        started_at=first,
        ended_at=max(end, first),
        exit_code=0 if outcome == "completed" else None,
        detail=first_line(detail),
        billed_seconds=float(billed),
        actual_micro=actual,
        external_id=described["TrainingJobName"],
        capacity_wait_s=max(0.0, first - created) if created is not None else 0.0,
    )

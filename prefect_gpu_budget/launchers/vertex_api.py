"""The Vertex AI client as the Vertex launcher and worker call it: the SDK (imported when used,
a one-line error naming the `vertex` extra without it), a job's state by name, its times as epoch
seconds, a duration as protobuf's, its errors in one line, and the retry its reads ride on."""

from __future__ import annotations

import re
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING

from google.api_core import exceptions as api_errors
from google.api_core import retry as api_retry
from google.protobuf import duration_pb2

from prefect_gpu_budget.launchers.base import LauncherNeedsExtra
from prefect_gpu_budget.units import redact_urls

if TYPE_CHECKING:
    from google.cloud import aiplatform_v1 as vertex

WAITING = ("JOB_STATE_QUEUED", "JOB_STATE_PENDING")
ENDED = (
    "JOB_STATE_SUCCEEDED",
    "JOB_STATE_FAILED",
    "JOB_STATE_CANCELLED",
    "JOB_STATE_EXPIRED",
    "JOB_STATE_PARTIALLY_SUCCEEDED",
)
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED = 8, 4
"""google.rpc codes in `CustomJob.error`: a FLEX_START wait that ran out (or, once started, a
Spot VM taken back: a STOCKOUT); a job timeout."""
ABORTED, UNAVAILABLE = 10, 14
"""google.rpc codes a started Spot job may end with when its VMs are taken back."""

POLL_RETRY = api_retry.Retry(
    predicate=api_retry.if_transient_error, initial=1.0, maximum=30.0, timeout=300.0
)
"""Reads and cancels ride out passing errors for 5 minutes; a create is never retried."""


def sdk() -> ModuleType:
    """google-cloud-aiplatform's Vertex AI client, or a one-line error naming the extra."""
    try:
        from google.cloud import aiplatform_v1
    except ImportError as exc:
        raise LauncherNeedsExtra(
            "vertex", "the Vertex AI launcher", "vertex", name="google.cloud.aiplatform_v1"
        ) from exc
    return aiplatform_v1


def one_line(text: str, limit: int = 300) -> str:
    """One line of at most `limit` characters, without the credentials of any URL in it."""
    line = " ".join(redact_urls(str(text)).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def api_error(exc: Exception) -> str:
    """A Vertex AI call's error in one line, without the method and URL REST puts first."""
    if isinstance(exc, api_errors.GoogleAPICallError):  # REST messages start "GET <url>: "
        message = re.sub(r"^[A-Z]+ \S+: ", "", str(exc.message))
        return one_line(f"{type(exc).__name__}: {message}")
    return one_line(f"{type(exc).__name__}: {exc}")


def epoch(when: datetime | None) -> float | None:
    """A job's time (None: not yet) as epoch seconds."""
    return None if when is None else when.timestamp()


def duration(seconds: float) -> duration_pb2.Duration:
    """`seconds` as a protobuf Duration, to the nanosecond."""
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int(round((seconds - whole) * 1e9)))


def job_state(job: vertex.CustomJob) -> str:
    """The job's state by name, e.g. `JOB_STATE_RUNNING`."""
    return sdk().JobState(job.state).name

"""What every launcher promises the gate: run an admitted job, say when it really started and
ended (and what the cloud billed), stop it, and answer reconcile's questions about an orphan.

The gate reserves before `run` is called and settles after it returns, whatever way it ends;
a launcher never touches the ledger itself. `preflight` runs before anything is reserved, so a
wrong setting (no role, unknown region, an instance type the cloud does not offer) fails the job
with a one-line reason and leaves the ledger untouched.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prefect_gpu_budget.extras import MissingExtra
from prefect_gpu_budget.job import GpuJob, LaunchConfigError
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.threads import Handoff

INTERRUPTED = "interrupted"
"""A spot job's machine the cloud took back after it started (a Vertex AI Spot VM preempted, a
SageMaker managed spot job interrupted and not resumed within its wait): billed for what ran,
and placed again when it can resume (`GpuJob.checkpoint`)."""
OUTCOMES = (
    "completed",
    "failed",
    "timed_out",
    "cancelled",
    "launch_error",
    "wait_expired",
    INTERRUPTED,
)


class LauncherNeedsExtra(MissingExtra, LaunchConfigError):
    """The launcher's cloud SDK is not installed. Raised when the launcher is used (preflight
    first, so the job fails before anything is reserved), never when it is imported or built."""

    def __init__(self, launcher: str, what: str, extra: str, *, name: str | None = None) -> None:
        MissingExtra.__init__(self, what, extra, name=name)
        self.launcher = launcher
        self.reason = str(self)

    def __reduce__(self):
        return (type(self), (self.launcher, self.what, self.extra), {"name": self.name})


@dataclass(frozen=True)
class LaunchResult:
    outcome: str
    """One of OUTCOMES. `timed_out`: stopped at max_runtime; `wait_expired`: a FLEX_START or
    spot job whose capacity wait ran out before it started (nothing billed); `interrupted`: a
    spot job the cloud took back after it started (`INTERRUPTED`)."""
    started_at: float
    """When billing began (the cloud's start time); equal to `ended_at` if it never started."""
    ended_at: float
    exit_code: int | None = None
    detail: str = ""
    billed_seconds: float | None = None
    """What the cloud says it billed (SageMaker's BillableTimeInSeconds), if it says."""
    actual_micro: int | None = None
    """The actual cost in micro-dollars when the launcher knows it better than rate x runtime."""
    external_id: str | None = None
    capacity_wait_s: float = 0.0
    """Time spent waiting for cloud capacity after admission (held, not billed)."""

    @property
    def runtime_s(self) -> float:
        return self.ended_at - self.started_at


@dataclass(frozen=True)
class Probe:
    """Reconcile's view of an orphaned job, from the launcher's own records."""

    state: str
    """`running` (still billing), `finished` (times below are real), or `unknown` (cannot tell)."""
    started_at: float | None = None
    ended_at: float | None = None
    billed_seconds: float | None = None
    actual_micro: int | None = None


StartHook = Callable[[float, str], None]
"""Called once when the job really starts: (start time, external id)."""

SubmitHook = Callable[[str], None]
"""Called once the cloud has accepted the job (its external id), before it starts: a job that
waits for capacity is then known to the ledger, so reconcile can cancel it if its holder dies."""


def ignore_submission(external_id: str) -> None:
    """The default SubmitHook: nothing to record."""


class StartNotRecorded(RuntimeError):
    """The job's start could not be recorded in time (the ledger stalled or is down)."""


class StartRecord:
    """`on_start(started_at, external_id)` told in a thread of its own, so that the job's
    max_runtime clock runs from its real start whatever the ledger does.

    The gate's `on_start` writes to the ledger and retries while the ledger is locked or down;
    a launcher that waited for it would start the max_runtime timer late by the whole stall
    (DESIGN promise 9). The launcher instead starts its timer at once, calls `check` while it
    waits for the job, and stops the job when `check` raises: the start was refused (the job
    is no longer admitted) or could not be recorded within `patience` seconds (the job's kill
    grace) of the launcher learning of the start (for a cloud job, a poll after the cloud's
    reported start, from which max_runtime is timed all the same). Before it returns, the launcher calls `finish`, so that the gate settles only
    after the start is on record (else a job that ran would settle as never started, at $0).

    The thread is a `threads.Handoff`: an exception a signal raises in the launcher lands
    in the launcher's wait, never inside the ledger call.
    """

    def __init__(
        self, on_start: StartHook, started_at: float, external_id: str, patience: float
    ) -> None:
        self.started_at = started_at
        self.patience = patience
        self.deadline = time.time() + patience
        self._handoff: Handoff[None] = Handoff()
        self._handoff.start(functools.partial(on_start, started_at, external_id))

    @property
    def done(self) -> bool:
        return self._handoff.done.flag

    def check(self, now: float | None = None) -> None:
        """Raise the start hook's error, or `StartNotRecorded` once `patience` has run out."""
        if self.done:
            if self._handoff.error is not None:
                raise self._handoff.error
            return
        now = time.time() if now is None else now
        if now >= self.deadline:
            raise StartNotRecorded(
                f"the job's start could not be recorded within {self.patience:.0f}s "
                "(the ledger is locked or down): stopped so that nothing runs unmetered"
            )

    def finish(self) -> None:
        """Wait for the start hook to end (the job is no longer running by now); raise its
        error, if it failed."""
        while not self._handoff.done.wait(1.0):
            pass
        if self._handoff.error is not None:
            raise self._handoff.error


@runtime_checkable
class Launcher(Protocol):
    kind: str
    """`local`, `vertex`, `sagemaker` or `deployment`: written to the ledger row."""

    def preflight(self, job: GpuJob, quote: Quote) -> None:
        """Raise LaunchConfigError if this job cannot be launched as configured."""

    def run(
        self,
        job: GpuJob,
        quote: Quote,
        *,
        on_start: StartHook,
        log: Callable[[str], None],
        env: dict[str, str] | None = None,
        on_submit: SubmitHook = ignore_submission,
    ) -> LaunchResult:
        """Launch, wait for the end, and stop the job if interrupted (BaseException) before
        re-raising. Stops it at max_runtime."""

    def probe(self, external_id: str) -> Probe:
        """For reconcile: is the job with this id still running, and when did it run?"""

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        """Stop the job (SIGTERM or the cloud's stop); for reconcile and preemption."""

"""An admitted job's life: run it with its launcher, settle it exactly once however it ends,
and say whether it must be queued again.

No Prefect here: the `run_gpu_job` task, the soak and chaos benchmarks and the chaos worker all
run a job through `run_admitted`, so what the benchmarks measure is the path users run. The task
adds what only a Prefect run has (its states, its run logger, its events: `tasks/events.py`).

The launcher stops the job at max_runtime (`Launcher.run`); this module
- records the start (`Gate.started`) and the cloud's submission (`Gate.submitted`);
- stops the job gracefully when the gate says it must stop (the admission's `preempted`
  event): preempted (its capacity taken back, as the pool's team settings allow: named
  `preempted`) or stopped by its owner (named `cancelled`);
- settles once: from the launcher's result, or, when `launcher.run` raised (an error, a
  cancellation: any `BaseException`), as `cancelled` up to now, before the exception goes on.

`Settlement` is the one "settle exactly once, whatever way it ends" for every way a job runs:
`run_admitted` here, the `@gpu_task` body (`tasks/gpu_task.py`) and the worker types' flow runs
(`workers/gating.py`). `outcome_of` names how a body ended as the ledger's outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from prefect_gpu_budget.admission.gate import Admission, Gate
from prefect_gpu_budget.admission.ledger import PREEMPTED, STOPPED
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import Launcher, LaunchResult
from prefect_gpu_budget.launchers.registry import launcher_ref

COMPLETED, FAILED, CANCELLED, TIMED_OUT = "completed", "failed", "cancelled", "timed_out"
"""The outcomes of a body that returned, raised an error, was cancelled, ran past max_runtime."""


class PastMaxRuntime(TimeoutError):
    """Raised in a body that is stopped at max_runtime: its job ends `timed_out`."""


def outcome_of(error: BaseException | None, returned: str = COMPLETED) -> str:
    """The outcome of a body that ended raising `error` (None: it returned).

    | the body                                             | outcome     |
    |------------------------------------------------------|-------------|
    | returned                                             | `returned`  |
    | raised `PastMaxRuntime` (stopped at max_runtime)     | `timed_out` |
    | raised another `Exception`                           | `failed`    |
    | raised a `BaseException` (cancelled, interrupted...) | `cancelled` |

    `returned` is `completed` unless the caller names it from what the body returned (a
    worker: from the exit code, or `timed_out` when it stopped the body at max_runtime)."""
    if error is None:
        return returned
    if isinstance(error, PastMaxRuntime):
        return TIMED_OUT
    return FAILED if isinstance(error, Exception) else CANCELLED


class Settlement:
    """Settles one admission exactly once, whatever way its job ends (`Gate.settle`).

    The first call settles; a later call, or one made meanwhile from another thread (it waits),
    settles nothing and returns the same row. A first call that raised (the ledger down past
    the gate's patience) settled nothing: the next call tries again. `then` (giving back what
    else the job held, say) runs once, as the first call ends, settled or not."""

    def __init__(
        self, gate: Gate, admission: Admission, *, then: Callable[[], None] | None = None
    ) -> None:
        self.gate, self.admission = gate, admission
        self._then = then
        self._row: dict[str, Any] | None = None
        self._lock = threading.Lock()

    @property
    def row(self) -> dict[str, Any] | None:
        """The settled ledger row; None until settled."""
        return self._row

    def settle(
        self,
        outcome: str,
        *,
        ended_at: float | None = None,
        billed_seconds: float | None = None,
        actual_micro: int | None = None,
    ) -> dict[str, Any]:
        """Settle as `outcome`, ended at `ended_at` (now if None), unless settled already.
        Returns the settled row (the first settlement's, whatever this call asked)."""
        with self._lock:
            if self._row is not None:
                return self._row
            then, self._then = self._then, None
            try:
                self._row = self.gate.settle(
                    self.admission,
                    ended_at=time.time() if ended_at is None else ended_at,
                    outcome=outcome,
                    billed_seconds=billed_seconds,
                    actual_micro=actual_micro,
                )
            finally:
                if then is not None:
                    then()
            return self._row

    def ended(
        self,
        error: BaseException | None = None,
        *,
        returned: str = COMPLETED,
        ended_at: float | None = None,
        billed_seconds: float | None = None,
    ) -> dict[str, Any]:
        """Settle a body that ended raising `error` (None: it returned) as `outcome_of` names
        it; see `settle`."""
        return self.settle(
            outcome_of(error, returned), ended_at=ended_at, billed_seconds=billed_seconds
        )


@dataclass(frozen=True)
class Ended:
    """How an admitted job ended: the launcher's result (its outcome `preempted` when a
    preemption stopped it) and the settled ledger row."""

    result: LaunchResult
    row: dict[str, Any]
    requeue: bool
    """Preempted, and the job asks to be queued again (`GpuJob.requeue`)."""


STOPPED_BY_OWNER = "stopped by its owner"
"""The detail of a job its owner stopped while it ran (its outcome: `cancelled`)."""


def ended_by_stop(
    result: LaunchResult, stopped_at: float | None, why: str = PREEMPTED
) -> LaunchResult:
    """`result`, named for the stop that ended it, if one did: `preempted` when its borrowed
    capacity was reclaimed, `cancelled` (stopped by its owner) when `why` is `stopped`."""
    if stopped_at is None or stopped_at >= result.ended_at:
        return result
    if why == STOPPED:
        return replace(result, outcome=CANCELLED, detail=f"{STOPPED_BY_OWNER}: {result.detail}")
    return replace(result, outcome=PREEMPTED, detail=f"{PREEMPTED}: {result.detail}")


class _Preemption:
    """Stops the job once, gracefully, when its admission must stop (preempted, or stopped by
    its owner: `Admission.stop_reason`): at once if it is running, else as soon as it starts.
    Stops watching when the job ends."""

    def __init__(self, gate: Gate, admission: Admission, launcher: Launcher) -> None:
        self.admission, self.launcher = admission, launcher
        self.poll_s = gate.preempt_poll_s
        self.external_id: str | None = None
        self.stopped_at: float | None = None
        self._lock = threading.Lock()
        self._over = threading.Event()
        threading.Thread(
            target=self._watch, name=f"gpu-budget-stop-{admission.job_id[:8]}", daemon=True
        ).start()

    def _watch(self) -> None:
        while not self._over.is_set():
            if self.admission.preempted.wait(self.poll_s):
                self.stop()
                return

    def starting(self, external_id: str) -> None:
        """The job runs as `external_id`: from now on a preemption stops it."""
        with self._lock:
            self.external_id = external_id

    def started(self) -> None:
        """Its start is on record: stop it now if it was preempted before that."""
        if self.admission.preempted.is_set():  # asked before it even started
            threading.Thread(target=self.stop, daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            if self.external_id is None or self.stopped_at is not None:
                return  # not started yet (`started` stops it), or stopped already
            self.stopped_at = time.time()
            external_id = self.external_id
        self.launcher.stop(external_id, grace=self.admission.job.kill_grace)

    def over(self) -> None:
        self._over.set()


def run_admitted(
    gate: Gate,
    admission: Admission,
    launcher: Launcher,
    *,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda line: None,
    phase: Callable[[str], None] = lambda name: None,
) -> Ended:
    """Run an admitted job and settle it once, whatever way it ends. A job asked to give its
    capacity back (preempted) is stopped gracefully: SIGTERM or the cloud's stop, then its
    grace period to checkpoint, then a kill; it pays for what it used.

    `phase` hears `started` once the start is on record and `settling` just before the
    settlement (the chaos benchmark kills its workers there). An exception from the launcher
    (a cancellation included) is re-raised once the job is settled as `cancelled`."""
    job = admission.job
    preemption = _Preemption(gate, admission, launcher)
    settlement = Settlement(gate, admission)

    def on_start(started: float, external_id: str) -> None:
        preemption.starting(external_id)
        gate.started(admission, started, external_id)
        preemption.started()
        phase("started")

    result: LaunchResult | None = None
    try:
        result = launcher.run(
            job,
            admission.quote,
            on_start=on_start,
            log=log,
            env=env or {},
            on_submit=partial(gate.submitted, admission),
        )
    finally:
        preemption.over()
        phase("settling")
        if result is None:  # cancelled or crashed mid-run: bill until now
            settlement.settle(CANCELLED)
    result = ended_by_stop(result, preemption.stopped_at, admission.stop_reason)
    row = settlement.settle(
        result.outcome,
        ended_at=result.ended_at,
        billed_seconds=result.billed_seconds,
        actual_micro=result.actual_micro,
    )
    return Ended(result, row, requeue=result.outcome == PREEMPTED and job.requeue)


def run_job(
    gate: Gate,
    job: GpuJob,
    scope: str,
    launcher: Launcher,
    *,
    flow_run_id: str | None = None,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda line: None,
    requeued: Callable[[Admission, Ended], None] = lambda admission, ended: None,
) -> tuple[Admission, Ended]:
    """Admit the job, run it and settle it (`run_admitted`); while a preemption ends it and it
    asks to be requeued, tell `requeued` and queue it again. Returns the last admission and how
    it ended; raises `AdmissionRefused` when the gate refuses it (the first time or after a
    requeue)."""
    while True:
        admission = gate.admit(job, scope, flow_run_id=flow_run_id, launcher=launcher_ref(launcher))
        ended = run_admitted(gate, admission, launcher, env=env, log=log)
        if not ended.requeue:
            return admission, ended
        requeued(admission, ended)

"""An admitted job's life: run it, stop it when it must stop, settle it exactly once however
it ends, and say whether it must be queued again.

No Prefect here: the `run_gpu_job` task, the soak and chaos benchmarks and the chaos worker all
run a job through `run_admitted`, so what the benchmarks measure is the path users run. The task
adds what only a Prefect run has (its states, its run logger, its events: `tasks/events.py`).

`Running` is the one life after admission for every runner: `run_admitted` here (a launcher's
job), the `@gpu_task` body (`tasks/gpu_task.py`) and the worker types' flow runs
(`workers/gating.py`). It
- records the start once (`Holding.started`);
- stops the job once, gracefully, as its runner stops it, when the gate says it must stop (the
  admission's `preempted` event): preempted (its capacity taken back, as the pool's team
  settings allow: named `preempted`) or stopped by its owner (named `cancelled`); and at
  max_runtime where the runner has no such stop of its own (a launcher has: `Launcher.run`);
- settles once (`Settlement`): `run_admitted` from the launcher's result, or, when
  `launcher.run` raised (an error, a cancellation: any `BaseException`), as `cancelled` up to
  now, before the exception goes on. `outcome_of` names how a body ended as the ledger's
  outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.ledger import PREEMPTED, STOPPED
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import Launcher, LaunchResult
from prefect_gpu_budget.launchers.registry import launcher_ref
from prefect_gpu_budget.settings import JOB_ID_ENV
from prefect_gpu_budget.units import fmt_duration, fmt_usd

COMPLETED, FAILED, CANCELLED, TIMED_OUT = "completed", "failed", "cancelled", "timed_out"
"""The outcomes of a body that returned, raised an error, was cancelled, ran past max_runtime."""


STOP_OUTCOMES = {PREEMPTED: PREEMPTED, STOPPED: CANCELLED, TIMED_OUT: TIMED_OUT}
"""The outcome of a job a stop ended, by why it was stopped: its borrowed capacity reclaimed
(`preempted`), its owner's stop (`stopped`: named `cancelled`), its max_runtime (`timed_out`)."""


class PastMaxRuntime(TimeoutError):
    """Raised in a body that is stopped at max_runtime: its job ends `timed_out`."""


class StopAsked(Exception):
    """Raised out of a body stopped because its admission must stop (`Running`): `why` is
    `preempted` (the capacity it borrowed taken back) or `stopped` (its owner's stop)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def outcome_of(error: BaseException | None, returned: str = COMPLETED) -> str:
    """The outcome of a body that ended raising `error` (None: it returned).

    | the body                                             | outcome                   |
    |------------------------------------------------------|---------------------------|
    | returned                                             | `returned`                |
    | raised `PastMaxRuntime` (stopped at max_runtime)     | `timed_out`               |
    | raised `StopAsked` (preempted / its owner's stop)    | `preempted` / `cancelled` |
    | raised another `Exception`                           | `failed`                  |
    | raised a `BaseException` (cancelled, interrupted...) | `cancelled`               |

    `returned` is `completed` unless the caller names it from what the body returned (a
    worker: from the exit code, or `timed_out` when it stopped the body at max_runtime)."""
    if error is None:
        return returned
    if isinstance(error, PastMaxRuntime):
        return TIMED_OUT
    if isinstance(error, StopAsked):
        return STOP_OUTCOMES[error.why]
    return FAILED if isinstance(error, Exception) else CANCELLED


class Settlement:
    """Settles one admission exactly once, whatever way its job ends (`Holding.settle`).

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
                self._row = self.gate.holding.settle(
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


@dataclass(frozen=True)
class Ended:
    """How an admitted job ended: the launcher's result (its outcome `preempted` when a
    preemption stopped it) and the settled ledger row."""

    result: LaunchResult
    row: dict[str, Any]
    requeue: bool
    """Preempted, and the job asks to be queued again (`GpuJob.requeue`)."""
    stopped: str | None = None
    """Why a stop ended it (`preempted`, `stopped`: its owner's, `timed_out`); None if none did."""


STOPPED_BY_OWNER = "stopped by its owner"
"""The words of an owner's stop whose stopper gave none of its own (`owner_stop_words`)."""


def owner_stop_words(row: dict[str, Any]) -> str:
    """How a job its owner stopped (outcome `cancelled`) is worded wherever its end is shown:
    in its stopper's own words, the reason its ledger `row` holds (`stopped by its agent`,
    `its agent's grant was revoked`, `cancelled by an admin`...), so its run's message and
    its row (and an agent's view of its trial) say the same; `STOPPED_BY_OWNER` when there
    are none."""
    return row.get("reason") or STOPPED_BY_OWNER


class Running:
    """An admitted job's life from its start to its settlement, the same for every runner:
    a launcher's job (`run_admitted`), a `@gpu_task` body (`tasks/gpu_task.py`) and the worker
    types' flow runs (`workers/gating.py`).

    - `started` records the start once (`Holding.started`) and hands over how to stop the job:
      gracefully, as the runner's own stop does (a process tree: SIGTERM, its kill grace,
      SIGKILL; a cloud job: the cloud's cancel; a body: an exception raised in its thread);
    - from then on the admission's one thread (`Holding.hold`) hands over its stop
      (`Admission.preempted`: its borrowed capacity reclaimed, or its owner's stop,
      `Admission.stop_reason`) and, with `deadline=True` (a runner without a max_runtime stop
      of its own: the worker types), a timer waits for max_runtime counted from the start;
      the first of them stops the job, once; a stop asked before the job started stops it as
      it starts;
    - `outcome` names how it ended: by the stop that ended it (`STOP_OUTCOMES`), else as the
      runner says (`outcome_of`);
    - `ended` settles once (`Settlement`), at the moment the job really ended: a job pays for
      what it ran, a stopped one until it is gone."""

    def __init__(
        self,
        gate: Gate,
        admission: Admission,
        *,
        deadline: bool = False,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.gate, self.admission = gate, admission
        self.settlement = Settlement(gate, admission, then=then)
        self._deadline = deadline
        self.started_at: float | None = None
        self.stopped: str | None = None
        """Why a stop was sent (`preempted`, `stopped` or `timed_out`); None while none was."""
        self.stopped_at: float | None = None
        self._stop: Callable[[], None] | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._over = threading.Event()

    def started(
        self, at: float, external_id: str | None = None, stop: Callable[[], None] | None = None
    ) -> None:
        """The job started at `at` (as `external_id`): record it, once (a later call records
        nothing), and from now on stop it with `stop` when it must stop. Raises when the
        admission is no longer on record (`Holding.started`)."""
        with self._lock:
            if self.started_at is not None:
                return
            self.started_at = at
        self.gate.holding.started(self.admission, at, external_id)
        if stop is not None:
            self.stoppable(stop)

    def stoppable(self, stop: Callable[[], None]) -> None:
        """From now on stop the started job with `stop`, once, when it must stop (at once if
        it was asked to before): the admission's own thread (`Holding.hold`) hands over its
        stop (`Admission.on_stop`) until it ends (`over`). A deadline has a timer of its own: that
        thread also waits on the ledger and Prefect (heartbeat, lease), and max_runtime must
        not wait for them."""
        with self._lock:
            if self._stop is not None or self._over.is_set():
                return
            self._stop = stop
            if self._deadline:
                deadline = (self.started_at or time.time()) + self.admission.job.max_runtime
                self._timer = threading.Timer(
                    max(0.0, deadline - time.time()), self.stop, args=(TIMED_OUT,)
                )
                self._timer.name = f"gpu-budget-deadline-{self.admission.job_id[:8]}"
                self._timer.daemon = True
                self._timer.start()
        self.admission.on_stop = self._stop_asked
        if self.admission.preempted.is_set():  # a stop asked already stops it now
            self._stop_asked()

    def _stop_asked(self) -> None:
        """The admission must stop (`Admission.preempted`: its borrowed capacity reclaimed, or
        its owner's stop): stop the job, in a thread of its own (a runner's stop may take its
        kill grace, and the heartbeat goes on). `stop` sends it once."""
        threading.Thread(
            target=self.stop,
            args=(self.admission.stop_reason,),
            name=f"gpu-budget-stop-{self.admission.job_id[:8]}",
            daemon=True,
        ).start()

    def stop(self, why: str) -> None:
        """Stop the job once (`why`: `preempted`, `stopped` or `timed_out`), if it started and
        has not ended; a job not started yet is stopped as it starts."""
        with self._lock:
            stop = self._stop
            if stop is None or self.stopped is not None or self._over.is_set():
                return
            self.stopped, self.stopped_at = why, time.time()
        stop()

    def over(self) -> None:
        """The job ended: stop watching; a stop is no longer sent."""
        with self._lock:
            self._over.set()
            if self._timer is not None:
                self._timer.cancel()

    def outcome(
        self, error: BaseException | None = None, returned: str = COMPLETED, ended_at: float = 0.0
    ) -> str:
        """How the job that ended at `ended_at` (0: now) raising `error` (None: returned,
        as `returned`) is named: by the stop that ended it, when one was sent before it ended
        (`STOP_OUTCOMES`), else as `outcome_of` names it."""
        why = self.stopped_before(ended_at or time.time())
        return STOP_OUTCOMES[why] if why is not None else outcome_of(error, returned)

    def stopped_before(self, ended_at: float) -> str | None:
        """Why a stop was sent before `ended_at` (so it ended the job); None if none was."""
        if self.stopped is None or self.stopped_at is None or self.stopped_at >= ended_at:
            return None
        return self.stopped

    def ended(
        self,
        error: BaseException | None = None,
        *,
        returned: str = COMPLETED,
        ended_at: float | None = None,
        billed_seconds: float | None = None,
        actual_micro: int | None = None,
    ) -> dict[str, Any]:
        """Settle once a job that ended at `ended_at` (None: now) raising `error` (None: it
        returned, as `returned`), named by `outcome`; returns the settled row."""
        self.over()
        ended_at = time.time() if ended_at is None else ended_at
        outcome = self.outcome(error, returned, ended_at)
        timed_out = outcome == TIMED_OUT and billed_seconds is None
        if self._deadline and timed_out and self.started_at is not None:
            # stopped at its deadline by this life's own timer (a launcher's run reports its own
            # end and bill)
            ran_s = self.admission.job.stopped_run_s(ended_at - self.started_at)
            ended_at = self.started_at + ran_s
        return self.settlement.settle(
            outcome,
            ended_at=ended_at,
            billed_seconds=billed_seconds,
            actual_micro=actual_micro,
        )

    @property
    def requeue(self) -> bool:
        """Settled as preempted, and its job asks to be queued again (`GpuJob.requeue`)."""
        row = self.settlement.row
        return row is not None and row["outcome"] == PREEMPTED and self.admission.job.requeue

    def stopped_as(self, row: dict[str, Any]) -> str:
        """The outcome of a job a stop ended: its settled `row`'s, or, while it is still being
        stopped (not settled yet), the one its stop will give it (`STOP_OUTCOMES`)."""
        return row.get("outcome") or STOP_OUTCOMES[self.stopped or TIMED_OUT]

    def stop_message(self, row: dict[str, Any]) -> str:
        """What the run of a job a stop ended (its ledger `row`: `preempted`, `cancelled` by
        its owner, `timed_out`) says of its end: who stopped it, why, and what it cost (once
        settled; before, that it is being stopped)."""
        if row.get("state") == "settled":
            actual, reserved = fmt_usd(row.get("actual_micro") or 0), fmt_usd(row["reserved_micro"])
            done = f"cost {actual} of {reserved}"
        else:
            done = "stopping it gracefully"
        why = row.get("reason") or ""
        outcome = self.stopped_as(row)
        if outcome == PREEMPTED:
            pool = f" in pool {self.admission.pool}" if self.admission.pool else ""
            return f"preempted: the capacity this job held{pool} was taken back ({why}); {done}"
        if outcome == CANCELLED:
            return f"{owner_stop_words(row)}; {done}"
        return f"stopped at max_runtime {fmt_duration(self.admission.job.max_runtime)}; {done}"


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

    `env` reaches the job with its ledger job id added as GPU_BUDGET_JOB_ID
    (`settings.JOB_ID_ENV`): a cloud launcher marks the cloud's job with it, so that the bill
    can be matched to the ledger (`launchers/bill_mark.py`), and the job's process can read it.

    `phase` hears `started` once the start is on record and `settling` just before the
    settlement (the chaos benchmark kills its workers there). An exception from the launcher
    (a cancellation included) is re-raised once the job is settled as `cancelled`."""
    job = admission.job
    running = Running(gate, admission)  # the launcher stops the job at max_runtime itself

    def on_start(started: float, external_id: str) -> None:
        stop = partial(launcher.stop, external_id, grace=job.kill_grace)
        running.started(started, external_id, stop)
        phase("started")

    result: LaunchResult | None = None
    try:
        result = launcher.run(
            job,
            admission.quote,
            on_start=on_start,
            log=log,
            env={**(env or {}), JOB_ID_ENV: admission.job_id},
            on_submit=partial(gate.holding.submitted, admission),
        )
    finally:
        running.over()
        phase("settling")
        if result is None:  # cancelled or crashed mid-run: bill until now
            running.settlement.settle(CANCELLED)
    why = running.stopped_before(result.ended_at)
    row = running.ended(  # named by the stop that ended it, if one did (`Running.outcome`)
        returned=result.outcome,
        ended_at=result.ended_at,
        billed_seconds=result.billed_seconds,
        actual_micro=result.actual_micro,
    )
    if why is not None:  # a stop ended it: say which (its owner's in its stopper's words)
        outcome = STOP_OUTCOMES[why]
        if why == STOPPED:
            detail = owner_stop_words(row) + (f" ({result.detail})" if result.detail else "")
        else:
            detail = f"{outcome}: {result.detail}"
        result = replace(result, outcome=outcome, detail=detail)
    return Ended(result, row, requeue=running.requeue, stopped=why)


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

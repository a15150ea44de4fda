"""What an admitted job holds while it runs, and how it gives it back (`Holding`, one per
gate: `Gate.holding`).

- `hold` starts the job's one thread: every `preempt_poll_s` it asks the ledger whether the job
  must stop (`Ledger.views.stop_asked`: preempted, or stopped by its owner) and sets
  `Admission.preempted`, and every `heartbeat_s` it stamps the row and renews the Prefect lease
  (or takes the slots again when the lease lapsed);
- `started` and `submitted` record the launcher's start and a cloud's id, patiently, off the
  caller's thread;
- `settle` stops that thread, releases the slots, then settles the row once.

The job's life after admission (`lifecycle.Running`) and every runner call these; the gate
itself only admits.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from prefect_gpu_budget.admission.errors import AdmissionRefused
from prefect_gpu_budget.admission.leases import Patiently, SlotLeases
from prefect_gpu_budget.admission.ledger import PREEMPTED, Ledger
from prefect_gpu_budget.admission.limits import Limits
from prefect_gpu_budget.admission.outages import describe as _outage
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Decision
from prefect_gpu_budget.admission.rules.timing import RELEASE_PATIENCE_S, SETTLE_PATIENCE_S
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Quote
from prefect_gpu_budget.threads import Handoff
from prefect_gpu_budget.threads import off_thread as _off_thread
from prefect_gpu_budget.units import fmt_usd

log = logging.getLogger("prefect_gpu_budget.gate")

T = TypeVar("T")


@dataclass
class GateEvents:
    """What the gate tells the outside world; the Prefect task fills these in."""

    queued: Callable[[str, Decision, list[BudgetRule]], None] = lambda *a: None
    waiting: Callable[[str, Decision], None] = lambda *a: None
    admitted: Callable[[Admission], None] = lambda *a: None
    refused: Callable[[str, AdmissionRefused], None] = lambda *a: None
    settled: Callable[[Admission, dict], None] = lambda *a: None
    warning: Callable[[str], None] = lambda message: log.warning("%s", message)
    """Something the researcher should know: a dependency (the ledger's database, the Prefect
    API) is down and the gate keeps trying, or a running job is being preempted."""


@dataclass
class Admission:
    """An admitted job: its ledger row, the rate slots it holds and its heartbeat."""

    job_id: str
    scope: str
    job: GpuJob
    quote: Quote
    reserved_micro: int
    waited_s: float
    reason: str
    lease_id: str | None = None
    caps: tuple[tuple[str, int], ...] = ()
    slots: int = 0
    pool: str | None = None
    preempted: threading.Event = field(default_factory=threading.Event, repr=False)
    """Set when the job must stop: a job within its team's quota asked for the capacity this
    one borrowed, or its owner stopped it (`stop_reason` says which); the job's life
    (`admission/lifecycle.py`) stops the job when it is."""
    stop_reason: str = PREEMPTED
    """`preempted` or `stopped` (`Ledger.views.stop_asked`), once `preempted` is set."""
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _lease_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _beat: threading.Thread | None = field(default=None, repr=False)
    on_stop: Callable[[], None] | None = field(default=None, repr=False)
    """What the job's life does when the admission must stop (`lifecycle.Running`): the job's
    one thread (`Holding.hold`) calls it once, as soon as `preempted` is set."""


def _hand_over_stop(admission: Admission) -> None:
    """Hand a stop the ledger asked for to the job's life, once (`Admission.on_stop`)."""
    on_stop, admission.on_stop = admission.on_stop, None
    if on_stop is not None:
        on_stop()


class EarlyStop:
    """A stop asked of a job between its admission and its hold (`Holding.watch_admitted`):
    what the watcher saw counts until `close`, after which the admission is built from it (a
    stop read later is the job's own thread's to see)."""

    def __init__(self) -> None:
        self.preempted, self.closed = threading.Event(), threading.Event()
        self.why = PREEMPTED
        self._lock = threading.Lock()

    def saw(self, asked: str) -> None:
        with self._lock:
            if not self.closed.is_set():
                self.why = asked
                self.preempted.set()

    def close(self) -> None:
        with self._lock:
            self.closed.set()


class Holding:
    """The admitted jobs of one gate, while they run: over its ledger, limits and leases,
    telling its events, with its clocks."""

    def __init__(
        self,
        ledger: Ledger,
        limits: Limits | None,
        leases: SlotLeases,
        events: GateEvents,
        patiently: Patiently,
        *,
        heartbeat_s: float,
        preempt_poll_s: float,
    ) -> None:
        self.ledger, self.limits, self.leases, self.events = ledger, limits, leases, events
        self.patiently = patiently
        self.heartbeat_s, self.preempt_poll_s = heartbeat_s, preempt_poll_s

    def hold(self, admission: Admission) -> None:
        """The admitted job's one thread: every `preempt_poll_s` it asks the ledger whether the
        job must stop (`Ledger.views.stop_asked`: preempted, or stopped by its owner) and, once
        it must, hands that to the job's life (`Admission.on_stop`), which stops it; and every
        `heartbeat_s` it stamps the row and renews the lease."""

        def beat() -> None:
            next_beat = time.monotonic() + self.heartbeat_s
            while not admission._stop.wait(min(self.preempt_poll_s, self.heartbeat_s)):
                if not admission.preempted.is_set():
                    self._check_stop(admission)
                if admission.preempted.is_set():
                    _hand_over_stop(admission)
                if time.monotonic() < next_beat:
                    continue
                next_beat = time.monotonic() + self.heartbeat_s
                try:
                    self.ledger.settlements.heartbeat(admission.job_id)
                    with admission._lease_lock:  # never renew or retake while it settles
                        lease, limits = admission.lease_id, self.limits
                        if admission._stop.is_set() or not lease or limits is None:
                            continue
                        if not limits.renew(lease):
                            retaken = self.leases.retake(
                                admission.job_id, admission.caps, admission.slots, self.heartbeat_s
                            )
                            if retaken is not None:
                                admission.lease_id = retaken
                except Exception as exc:  # keep beating: a dependency may come back
                    self.events.warning(
                        f"heartbeat of job {admission.job_id[:8]} failed: {_outage(exc)}"
                    )

        admission._beat = threading.Thread(
            target=beat, name=f"gpu-budget-heartbeat-{admission.job_id[:8]}", daemon=True
        )
        admission._beat.start()

    def watch_admitted(self, job_id: str, early: EarlyStop) -> None:
        """From the moment of admission until its Prefect slots are taken (seconds, on a busy
        machine): a reclaim asked meanwhile is seen at once, and the job stops as it starts."""
        while not early.closed.wait(self.preempt_poll_s):
            try:
                asked = self.ledger.views.stop_asked(job_id)
            except Exception:  # an outage: the heartbeat reports it
                continue
            if asked:
                early.saw(asked)
                return

    def _check_stop(self, admission: Admission) -> None:
        try:
            asked = self.ledger.views.stop_asked(admission.job_id)
        except Exception:  # an outage: the heartbeat reports it
            return
        if asked is None:
            return
        admission.stop_reason = asked
        admission.preempted.set()
        if asked == PREEMPTED:
            self.events.warning(
                f"job {admission.job_id[:8]} is preempted in pool {admission.pool}: the capacity "
                "it holds goes to another job (its lender's, or a higher-priority one of its own "
                "team); stopping it gracefully"
            )
        else:
            self.events.warning(
                f"job {admission.job_id[:8]} is stopped by its owner; stopping it gracefully"
            )

    def _record(self, what: str, call: Callable[[], T]) -> T:
        """A write about a running job, in a thread of its own (a cancellation of the caller
        cannot break it) and patient through a short ledger outage."""
        return _off_thread(
            functools.partial(self.patiently, what, call, SETTLE_PATIENCE_S), SETTLE_PATIENCE_S
        )

    def submitted(self, admission: Admission, external_id: str) -> None:
        """Record the cloud's id of a job that may still wait for capacity."""
        self._record(
            "recording the submission",
            functools.partial(
                self.ledger.settlements.record_submission, admission.job_id, external_id
            ),
        )

    def started(
        self, admission: Admission, started_at: float, external_id: str | None = None
    ) -> None:
        """Record that the launcher started the job; refuse if it is no longer admitted."""
        if not self._record(
            "recording the start",
            functools.partial(
                self.ledger.settlements.mark_started, admission.job_id, started_at, external_id
            ),
        ):
            raise RuntimeError(
                f"job {admission.job_id[:8]} is no longer admitted (settled by reconcile?)"
            )

    def settle(
        self,
        admission: Admission,
        *,
        ended_at: float,
        outcome: str,
        billed_seconds: float | None = None,
        actual_micro: int | None = None,
    ) -> dict:
        """Write the actual cost once, then give back the rate slots. Returns the ledger row.
        (In a thread of its own, as `admit`: a cancellation of the caller cannot break it.)"""
        return _off_thread(
            functools.partial(
                self._settle, admission, ended_at, outcome, billed_seconds, actual_micro
            ),
            SETTLE_PATIENCE_S,
        )

    def _settle(
        self,
        admission: Admission,
        ended_at: float,
        outcome: str,
        billed_seconds: float | None,
        actual_micro: int | None,
    ) -> dict:
        with admission._lease_lock:  # a heartbeat in flight finishes first, then stops
            admission._stop.set()
        # The slots go back while the row settles: one round trip's time, not two. Either
        # order is safe for the money: slots still held after the row settled only make the
        # Prefect limit stricter (a job the ledger admits meanwhile retries its slots), and a
        # crash between the two leaves either an open row for reconcile or a lease that lapses.
        lease, limits = admission.lease_id, self.limits
        released: Handoff[None] | None = None
        if lease and limits is not None:
            release = functools.partial(limits.release, lease)
            released = Handoff()
            released.start(
                functools.partial(
                    self.patiently, "releasing Prefect limits", release, RELEASE_PATIENCE_S
                )
            )
        try:
            settle = functools.partial(
                self.ledger.settlements.settle,
                admission.job_id,
                ended_at=ended_at,
                outcome=outcome,
                billed_seconds=billed_seconds,
                actual_micro=actual_micro,
                scope=admission.scope,
            )
            row = self.patiently("settling", settle, SETTLE_PATIENCE_S)
        finally:
            if released is not None:
                released.done.wait(RELEASE_PATIENCE_S + 10.0)
        if released is not None and released.error is not None:
            raise released.error
        if row is None:  # settled already (by reconcile, say): report what the ledger holds
            row = self.patiently(
                "reading the job", functools.partial(self.ledger.views.job, admission.job_id)
            )
        self.events.settled(admission, row)
        log.debug("settled %s: %s", admission.job_id[:8], fmt_usd(row["actual_micro"] or 0))
        return row

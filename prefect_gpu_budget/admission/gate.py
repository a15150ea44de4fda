"""The gate: the admission stage only. A job passes, in order:

1. price (`quote`, `price_job`): its rate, taken once;
2. scope (`_known_scope`): an org or team nobody created is refused, nothing recorded;
3. slots first, on the fast path (`SlotLeases.early`): when the scope's last job here was
   admitted at once, the Prefect limits of every capped scope on its path are asked for under
   one lease before the request, and Prefect's answer is waited for (`EARLY_ANSWER_S` at most);
4. request (`Queue.ask`): recorded and decided in one transaction, with the other requests of
   this process to the same org that arrive meanwhile; a job admitted under the caps its lease
   from step 3 was taken for has the lease recorded in that same transaction. That is the fast
   path: one commit for the admission (and one for the settlement, `Holding.settle`);
5. wait (`_wait`): a job not admitted at once is watched from then on (`_watch`), and does not
   poll. The transaction that frees headroom decides the org's queue, and the process's
   watcher (`admission/watcher.py`) wakes the jobs it decided, so a job is admitted well within
   a second of headroom appearing, at a cost that grows with events, not with waiters; a waiter
   re-decides its own job (`Queue.try_admit`) only when woken, at its max wait, or when the
   period that blocks it resets;
6. slots otherwise (`SlotLeases.take`): a job admitted without a recorded lease (its scope's
   first job here, one that waited, caps changed, Prefect slow to answer step 3) takes its
   slots after the admission and records the lease in a commit of its own (taking over the
   lease of step 3 where it is for these caps), or is given back to the queue if Prefect is
   full; slots of step 3 the ledger did not take go back at once;
7. hold (`Holding.hold`): the admitted job's one thread starts, and the caller gets its
   `Admission`.

No call to Prefect is made while the org's lock is held: Prefect answers first (step 3) or
after the commit (step 6). Why a kill on either side of a commit loses nothing is
`admission/leases.py`'s to say.

What the job holds from then on, and its settlement, are `Holding`'s (`gate.holding`).
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prefect_gpu_budget.admission.asking import asking
from prefect_gpu_budget.admission.errors import AdmissionRefused, refuse
from prefect_gpu_budget.admission.holding import Admission, EarlyStop, GateEvents, Holding
from prefect_gpu_budget.admission.leases import Caps, EarlyLease, SlotLeases, limit_reason
from prefect_gpu_budget.admission.ledger import (
    Ledger,
    NewJob,
    wait_key,
)
from prefect_gpu_budget.admission.limits import Limits
from prefect_gpu_budget.admission.outages import patiently
from prefect_gpu_budget.admission.prices import price_job
from prefect_gpu_budget.admission.rules.policy import (
    BudgetRule,
    Decision,
    max_wait_of,
    wait_deadline,
)
from prefect_gpu_budget.admission.rules.timing import (
    FRESH_ADMISSION_S,
    GIVE_BACK_S,
    HEARTBEAT_S,
    RECHECK_S,
    REQUEST_PATIENCE_S,
    WAKE_ANYWAY_S,
)
from prefect_gpu_budget.admission.watcher import Ticket, Watcher, watcher_for
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog, Quote
from prefect_gpu_budget.threads import Handoff as _Handoff
from prefect_gpu_budget.units import org_of, validate_scope

T = TypeVar("T")


class _Cancelled(BaseException):
    """Raised in the admission thread when its caller was cancelled."""


@dataclass
class _Waiting:
    """A waiting job between rounds (`Gate._wait`): its deadline (once it is told it waits),
    whether an admission it took no slots for went back to the queue, and what held it last."""

    job_id: str
    started: float
    deadline: float | None = None
    given_back: bool = False
    last_block: tuple[str | None, str | None] = (None, None)


class Gate:
    """Admission of GPU jobs: request -> wait -> slots; what an admitted job then holds, and
    its settlement, are `holding`'s (`admission/holding.py`)."""

    def __init__(
        self,
        ledger: Ledger,
        limits: Limits | None = None,
        *,
        catalog: Catalog | None = None,
        events: GateEvents | None = None,
        poll_s: float = 0.05,
        recheck_s: float = RECHECK_S,
        heartbeat_s: float = HEARTBEAT_S,
        preempt_poll_s: float = 0.5,
        admitted_at_once: dict[str, Caps] | None = None,
    ) -> None:
        self.ledger = ledger
        self.limits = limits
        self.catalog = catalog
        self.events = events or GateEvents()
        self.poll_s = poll_s
        self.recheck_s = recheck_s
        self.heartbeat_s = heartbeat_s
        self.preempt_poll_s = preempt_poll_s
        self.leases = SlotLeases(
            ledger, limits, self.patiently, self.events.warning, admitted_at_once
        )
        self.holding = Holding(
            ledger,
            limits,
            self.leases,
            self.events,
            self.patiently,
            heartbeat_s=heartbeat_s,
            preempt_poll_s=preempt_poll_s,
        )

    def with_events(self, events: GateEvents) -> Gate:
        """This gate (its ledger, limits, catalog and clocks) telling `events`."""
        return Gate(
            self.ledger,
            self.limits,
            catalog=self.catalog,
            events=events,
            poll_s=self.poll_s,
            recheck_s=self.recheck_s,
            heartbeat_s=self.heartbeat_s,
            preempt_poll_s=self.preempt_poll_s,
            admitted_at_once=self.leases.admitted_at_once,
        )

    def quote(self, job: GpuJob) -> Quote:
        """The job's price: its machines', or its part of them (`price_job`, as `quote` and
        `forecast` price it)."""
        return price_job(job, self.catalog)[0]

    def admit(
        self, job: GpuJob, scope: str, *, flow_run_id: str | None = None, launcher: str = "local"
    ) -> Admission:
        """Block until the job is admitted; raise `AdmissionRefused` on rejection or time-out,
        or (`UnknownScope`, before anything is recorded) for a scope whose org or team nobody
        created.

        The admission runs in a thread of its own, and the caller only waits for it. A caller's
        cancellation (Ctrl-C, a task's time-out: an exception a signal raises in it, or another
        thread injects) can land at any bytecode; inside code that holds a lock (SQLAlchemy's
        pool, the HTTP client) it would leave that lock held and hang every other thread of the
        process. Here it lands only in the wait: the admission thread hears of it, gives the job
        back (its place in the queue, or its reservation and slots) and ends, and the caller
        re-raises once it has, or after `GIVE_BACK_S`."""
        validate_scope(scope)
        quote, new = asking(job, scope, self.catalog, flow_run_id=flow_run_id, launcher=launcher)
        handoff: _Handoff[Admission] = _Handoff()

        def admit_here() -> Admission:
            self._known_scope(scope)  # before anything is recorded: a typo reserves nothing
            admission = self._admit_here(new, job, quote, handoff)
            if not handoff.claim("admitted"):  # the caller was cancelled a moment before
                self.holding.settle(admission, ended_at=time.time(), outcome="cancelled")
            return admission

        try:
            return handoff.run(admit_here, GIVE_BACK_S)
        except BaseException:  # refused; or cancelled, and the job was given back, unless
            if handoff.claims[:1] == ["admitted"] and handoff.result is not None:
                # it was admitted just before the cancellation: that admission goes back here
                self.holding.settle(handoff.result, ended_at=time.time(), outcome="cancelled")
            raise

    def _known_scope(self, scope: str) -> None:
        """Refuse (`UnknownScope`, nothing recorded) a scope whose org or team nobody created,
        the team also when it is the scope's last level in an org that has teams, naming the
        one it may have meant (`Ledger.views.unknown_scope`): as Kueue admits no workload whose
        LocalQueue does not exist. Read in the admission thread,
        as every other read of the ledger."""
        unknown = self.patiently(
            "reading the scope",
            functools.partial(self.ledger.views.unknown_scope, scope),
            patience=REQUEST_PATIENCE_S,
        )
        if unknown is not None:
            raise AdmissionRefused("UnknownScope", unknown, "")

    def _admit_here(
        self, new: NewJob, job: GpuJob, quote: Quote, handoff: _Handoff[Admission]
    ) -> Admission:
        """Record the request and wait for admission, in the admission thread. When the caller
        is cancelled, the job is given back: its place in the queue, or its reservation and
        slots."""
        if handoff.cancelled:  # cancelled before this thread began: nothing to give back
            raise _Cancelled
        scope, started = new.scope, time.time()
        job_id = str(uuid.uuid4())  # fixed before any retry: a retried request records once
        ticket = Ticket(job_id, org_of(scope), self.events.warning)  # watched once it waits
        handoff.on_cancel.append(ticket.changed.set)
        try:
            return self._request_and_wait(new, job, quote, handoff, ticket, started)
        finally:
            if ticket.watched:
                self._watcher().unregister(ticket)

    def _watcher(self) -> Watcher:
        return watcher_for(self.ledger, self.poll_s, self.recheck_s)

    def _watch(self, ticket: Ticket) -> None:
        """Have the process's watcher wake the job from now on, then read once what another's
        transaction decided for it since its request, which named it to no watcher. (A job
        admitted at once is never watched: its admission starts no watcher thread, and no
        LISTEN connection.)"""
        self._watcher().watch(ticket)
        decided = self.patiently(
            "reading the decision", functools.partial(self.ledger.queue.decided, [ticket.job_id])
        )
        if ticket.job_id in decided:
            ticket.hand(decided[ticket.job_id])

    def _request_and_wait(
        self,
        new: NewJob,
        job: GpuJob,
        quote: Quote,
        handoff: _Handoff[Admission],
        ticket: Ticket,
        started: float,
    ) -> Admission:
        job_id, scope = ticket.job_id, new.scope
        early = self.leases.early(scope, new.rate_cents)  # slots asked before the ledger decides
        try:
            held = early.held() if early is not None else None  # Prefect's answer, not its lock
            decision, rules, recorded = self.patiently(  # a ledger that never answers (a wrong
                "recording the request",  # URL) fails in time
                functools.partial(self.ledger.queue.ask, new, job_id, held),
                patience=REQUEST_PATIENCE_S,
            )
            lease = held.lease_id if recorded and held is not None else None
            if lease is not None and early is not None:
                early.recorded()  # the admission's now: never dropped
            self.leases.decided(scope, decision.caps if decision.verdict == "admit" else None)
            if early is not None and decision.verdict != "admit":
                early.drop()
            try:
                return self._wait(
                    job_id,
                    scope,
                    job,
                    quote,
                    new.rate_cents,
                    (decision, rules, started, early, lease),
                    handoff,
                    ticket,
                )
            except AdmissionRefused as refused:
                self.events.refused(job_id, refused)
                raise
            except BaseException:  # cancelled while waiting: give the place (or admission) back
                give_back = functools.partial(self._give_back, job_id, scope)
                self.patiently("giving back a cancelled job", give_back, patience=GIVE_BACK_S)
                raise
        finally:
            if early is not None:
                early.drop()  # unless its admission took the slots over

    def _give_back(self, job_id: str, scope: str) -> None:
        """A job cancelled while it waited leaves the queue; one admitted meanwhile gives back
        its slots (first, as settle does) and is settled as cancelled."""
        if self.ledger.queue.cancel_queued(job_id, scope, "cancelled while waiting"):
            return
        lease = self.ledger.views.job(job_id)["lease_id"]
        if lease and self.limits is not None:
            self.limits.release(lease)
        self.ledger.settlements.settle(
            job_id, ended_at=time.time(), outcome="cancelled", scope=scope
        )

    def patiently(
        self,
        what: str,
        call: Callable[[], T],
        patience: float | Callable[[], float | None] | None = None,
    ) -> T:
        """`call()`, retried while the ledger's database or the Prefect API is down, telling this
        gate's events (`outages.patiently`)."""
        return patiently(what, call, self.events.warning, patience)

    def _wait(
        self,
        job_id: str,
        scope: str,
        job: GpuJob,
        quote: Quote,
        slots: int,
        first: tuple[Decision, list[BudgetRule], float, EarlyLease | None, str | None],
        handoff: _Handoff[Admission],
        ticket: Ticket,
    ) -> Admission:
        """Until admitted with its slots, from the `first` decision (with the budgets it was
        decided against, when the job asked, the slots asked early, and the lease recorded with
        that decision, if it was). Each round: 1. a refusal or a time-out ends it; 2. an
        admission takes its slots (`_take`), or goes back to the queue while Prefect's limit is
        full; 3. its events are told (`_tell`); 4. it sleeps until woken (`_sleep`); 5. it reads
        the decision it woke to (`_woken`)."""
        decision, rules, started, early, recorded = first
        waiting = _Waiting(job_id, started)
        while True:
            if handoff.cancelled:
                raise _Cancelled
            refuse(job_id, decision)
            if decision.verdict == "admit":
                asked = (started, early, recorded)
                admission = self._take(job_id, scope, job, quote, slots, decision, asked)
                early = recorded = None  # asked for the first decision only
                if admission is not None:
                    return admission
                decision = Decision("wait", limit_reason(scope), limit="prefect_limit", scope=scope)
                waiting.given_back = True  # what its watcher read before may say it is admitted
            deadline = self._tell(job, decision, rules, waiting)
            handed = self._sleep(ticket, handoff, decision, deadline)
            decision = self._woken(job_id, scope, None if waiting.given_back else handed)

    def _take(
        self,
        job_id: str,
        scope: str,
        job: GpuJob,
        quote: Quote,
        slots: int,
        decision: Decision,
        asked: tuple[float, EarlyLease | None, str | None],
    ) -> Admission | None:
        """An admitted job's slots (the lease `recorded` with its admission, else
        `leases.take`'s), watched for its borrowed capacity reclaimed at once; its `Admission`
        held and told, or None: Prefect's limit is full. `asked`: when the job asked, the slots
        asked early, and the lease recorded with the admission, if it was."""
        started, early, recorded = asked
        early_stop = EarlyStop()
        if decision.pool is not None:  # borrowed capacity may be reclaimed at once
            threading.Thread(
                target=self.holding.watch_admitted,
                args=(job_id, early_stop),
                name=f"gpu-budget-preempt-early-{job_id[:8]}",
                daemon=True,
            ).start()
        try:
            max_wait = (functools.partial(self._max_wait, job, scope), started)
            lease: str | None | bool = recorded  # the fast path: taken and recorded already
            if recorded is None:
                lease = self.leases.take(job_id, scope, slots, decision.caps, max_wait, early)
        finally:
            early_stop.close()  # what the watcher saw is final from here
        if lease is False:
            return None
        admission = Admission(
            job_id=job_id,
            scope=scope,
            job=job,
            quote=quote,
            reserved_micro=decision.reserved_micro,
            waited_s=time.time() - started,
            reason=decision.reason,
            lease_id=lease,
            caps=decision.caps,
            slots=slots,
            pool=decision.pool,
            preempted=early_stop.preempted,
            stop_reason=early_stop.why,
        )
        try:
            self.holding.hold(admission)
            self.events.admitted(admission)
        except BaseException:  # nothing ran: hand back the lease and the money
            self.holding.settle(admission, ended_at=time.time(), outcome="cancelled")
            raise
        return admission

    def _tell(self, job: GpuJob, decision: Decision, rules: list[BudgetRule], w: _Waiting) -> float:
        """Tell the events that the job waits: once, with the budgets its request was decided
        against, then each time what blocks it changes; its deadline."""
        if w.deadline is None:
            self.events.queued(w.job_id, decision, rules)
            w.deadline = wait_deadline(w.started, max_wait_of(job.max_wait, rules))
        elif (decision.limit, decision.scope) != w.last_block:
            self.events.waiting(w.job_id, decision)
        w.last_block = (decision.limit, decision.scope)
        return w.deadline

    def _sleep(
        self, ticket: Ticket, handoff: _Handoff[Admission], decision: Decision, deadline: float
    ) -> tuple[Decision, float] | None:
        """Asleep until the ledger may have decided the job, its max wait runs out or the period
        that blocks it resets (or WAKE_ANYWAY_S); what its watcher handed it, if anything."""
        ticket.wait_key = wait_key(decision) if decision.limit != "prefect_limit" else None
        if not ticket.watched:
            self._watch(ticket)
        wake_at = min(deadline, decision.resumes_at or deadline, time.time() + WAKE_ANYWAY_S)
        handed = None if handoff.cancelled else ticket.wait(max(0.05, wake_at - time.time()))
        if handoff.cancelled:
            raise _Cancelled
        return handed

    def _woken(self, job_id: str, scope: str, handed: tuple[Decision, float] | None) -> Decision:
        """The decision of a job that woke: the one another's transaction made and its watcher
        read for it (`handed`), else (woken by its own clock, or by a change of what blocks it,
        or handed an admission too old to take over unstamped: `FRESH_ADMISSION_S`) its own,
        decided in a transaction of its own."""
        if handed is not None:
            decision, stamped = handed
            if decision.verdict != "admit" or time.time() - stamped < FRESH_ADMISSION_S:
                return decision
        return self.patiently(
            "deciding", functools.partial(self.ledger.queue.try_admit, job_id, scope)
        )

    def _max_wait(self, job: GpuJob, scope: str) -> float:
        """The job's max wait (`policy.max_wait_of`), its budgets read only when it names none."""
        if job.max_wait is not None:
            return job.max_wait
        rules = self.patiently(
            "reading budgets", functools.partial(self.ledger.config.path_budgets, scope)
        )
        return max_wait_of(None, rules)

"""The Prefect lease protocol of an admission: take the rate slots of every capped scope on the
path under one lease, record the lease in the ledger (or hand it straight back), give back an
admission whose slots cannot be taken, and take the slots again when a lease lapsed under a
running job. The gate's collaborator (`Gate.leases`), given the ledger, the limits, and how to
call patiently and to warn.

A job whose scope's last job was admitted at once takes its slots first (`early`), and its
request carries the lease (`EarlyLease.held`): admitted under those caps, the ledger records
lease and admission in one transaction (`Queue.ask`). Every other admission takes its slots
after the ledger admitted it, and records the lease apart (`take`).

The order of writes, and why a kill anywhere loses nothing. Only the ledger's decision runs
under the org's lock (`Db.write`); no call to Prefect is made while it is held.
- Fast path, Prefect first: the lease is granted, then one transaction records the request, the
  decision and the lease. Prefect goes first because the lease id is its server's to make: a
  commit made before could not name it, and recording it would take a second commit. Its cost is
  a lease taken for a job the ledger then makes wait, which is why only a scope whose last job
  here was admitted at once asks first. Killed before that commit, the job has no row and
  reserves nothing; its slots are held by a lease nobody knows, which only makes Prefect's limit
  stricter until the server's repossessor returns them (`LEASE_S` plus `REPOSSESS_S`). Killed
  after it, the row is admitted with its lease on record: reconcile settles it and gives the
  lease back, as after any recorded lease. The row is stamped with the instant the lease was
  asked for (`HeldLease.values`), so reconcile's reading that a recorded lease lives `LEASE_S`
  past the row's last stamp stays true, and a lease older than `FRESH_LEASE_S` is not recorded
  this way at all. A decision that is not an admission under those caps leaves the lease out of
  the row and gives it back at once.
- Otherwise, ledger first: the admission commits (its row stamped), then the slots are taken
  and the lease recorded. Killed between, the row is admitted without a lease: reconcile holds
  it open, its rate counted, until any lease it may have taken has lapsed
  (`UNRECORDED_LEASE_S` after its last stamp), then settles it. Prefect full or refusing
  undoes the admission in one transaction (`Queue.unadmit`: back to the queue, or ended).
Either way a job runs only once its row is admitted with its lease on record, and an admitted
row that may hold slots under a lease it never recorded keeps its rate counted by the ledger
until that lease could have lapsed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prefect_gpu_budget.admission.errors import AdmissionGone, AdmissionRefused
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.ledger.settlement import FRESH_LEASE_S, HeldLease
from prefect_gpu_budget.admission.limits import DependencyDown, Limits, PrefectRefused
from prefect_gpu_budget.admission.outages import OUTAGES
from prefect_gpu_budget.admission.outages import describe as _outage
from prefect_gpu_budget.admission.rules.timing import (
    GIVE_BACK_S,
    LEASE_S,
    LIMIT_RETRY_S,
    LIVENESS_S,
)
from prefect_gpu_budget.threads import Handoff
from prefect_gpu_budget.units import fmt_duration

Patiently = Callable[..., Any]
"""`patiently(what, call, patience=None)`: `call()`, retried while a dependency is down."""


Caps = tuple[tuple[str, int], ...]
"""(scope, hourly cap in cents) of every capped scope on a job's path: its Prefect limits."""

EARLY_ANSWER_S = 2.0
"""How long a request waits for Prefect's answer to its early ask before it goes to the ledger
without a lease (Prefect slow or down: the job is recorded and decided meanwhile, and its
admission takes the lease over when it comes, `EarlyLease.lease`)."""


class EarlyLease:
    """Slots asked of Prefect before the ledger decides (`SlotLeases.early`): recorded with the
    job's admission (`held`, `recorded`), or taken over after it (`SlotLeases.take`), or given
    straight back (`drop`)."""

    def __init__(self, limits: Limits, caps: Caps, slots: int) -> None:
        self.limits, self.caps, self.slots = limits, caps, slots
        self.asked_at = 0.0  # monotonic, set once Prefect answered
        self.asked_wall = 0.0  # the same instant on the wall clock, as the ledger stamps rows
        self.taken: Handoff[str | None] = Handoff()
        self.taken.start(self._ask)
        self.used = self.dropped = False

    def _ask(self) -> str | None:
        # the limits first: another thread of this process may be making them just now, and
        # Prefect grants a lease over a limit it does not have without taking its slots
        self.limits.ensure(self.caps)
        asked_at, asked_wall = time.monotonic(), time.time()  # before Prefect's clock starts
        lease = self.limits.acquire([s for s, _ in self.caps], self.slots)
        self.asked_at, self.asked_wall = asked_at, asked_wall
        return lease

    def held(self, timeout: float = EARLY_ANSWER_S) -> HeldLease | None:
        """The lease Prefect granted, for the ledger to record with the admission, once Prefect
        answered (within `timeout`); None when it did not answer in time, said full or failed:
        the request then goes without it. It is recorded only while fresh: `FRESH_LEASE_S`,
        and at most a quarter of its life, so that the job's first heartbeat (`LEASE_S / 4`
        after its hold) renews it well before it could lapse."""
        if not self.taken.done.wait(timeout) or self.taken.result is None:
            return None
        fresh = min(FRESH_LEASE_S, LEASE_S / 4)
        return HeldLease(self.taken.result, self.caps, self.slots, self.asked_wall, fresh)

    def recorded(self) -> None:
        """The ledger recorded the lease with the admission: it is the admission's now, and
        `drop` leaves it alone."""
        self.used = True

    def _alive(self, lease: str) -> bool:
        """Whether the lease still holds its slots: one granted over half its life ago (a ledger
        slow to decide) is renewed first, and one Prefect no longer knows is not taken over."""
        if time.monotonic() - self.asked_at < LEASE_S / 2:
            return True
        with contextlib.suppress(Exception):  # Prefect did not answer: the caller asks anew
            return self.limits.renew(lease)
        return False

    def lease(self, caps: Caps, slots: int) -> str | None:
        """The lease taken, for an admission under these caps; None when it is for others (a
        cap changed meanwhile), was given back (`drop`: the job was told it waits) or lapsed,
        or Prefect said full or did not answer: the caller then takes the slots itself."""
        if self.dropped or (caps, slots) != (self.caps, self.slots):
            return None
        # a busy Prefect is waited for, not asked twice (the caller stamps the row meanwhile)
        if not self.taken.done.wait(LEASE_S) or self.taken.result is None:
            return None
        if not self._alive(self.taken.result):
            return None
        self.used = True
        return self.taken.result

    def drop(self) -> None:
        """Give the lease back, unless an admission took it over: in a thread of its own, once
        Prefect has answered (a process killed first leaves it to lapse, `LEASE_S`)."""
        if self.used or self.dropped:
            return
        self.dropped = True

        def give_back() -> None:
            if self.taken.done.wait(LEASE_S) and self.taken.result:
                with contextlib.suppress(Exception):  # not given back: it lapses, LEASE_S
                    self.limits.release(self.taken.result)

        threading.Thread(target=give_back, name="gpu-budget-early-release", daemon=True).start()


class SlotLeases:
    """The Prefect slots of admissions, over `ledger` and `limits` (None: no hourly caps).

    `admitted_at_once` remembers, per scope, the caps of its last job the ledger admitted at
    once in this process (shared by the gates `Gate.with_events` makes): the next job of that
    scope asks for those slots before the ledger decides (`early`), so an uncontended admission
    is one ledger commit, its lease recorded with it. A job that has to wait makes its scope
    forgotten: jobs of a busy scope do not ask Prefect for slots the ledger would not give
    them."""

    def __init__(
        self,
        ledger: Ledger,
        limits: Limits | None,
        patiently: Patiently,
        warn: Callable[[str], None],
        admitted_at_once: dict[str, Caps] | None = None,
    ) -> None:
        self.ledger, self.limits, self.patiently, self.warn = ledger, limits, patiently, warn
        self.admitted_at_once: dict[str, Caps] = (
            {} if admitted_at_once is None else admitted_at_once
        )

    def early(self, scope: str, slots: int) -> EarlyLease | None:
        """Ask for the slots a job of `scope` took last time, before the ledger decides; None
        when its scope's last job waited, or none was admitted here yet."""
        caps = self.admitted_at_once.get(scope)
        if self.limits is None or not caps:
            return None
        return EarlyLease(self.limits, caps, slots)

    def decided(self, scope: str, caps: Caps | None) -> None:
        """The ledger's first decision for a job of `scope`: admitted at once (`caps`), or not
        (None: its scope is forgotten until a job of it is admitted at once again)."""
        if caps:
            self.admitted_at_once[scope] = caps
        else:
            self.admitted_at_once.pop(scope, None)

    def take(
        self,
        job_id: str,
        scope: str,
        slots: int,
        caps: Caps,
        asked: tuple[Callable[[], float], float] | None = None,
        early: EarlyLease | None = None,
    ) -> str | None | bool:
        """Lease id, None when no scope on the path has an hourly cap, False when full. While
        this talks to Prefect (slow when its API is), another thread stamps the job's row. The
        slots asked `early` for these caps, if Prefect gave them, are taken over.

        A Prefect outage is retried until the job's max wait (from `asked`: how to read its max
        wait, and when it asked) runs out, and a request Prefect refuses (`PrefectRefused`) is
        not retried: either way the admission is given back and the job ends with the reason,
        as it does when the limit is full and its max wait has run out. Full otherwise: the job
        is queued again."""
        if self.limits is None or not caps:
            return None
        max_wait = [0.0]

        def left() -> float | None:  # asked only in an outage: no read on the way to admission
            if not asked:
                return None
            max_wait[0] = asked[0]()
            return None if max_wait[0] <= 0 else max(0.0, asked[1] + max_wait[0] - time.time())

        lease = None
        with self._stamping(job_id):
            try:
                lease = self._lease(job_id, caps, slots, left, early)
            except PrefectRefused as exc:
                self._end_admission(job_id, scope, "rejected", "PrefectRefused", str(exc))
            except DependencyDown as exc:  # still down when the max wait ran out
                reason = f"max wait {fmt_duration(max_wait[0])} ran out: {_outage(exc)}"
                self._end_admission(job_id, scope, "timed_out", "AdmissionTimeout", reason)
        if lease is not None:
            return lease
        if left() == 0.0:  # full, and the job's max wait has run out
            reason = f"max wait {fmt_duration(max_wait[0])} ran out: {limit_reason(scope)}"
            self._end_admission(job_id, scope, "timed_out", "AdmissionTimeout", reason)
        self.patiently(
            "giving the admission back",
            lambda: self.ledger.queue.unadmit(job_id, scope, limit_reason(scope)),
        )
        return False

    @contextlib.contextmanager
    def _stamping(self, job_id: str) -> Iterator[None]:
        """While this talks to Prefect (slow when its API is), another thread stamps the job's
        row."""
        done = threading.Event()

        def stamp() -> None:
            while not done.wait(LIVENESS_S):
                with contextlib.suppress(*OUTAGES):  # the ledger down too: the last stamp stands
                    self.ledger.settlements.heartbeat(job_id)

        threading.Thread(target=stamp, name="gpu-budget-stamp", daemon=True).start()
        try:
            yield
        finally:
            done.set()

    def _lease(
        self,
        job_id: str,
        caps: Caps,
        slots: int,
        left: Callable[[], float | None],
        early: EarlyLease | None,
    ) -> str | None:
        """The slots asked `early`, if Prefect gave them, else slots taken now, tried again
        for `LIMIT_RETRY_S` while the limit is full; the lease recorded, or None."""
        if early is not None:  # Prefect's answer to it, however slow, the row stamped
            taken = early.lease(caps, slots)
            if taken is not None:
                self._record_or_release(job_id, taken)
                return taken
            early.drop()
        deadline = time.monotonic() + LIMIT_RETRY_S
        while True:
            lease = self._take_and_record(job_id, caps, slots, left)
            if lease is not None:
                return lease
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def _end_admission(self, job_id: str, scope: str, state: str, name: str, reason: str) -> None:
        """End an admission whose Prefect limits cannot be taken in `state`, unrun, and raise
        AdmissionRefused(`name`, `reason`)."""

        def give_back() -> None:
            if not self.ledger.queue.unadmit(job_id, scope, reason, end=state):  # queued meanwhile
                self.ledger.queue.cancel_queued(job_id, scope, reason, state=state)

        self.patiently("giving the admission back", give_back, patience=GIVE_BACK_S)
        raise AdmissionRefused(name, reason, job_id)

    def _take_and_record(
        self,
        job_id: str,
        caps: tuple[tuple[str, int], ...],
        slots: int,
        patience: Callable[[], float | None] | None = None,
    ) -> str | None:
        """Take the slots and record the lease in the ledger. If recording fails, or the job
        was settled meanwhile (by reconcile), the lease goes back at once."""
        assert self.limits is not None
        limits = self.limits

        def ask() -> str | None:  # a limit deleted since it was made is made again
            limits.ensure(caps)
            return limits.acquire([s for s, _ in caps], slots)

        lease = self.patiently("taking Prefect limits", ask, patience)
        if lease is not None:
            self._record_or_release(job_id, lease)
        return lease

    def _record_or_release(self, job_id: str, lease: str, patience: float | None = None) -> None:
        """Record a lease just taken; release it if that fails or the job is no longer active
        (raising AdmissionGone then)."""
        assert self.limits is not None
        limits, recorded = self.limits, False
        try:
            recorded = self.patiently(
                "recording the lease",
                functools.partial(self.ledger.settlements.record_lease, job_id, lease),
                patience=patience,
            )
        finally:
            if not recorded:
                self.patiently("releasing Prefect limits", lambda: limits.release(lease))
        if not recorded:
            raise AdmissionGone(f"job {job_id[:8]} is no longer admitted")

    def retake(
        self, job_id: str, caps: tuple[tuple[str, int], ...], slots: int, patience: float
    ) -> str | None:
        """The lease expired while Prefect was unreachable and its slots were repossessed:
        take them again under a new lease, so Prefect's count matches the ledger again; the
        new lease, or None (the limit is full, or the job was settled meanwhile)."""
        assert self.limits is not None
        self.limits.ensure(caps)
        lease = self.limits.acquire([s for s, _ in caps], slots)
        if lease is None:
            self.warn(
                f"job {job_id[:8]} lost its Prefect lease and the limit is full; "
                "the ledger still counts it"
            )
            return None
        try:  # bounded: settle waits for this heartbeat (its lock) before it releases
            self._record_or_release(job_id, lease, patience=patience)
        except AdmissionGone:  # settled meanwhile: the new lease went back
            return None
        self.warn(f"job {job_id[:8]} took its Prefect slots again")
        return lease


def limit_reason(scope: str) -> str:
    """Why a job the ledger admitted waits for its Prefect slots."""
    return (
        f"blocked by Prefect concurrency limits on the path of {scope}: slots are held "
        "outside this ledger (another tool, or a lease not yet expired)"
    )

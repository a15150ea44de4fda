"""How a waiting job hears that the ledger decided it: one watcher per process and ledger.

Waiting jobs do not poll. A job whose request was told to wait is watched (`watch`, its
`Ticket`), reads its own decision once (one made before the watch is not missed), and then
blocks on the ticket; a job admitted at once is never watched. The transaction that frees
headroom decides the org's queue once and names the jobs it decided (`Queue.headroom`); the
watcher of each process hears of that, reads what was decided for those of its jobs in one
read for all of them (`Ledger.queue.decided`), and wakes exactly them, each with its decision
(a job still queued, now held by something else, decides itself):

- PostgreSQL: `LISTEN` on the ledger's channel over one connection of the watcher's own; the
  notice is sent in the deciding transaction, so it arrives only once the decision is visible.
- SQLite: one thread reads the versions of the orgs it waits in every `poll_s`, and on a change
  reads the state of its jobs there (two small reads, whatever the number of waiters).

Every `recheck_s` the watcher also re-decides each org it waits in and stamps the rows of its
waiting jobs, in one transaction per org (`Ledger.queue.recheck`): so a waiter keeps its place
(`STALE_WAITER_S`), and a lost notice, a period that rolled over or a waiter gone silent
elsewhere are caught within `recheck_s`. A dependency that is down is retried here, and every
waiting job is told, as the gate tells its own calls' outages.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prefect_gpu_budget.admission.ledger import NOTICE_CHANNEL, Ledger, read_notice
from prefect_gpu_budget.admission.outages import OUTAGES, TELL_EVERY_S, describe
from prefect_gpu_budget.admission.rules.policy import Decision
from prefect_gpu_budget.admission.rules.timing import RECHECK_S

log = logging.getLogger("prefect_gpu_budget.gate")

LINGER_S = 5.0
"""How long a watcher with no waiting jobs keeps its thread (and its connection) for the next."""


@dataclass(eq=False)
class Ticket:
    """A job waiting in `org`: set when the ledger may have decided it."""

    job_id: str
    org: str
    warning: Callable[[str], None]
    wait_key: str | None = None
    """What held the job when its holder last looked: a change wakes it too (to say so)."""
    changed: threading.Event = field(default_factory=threading.Event)
    watched: bool = False
    """Whether a watcher wakes it (`Watcher.watch`): a job admitted at once never is."""
    handed: tuple[Decision, float] | None = None
    """What the watcher read of the job when it woke it for a decision another's transaction
    made: the decision, and when the row was last stamped (`Ledger.queue.decided`)."""

    def hand(self, decided: tuple[Decision, float]) -> None:
        """Wake the job with its recorded decision, read for it: it needs no transaction."""
        self.handed = decided
        self.changed.set()

    def wait(self, timeout: float) -> tuple[Decision, float] | None:
        """Block until woken or `timeout` passes; what was handed over meanwhile, if anything
        (None: the job decides itself)."""
        self.changed.wait(max(0.0, timeout))
        self.changed.clear()
        handed, self.handed = self.handed, None
        return handed


class Watcher:
    """The thread that wakes the waiting jobs of one process and ledger (module docstring)."""

    def __init__(self, ledger: Ledger, poll_s: float = 0.05, recheck_s: float = RECHECK_S):
        self.ledger = ledger
        self.poll_s = poll_s
        self.recheck_s = recheck_s
        self._tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None

    def watch(self, ticket: Ticket) -> None:
        """Watch the ticket's job from now on. A new watcher reads the state of every job it
        watches once it listens; a watcher already listening wakes it for the notices that
        arrive from now on, so the caller reads once what was decided before (the gate does:
        `Gate._watch`)."""
        ticket.watched = True
        with self._lock:
            self._tickets[ticket.job_id] = ticket
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gpu-budget-watcher", daemon=True
                )
                self._thread.start()

    def unregister(self, ticket: Ticket) -> None:
        with self._lock:
            if self._tickets.get(ticket.job_id) is ticket:
                del self._tickets[ticket.job_id]

    def waiting(self) -> int:
        with self._lock:
            return len(self._tickets)

    # -- the thread -------------------------------------------------------------------------

    def _by_org(self) -> dict[str, list[Ticket]]:
        with self._lock:
            out: dict[str, list[Ticket]] = {}
            for ticket in self._tickets.values():
                out.setdefault(ticket.org, []).append(ticket)
            return out

    def _done(self, idle_since: float | None) -> float | None:
        """When the watcher has had nothing to watch (None: it has); ends the thread after
        `LINGER_S` of that, under the lock, so a new ticket starts a new one."""
        with self._lock:
            if self._tickets:
                return None
            now = time.monotonic()
            if idle_since is not None and now - idle_since >= LINGER_S:
                self._thread = None
                raise _Idle
            return idle_since or now

    def _wake(self, ids: Iterable[str]) -> None:
        """Wake the jobs of this process that a notice named: those decided, with what the
        ledger recorded (one read for all of them), the others to decide themselves."""
        with self._lock:
            tickets = [t for t in map(self._tickets.get, dict.fromkeys(ids)) if t is not None]
        if tickets:
            self._hand_over(tickets)

    def _wake_changed(self, tickets: list[Ticket], states: dict[str, tuple[str, str | None]]):
        """Wake the tickets whose job is no longer queued (with what was decided), or is held
        by something else (to decide itself: no read for it)."""
        decided = []
        for ticket in tickets:
            state, key = states.get(ticket.job_id, ("gone", None))
            if state != "queued":
                decided.append(ticket)
            elif key != ticket.wait_key:
                ticket.changed.set()
        if decided:
            self._hand_over(decided)

    def _hand_over(self, tickets: list[Ticket]) -> None:
        decided = self.ledger.queue.decided([t.job_id for t in tickets])
        for ticket in tickets:
            found = decided.get(ticket.job_id)
            if found is None:  # still queued: held by something else now
                ticket.changed.set()
            else:
                ticket.hand(found)

    def _recheck(self) -> None:
        for org, tickets in self._by_org().items():
            states = self.ledger.queue.recheck(org, [t.job_id for t in tickets])
            self._wake_changed(tickets, states)

    def _check_all(self) -> None:
        for tickets in self._by_org().values():
            self._wake_changed(tickets, self.ledger.views.states([t.job_id for t in tickets]))

    def _tell(self, message: str) -> None:
        with self._lock:
            tickets = list(self._tickets.values())
        for ticket in tickets:
            ticket.warning(message)

    def _run(self) -> None:
        idle: float | None = None
        told = 0.0
        watch = self._listen if not self.ledger.db.is_sqlite else self._poll
        while True:
            try:
                idle = self._done(idle)
            except _Idle:
                return
            if idle is not None:  # nothing to watch: linger a while for the next job
                time.sleep(0.1)
                continue
            try:
                idle = watch()
            except OUTAGES as exc:
                now = time.monotonic()
                self._down_since = down = self._down_since or now
                if now - told >= TELL_EVERY_S:
                    told = now
                    self._tell(
                        f"waiting for admission: {describe(exc)}; retrying until it is back "
                        f"(down {now - down:.0f}s)"
                    )
                time.sleep(min(5.0, 0.2 * 2 ** min(5, int(now - down))))
                continue
            except Exception:  # a bug must not leave every waiter asleep: they fall back to
                log.exception("the admission watcher failed; restarting it")  # their own clocks
                time.sleep(1.0)
            told = 0.0

    def _answered(self) -> None:
        """The ledger answered: say so if it had been down."""
        if self._down_since is not None:
            self._tell(
                f"waiting for admission: back after {time.monotonic() - self._down_since:.1f}s"
            )
            self._down_since = None

    def _poll(self) -> float:
        """SQLite: read the org versions every `poll_s` until there is nothing to watch; when
        that was (`time.monotonic()`)."""
        seen: dict[str, int] = {}
        next_recheck = time.monotonic() + self.recheck_s
        while by_org := self._by_org():
            versions = self.ledger.views.versions(by_org)
            self._answered()
            for org, tickets in by_org.items():
                if versions.get(org, 0) != seen.get(org):
                    seen[org] = versions.get(org, 0)
                    self._wake_changed(
                        tickets, self.ledger.views.states([t.job_id for t in tickets])
                    )
            if time.monotonic() >= next_recheck:
                self._recheck()
                next_recheck = time.monotonic() + self.recheck_s
            time.sleep(self.poll_s)
        return time.monotonic()

    def _listen(self) -> float:
        """PostgreSQL: LISTEN on a connection of the watcher's own until there has been nothing
        to watch for `LINGER_S` (when that began: `time.monotonic()`); wake the jobs each notice
        names. The connection stays open while jobs come and go: a new one costs PostgreSQL a
        backend of its own."""
        conn, idle = None, None
        try:
            raw = self.ledger.db.engine.raw_connection()  # a pool's connect raises psycopg's own
            conn = raw.driver_connection
            raw.detach()  # the watcher's own: not one of the pool's
            conn.autocommit = True
            conn.execute(f"LISTEN {NOTICE_CHANNEL}")
            self._check_all()  # what was decided before this connection listened
            self._answered()
            next_recheck = time.monotonic() + self.recheck_s
            while True:
                if self._by_org():
                    idle = None
                elif (idle := idle or time.monotonic()) <= time.monotonic() - LINGER_S:
                    return idle
                timeout = max(0.0, min(0.25, next_recheck - time.monotonic()))
                named = [i for n in conn.notifies(timeout=timeout, stop_after=1) for i in _ids(n)]
                if named:  # and those already here: the decisions of a burst, read at once
                    named += [i for n in conn.notifies(timeout=0.005) for i in _ids(n)]
                    self._wake(named)
                if time.monotonic() >= next_recheck:
                    self._recheck()
                    next_recheck = time.monotonic() + self.recheck_s
        except Exception as exc:
            if _is_psycopg_outage(exc):
                raise _as_outage(exc) from exc
            raise
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()


def _ids(notice: Any) -> list[str]:
    return read_notice(notice.payload)[1]


class _Idle(Exception):
    """The watcher had nothing to watch for `LINGER_S`: its thread ends."""


def _is_psycopg_outage(exc: BaseException) -> bool:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - PostgreSQL ledgers install it
        return False
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)


def _as_outage(exc: BaseException) -> BaseException:
    import sqlalchemy as sa

    return sa.exc.OperationalError("LISTEN", {}, exc)


_watchers: weakref.WeakKeyDictionary[Ledger, Watcher] = weakref.WeakKeyDictionary()
_watchers_lock = threading.Lock()


def watcher_for(ledger: Ledger, poll_s: float = 0.05, recheck_s: float = RECHECK_S) -> Watcher:
    """The one watcher of this process for `ledger` (the quickest clocks any gate asked for)."""
    with _watchers_lock:
        watcher = _watchers.get(ledger)
        if watcher is None:
            watcher = _watchers[ledger] = Watcher(ledger, poll_s, recheck_s)
        watcher.poll_s = min(watcher.poll_s, poll_s)
        watcher.recheck_s = min(watcher.recheck_s, recheck_s)
        return watcher

"""The admission transaction: a job recorded and decided, the org's queue decided, a job
given back to the queue or ended unrun.

Each runs under its org's lock (`Db.write`), loads what the policy needs (`state.load_state`:
the org's queued and active jobs, the budgets on their paths, the period spend, pools and
quotas where a job uses one), and writes what `deciding.decide` / `deciding.plan` says.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget import priorities
from prefect_gpu_budget.admission.ledger.batches import Batcher
from prefect_gpu_budget.admission.ledger.config import priority_class_values, request_rules
from prefect_gpu_budget.admission.ledger.engine import Db, reconnecting
from prefect_gpu_budget.admission.ledger.grants import grant_refusal
from prefect_gpu_budget.admission.ledger.queries import (
    ask_to_stop,
    job_states,
    load_pools,
    path_rules,
    read_overrun,
    recorded,
    recorded_all,
    waiter_ahead,
)
from prefect_gpu_budget.admission.ledger.rows import (
    OVERRUN_REFRESH_S,
    SLOTS_HELD,
    NewJob,
    decided_values,
    in_pool,
    new_job_row,
    wait_tally,
)
from prefect_gpu_budget.admission.ledger.settlement import HeldLease
from prefect_gpu_budget.admission.ledger.state import load_state
from prefect_gpu_budget.admission.ledger.tables import ended_unrun, jobs
from prefect_gpu_budget.admission.rules.deciding import NOT_REACHED, decide, decide_behind, plan
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Decision, LedgerState
from prefect_gpu_budget.admission.rules.quota import Pool
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.admission.rules.timing import STALE_WAITER_S
from prefect_gpu_budget.units import org_of

Asked = tuple[Decision, list[BudgetRule], bool]
"""A request's decision, the budgets on its path, and whether the lease its holder took before it
asked was recorded with the admission."""


@dataclass
class _Batch:
    """What the requests recorded in one transaction share: reads that none of them changes."""

    recorded: dict[str, Any]
    """Rows of the batch's ids recorded already (a retry after a dropped connection)."""
    rules: dict[str, list[BudgetRule]] = field(default_factory=dict)
    """Per scope: the budgets on its path, its session budget made from a template first."""
    classes: dict[str, int] | None = None
    pools: list[Pool] | None = None
    waiters: dict[tuple[str, int], Any] = field(default_factory=dict)
    """Per (scope, priority): the live waiter a new job joins behind, until a full decision."""


class Queue:
    """Requests and their decisions, the org's queue, and what leaves the queue unrun, over the
    ledger's database (`Db`). `headroom` is what every other store's write that may have made
    room ends in."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self._overrun_cache: dict[str, tuple[float, dict[str, float]]] = {}
        """Per org: when `_overrun` last read it, and what it read."""
        self._asks: dict[str, Batcher[tuple[str, NewJob, HeldLease | None], Asked]] = {}
        """Per org: this process's requests, recorded together when they arrive together."""
        self._asks_guard = threading.Lock()
        self._unsure: set[str] = set()
        """Job ids whose request transaction did not return: it may have committed, so their
        next try reads what it recorded (a first try has nothing to read)."""

    def headroom(self, conn: Connection, org: str) -> None:
        """Headroom may have appeared in `org` (a job settled or left the queue, a budget, a
        pool or a grant changed): decide its queue once, admitting every job that now fits
        whichever process holds it, then bump the org's version and notify the jobs decided,
        all in the caller's transaction. An org where nothing waits has no waiter to wake, so
        its version stays (one statement less for each settlement of an uncontended org)."""
        decided = self._decide_queue(conn, org, time.time())
        if decided is not None:
            self.db.bump(conn, org, decided)

    def request(
        self, job: NewJob, now: float | None = None, job_id: str | None = None
    ) -> tuple[str, Decision]:
        """Record a job asking to be admitted and decide it at once, in one transaction.

        A session scope with no budget first gets its team's session template, if any.
        Asking again with the same `job_id` (after an outage) records the job once.
        """
        job_id = job_id or str(uuid.uuid4())  # fixed before any retry: recorded once
        return job_id, self._request(job_id, job, now)[0]

    def ask(self, job: NewJob, job_id: str, lease: HeldLease | None = None) -> Asked:
        """`request`, with the budgets on the job's path (outermost first) read in the same
        transaction: what a gate tells of a job that waits, without a read of its own.

        `lease`: Prefect slots the holder took before it asked. Admitted under the caps and
        slots they were taken for, within `HeldLease.fresh_s` of asking, the job's row records
        the lease in the same transaction (`HeldLease.values`); the third value says whether it
        did. Otherwise the lease is the holder's to take over or give back.

        The requests of this process to one org that arrive while one is being recorded are
        recorded together next, in one transaction (`batches.Batcher`): a sweep's trials, or a
        burst of a thousand, cost a few transactions under the org's lock, not one each."""
        org = org_of(job.scope)
        with self._asks_guard:
            asks = self._asks.get(org)
            if asks is None:
                asks = self._asks[org] = Batcher(functools.partial(self._requests, org))
        return asks.call((job_id, job, lease))

    def _request(self, job_id: str, job: NewJob, now: float | None) -> Asked:
        return self._requests(org_of(job.scope), [(job_id, job, None)], now)[0]

    @reconnecting
    def _requests(
        self,
        org: str,
        asked: Sequence[tuple[str, NewJob, HeldLease | None]],
        now: float | None = None,
    ) -> list[Asked]:
        """Record and decide jobs of `org` asking to be admitted, in order, in one transaction
        (a job already recorded under its id, before a connection dropped, is recorded once),
        each admitted one with the lease it holds (`ask`)."""
        ids = [job_id for job_id, _, _ in asked]
        retried = [job_id for job_id in ids if job_id in self._unsure]
        self._unsure.update(ids)
        with self.db.write(org, request=True) as conn:  # after the org's other writes waiting
            found = (
                conn.execute(sa.select(jobs).where(jobs.c.id.in_(retried))).mappings()
                if retried
                else ()
            )
            batch = _Batch(recorded={row["id"]: row for row in found})
            decided = [
                self._record_request(conn, org, job_id, job, lease, now, batch)
                for job_id, job, lease in asked
            ]
        self._unsure.difference_update(ids)
        return decided

    def _record_request(
        self,
        conn: Connection,
        org: str,
        job_id: str,
        job: NewJob,
        lease: HeldLease | None,
        now: float | None,
        batch: _Batch,
    ) -> Asked:
        now = time.time() if now is None else now  # after the lock: stamps follow its order
        if job_id in batch.recorded:  # committed before the connection dropped
            row = batch.recorded[job_id]
            held = lease is not None and row["lease_id"] == lease.lease_id
            return recorded(conn, row), path_rules(conn, job.scope), held
        rules = batch.rules.get(job.scope)
        if rules is None:
            rules = batch.rules[job.scope] = request_rules(conn, job.scope, now)
        if job.priority_class is not None:
            if batch.classes is None:
                batch.classes = priority_class_values(conn, org)
            job = replace(job, priority=priorities.resolve(job.priority_class, batch.classes, org))
        refusal = grant_refusal(conn, job.scope, job.grant) if job.grant is not None else ""
        if batch.pools is None:
            batch.pools = load_pools(conn, org)
        job = in_pool(batch.pools, org, job)
        conn.execute(jobs.insert(), new_job_row(job_id, org, job, now))
        if refusal:  # on record like any refusal, and nothing reserved
            conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id)
                .values(**ended_unrun("rejected", refusal, now))
            )
            return Decision("reject", refusal, limit="agent"), rules, False
        decision = self._behind_a_waiter(conn, job_id, org, job, now, rules, batch)
        if decision is not None:  # it waits
            self._write_decision(conn, job_id, decision, now, None, reason="")
            return decision, rules, False
        batch.waiters.clear()  # the whole queue decided: the waiters found may have moved
        if lease is not None and lease.slots != job.rate_cents:
            lease = None  # taken for other slots: its holder takes its own
        decision = self._decide(conn, job_id, org, now, "", None, path=rules, lease=lease)
        return decision, rules, lease is not None and bool(lease.values(decision, now))

    def _behind_a_waiter(
        self,
        conn: Connection,
        job_id: str,
        org: str,
        job: NewJob,
        now: float,
        rules: list[BudgetRule],
        batch: _Batch,
    ) -> Decision | None:
        """The decision of a new job that joins the queue behind a live waiter blocked by a
        budget on its path in its own team's queue (`deciding.decide_behind`): one indexed read,
        not the org's whole queue, and none for the next job of the same scope and priority in
        the same transaction. None where that does not hold: the full decision is needed. (Outside
        capacity pools only, where queue order is priority, then arrival.)"""
        if job.pool is not None:
            return None
        key = (job.scope, job.priority)
        row = batch.waiters.get(key)
        if row is None:
            row = waiter_ahead(conn, org, job_id, job, now, STALE_WAITER_S)
            if row is None:
                return None
            batch.waiters[key] = row  # still ahead of every later job of this key here
        budgets_on_path = {rule.scope: rule for rule in rules}
        estimate = any(rule.reservation_mode == "estimate" for rule in rules)
        state = LedgerState(
            now=now,
            budgets=budgets_on_path,
            holds=(),
            settled={},
            overrun=self._overrun(conn, org, now) if estimate else {},
        )
        ahead = Request(row.id, row.scope, 0, 0, 0.0, None, row.priority, row.requested_at)
        req = Request.of(job_id, job, now)
        limit, _, scope = row.wait_key.partition(" ")
        return decide_behind(state, req, ahead, scope, limit)

    @reconnecting
    def try_admit(self, job_id: str, scope: str, now: float | None = None) -> Decision:
        """Decide a queued job against everything else in its org, in one transaction.

        Writes what the decision says: the admission and its reservation, a rejection or a
        time-out, or the reason it still waits (so `status` can say why).
        """
        org = scope.split("/")[0]
        with self.db.write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one()
            if row["state"] == "admitted":  # by another's transaction: its holder takes over
                conn.execute(jobs.update().where(jobs.c.id == job_id).values(heartbeat_at=now))
            if row["state"] != "queued":
                return recorded(conn, row)
            return self._decide(conn, job_id, org, now, reason=row["reason"], waited=row)

    def _decide(
        self,
        conn: Connection,
        job_id: str,
        org: str,
        now: float,
        reason: str,
        waited: Any,
        path: list[BudgetRule] | None = None,
        lease: HeldLease | None = None,
    ) -> Decision:
        """Run the policy for a queued job and write what it says, heartbeat included, and what
        held it for how long (`waited`: the job's row as it stood, None for a new job), with
        the `lease` its holder took before it asked where it is for this admission
        (`HeldLease.values`).

        A waiter that leaves the queue (admitted, refused) may have held the jobs behind it, so
        the org's queue is decided again (`headroom`), as it is when a decision asks jobs to
        stop, or when other jobs wait in the org at all: time alone may have made room for one
        of them (a silent waiter ahead, a period's turn), and the policy's walk to this job may
        have counted it admitted, which only a decision of the queue writes. A new job decided
        at once in an org where nothing else waits runs the policy once. (`path`: the budgets
        on the job's path, when this transaction read them already.)"""
        state, queue = load_state(conn, org, now, job_id, path, self._overrun)
        decision = decide(state, queue, job_id)
        held = lease.values(decision, now) if lease is not None else {}
        _, asked = self._write_decision(conn, job_id, decision, now, waited, reason, held=held)
        others_wait = any(request.job_id != job_id for request in queue)
        if asked or (decision.verdict != "wait" and (waited is not None or others_wait)):
            self.headroom(conn, org)
        return decision

    def _write_decision(
        self,
        conn: Connection,
        job_id: str,
        decision: Decision,
        now: float,
        waited: Any,
        reason: str | None = None,
        *,
        holder: bool = True,
        held: dict[str, Any] | None = None,
    ) -> tuple[bool, bool]:
        """Write a queued job's decision (`waited`: its row as it stood, None for a new job).
        Returns whether its state or what blocks it changed, and whether it asked jobs to stop
        (`Decision.preempt`). Only its `holder` deciding stamps a waiting job's row: a job
        decided by another's transaction must not look alive when its holder is gone (an
        admission stamps it: the holder has `LIMIT_RETRY_S` from then to take its slots, or
        its row records the lease it `held` already, stamped when that was asked for)."""
        reason = waited["reason"] if reason is None else reason
        tally = wait_tally(waited, decision, now)
        values = {**tally, **decided_values(decision, now, reason, stamp=holder), **(held or {})}
        if values:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))
        asked = 0
        if decision.preempt:  # lent capacity taken back, or a team's own lower priority work
            asked = ask_to_stop(conn, decision.preempt, now, f"preempted for job {job_id[:8]}")
        return decision.verdict != "wait" or bool(tally), bool(asked)

    def _decide_queue(self, conn: Connection, org: str, now: float) -> list[str] | None:
        """Decide every queued job of `org` the policy reaches this round (`plan`) and write what
        it says; the ids whose state or whatever blocks them changed, None when nothing is
        queued. Jobs it does not reach (behind a job that blocks what they need) are left as
        they are."""
        state, queue = load_state(conn, org, now, "", overrun=self._overrun)
        if not queue:
            return None
        reached = {k: d for k, d in plan(state, queue).items() if d is not NOT_REACHED}
        if not reached:
            return []
        rows = {
            row["id"]: row
            for row in conn.execute(
                sa.select(
                    jobs.c.id, jobs.c.reason, jobs.c.wait_key, jobs.c.wait_since, jobs.c.waits
                ).where(jobs.c.id.in_(list(reached)))
            ).mappings()
        }
        decided = []
        for job_id, decision in reached.items():
            changed, _ = self._write_decision(
                conn, job_id, decision, now, rows[job_id], holder=False
            )
            if changed:
                decided.append(job_id)
        return decided

    @reconnecting
    def recheck(
        self, org: str, waiting: Iterable[str], now: float | None = None
    ) -> dict[str, tuple[str, str | None]]:
        """A watcher's safety pass over `org`, in one transaction: stamp the rows of the jobs it
        waits for (`waiting`: they keep their place), decide the org's queue (time alone can
        make room: a period rolls over, a waiter elsewhere went silent), and return `states`.
        It catches what a lost notice would have said."""
        waiting = list(waiting)
        with self.db.write(org) as conn:
            now = time.time() if now is None else now
            if waiting:
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id.in_(waiting), jobs.c.state == "queued")
                    .values(heartbeat_at=now)
                )
            decided = self._decide_queue(conn, org, now)
            if decided:
                self.db.bump(conn, org, decided)
            return job_states(conn, waiting)

    @reconnecting
    def decided(self, job_ids: Iterable[str]) -> dict[str, tuple[Decision, float]]:
        """The recorded decision of each of `job_ids` no longer queued, with when its row was
        last stamped, in one read: a watcher hands them to the jobs it wakes, so a job decided
        by another's transaction learns it without a transaction of its own."""
        with self.db.read() as conn:
            rows = list(
                conn.execute(
                    sa.select(jobs).where(jobs.c.id.in_(list(job_ids)), jobs.c.state != "queued")
                ).mappings()
            )
            if not rows:
                return {}
            stamped = {row["id"]: row["heartbeat_at"] for row in rows}
            return {i: (d, stamped[i]) for i, d in recorded_all(conn, rows).items()}

    @reconnecting
    def unadmit(
        self,
        job_id: str,
        scope: str,
        reason: str,
        now: float | None = None,
        *,
        end: str | None = None,
    ) -> bool:
        """Put an admitted job that could not start back in the queue, keeping its place (no
        longer asked to make room), or end it unrun: `end` (rejected, timed_out), or cancelled
        if its owner asked it to stop. One transaction, or its decision could admit it first."""
        now = time.time() if now is None else now
        unheld = {"admitted_at": None, "reserved_micro": 0, "reserve_seconds": 0.0}
        then: dict[str, Any] = {"preempt_at": None, "heartbeat_at": now}
        if end:
            then |= ended_unrun(end, reason, now)
        else:  # one statement, so that a stop asked meanwhile (no org lock) is seen, or follows
            asked, back = jobs.c.stop_asked_at.is_not(None), {"state": "queued", "reason": reason}
            gone = {**ended_unrun("cancelled", reason, now), "reason": jobs.c.reason}
            then |= {k: sa.case((asked, v), else_=back.get(k, jobs.c[k])) for k, v in gone.items()}
            # what blocks it now, as a waiting job's row says (`wait_spans` counts it)
            then |= {"wait_key": f"{SLOTS_HELD} {scope}", "wait_since": now}
        with self.db.write(org := scope.split("/")[0]) as conn:
            done = conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id, jobs.c.state == "admitted")
                .values(**unheld, **then)
            ).rowcount
            self.headroom(conn, org)
        return bool(done)

    @reconnecting
    def cancel_queued(
        self,
        job_id: str,
        scope: str,
        reason: str,
        now: float | None = None,
        state: str = "cancelled",
    ) -> bool:
        """End a queued job: `cancelled`, or `timed_out` when its max wait ran out."""
        now = time.time() if now is None else now
        org = scope.split("/")[0]
        with self.db.write(org) as conn:
            done = conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id, jobs.c.state == "queued")
                .values(**ended_unrun(state, reason, now))
            ).rowcount
            self.headroom(conn, org)
        return bool(done)

    def _overrun(self, conn: Connection, org: str, now: float) -> dict[str, float]:
        """Per scope, how far its settled jobs overran their estimates; read at most every
        OVERRUN_REFRESH_S per org and process (it changes slowly, and the read is not free)."""
        cached = self._overrun_cache.get(org)
        if cached is None or not 0 <= now - cached[0] < OVERRUN_REFRESH_S:
            cached = (now, read_overrun(conn, org))
            self._overrun_cache[org] = cached
        return cached[1]

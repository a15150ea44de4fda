"""A job's life after admission: started, submitted to a cloud, holding a Prefect lease,
alive (heartbeats), and settled exactly once, its actual cost booked to the period spend of
every budget on its path."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.engine import Db, reconnecting
from prefect_gpu_budget.admission.ledger.queries import add_to_periods, path_rules
from prefect_gpu_budget.admission.ledger.tables import ACTIVE, jobs
from prefect_gpu_budget.admission.rules import accounting
from prefect_gpu_budget.admission.rules.policy import Decision

FRESH_LEASE_S = 5.0
"""A lease asked for longer ago than this (a ledger slow to answer) is not recorded with the
admission: its holder checks it is alive first and records it apart (`SlotLeases.take`)."""


@dataclass(frozen=True)
class HeldLease:
    """Prefect slots a job's holder took before its request (`SlotLeases.early`): the lease, the
    caps and slots it was asked under, and when it was asked (this host's wall clock, before the
    request to Prefect went out: the lease lives at least `LEASE_S` from then)."""

    lease_id: str
    caps: tuple[tuple[str, int], ...]
    slots: int
    asked_at: float
    fresh_s: float = FRESH_LEASE_S
    """Recorded with the admission only if its transaction decides within this long of
    `asked_at`."""

    def values(self, decision: Decision, now: float) -> dict[str, Any]:
        """The columns that record this lease with `decision`, in the transaction that writes
        it, when it is an admission under the caps the lease was taken for, and the lease is
        fresh; none otherwise. The row is stamped when the lease was asked for, not later:
        reconcile reads a recorded lease as renewed at or after the row's last stamp
        (`orphans.lease_to_give_back`)."""
        if decision.verdict != "admit" or decision.caps != self.caps:
            return {}
        if not 0.0 <= now - self.asked_at <= self.fresh_s:
            return {}
        return {"lease_id": self.lease_id, "heartbeat_at": self.asked_at}


class Settlements:
    """The writes of an admitted job's launcher and of its settlement, over the ledger's
    database; `headroom` (the queue's) ends a settlement."""

    def __init__(self, db: Db, headroom: Callable[[Connection, str], None]) -> None:
        self.db, self.headroom = db, headroom

    @reconnecting
    def mark_started(self, job_id: str, started_at: float, external_id: str | None = None) -> bool:
        """The launcher started the job (`external_id`: pid and start ticks, or a cloud job id).

        False if the job is no longer admitted (reconcile settled it): it must not run.
        """
        with self.db.tx() as conn:
            return bool(
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id == job_id, jobs.c.state == "admitted")
                    .values(
                        state="running",
                        started_at=started_at,
                        heartbeat_at=started_at,
                        external_id=external_id,
                    )
                ).rowcount
            )

    @reconnecting
    def record_submission(self, job_id: str, external_id: str) -> None:
        """A cloud accepted the admitted job (it may wait for capacity before it starts)."""
        with self.db.tx() as conn:
            conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id, jobs.c.state == "admitted")
                .values(external_id=external_id)
            )

    @reconnecting
    def record_lease(self, job_id: str, lease_id: str) -> bool:
        """Remember the Prefect lease an admission holds, so reconcile can hand it back; False
        (nothing written) when the job is no longer admitted or running: its holder must then
        release the lease itself, as nobody else will."""
        with self.db.tx() as conn:
            return (
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id == job_id, jobs.c.state.in_(ACTIVE))
                    .values(lease_id=lease_id)
                ).rowcount
                == 1
            )

    @reconnecting
    def ask_stop(self, job_id: str, reason: str, now: float | None = None) -> bool:
        """Ask the holder of an admitted or running job to stop it (SIGTERM, its kill grace,
        SIGKILL) and settle it for what it ran; False when it is not admitted or running."""
        with self.db.tx() as conn:
            return bool(
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id == job_id, jobs.c.state.in_(ACTIVE))
                    .where(jobs.c.stop_asked_at.is_(None))
                    .values(stop_asked_at=time.time() if now is None else now, reason=reason)
                ).rowcount
            )

    @reconnecting
    def heartbeat(self, job_id: str, now: float | None = None) -> None:
        with self.db.tx() as conn:
            conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id)
                .values(heartbeat_at=time.time() if now is None else now)
            )

    @reconnecting
    def settle(
        self,
        job_id: str,
        *,
        ended_at: float,
        outcome: str,
        billed_seconds: float | None = None,
        actual_micro: int | None = None,
        scope: str | None = None,
        now: float | None = None,
    ) -> dict[str, Any] | None:
        """Replace a job's reservation with its actual cost, exactly once.

        Returns the settled row, or None if the job was settled already (settling twice
        charges once). `actual_micro` is the cloud's billed figure where known; otherwise
        rate x billed seconds (by default the time from start to end).
        """
        if scope is None:
            with self.db.read() as probe:
                scope = probe.execute(
                    sa.select(jobs.c.scope).where(jobs.c.id == job_id)
                ).scalar_one()
        org = scope.split("/")[0]
        with self.db.write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            job = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one()
            if job["state"] not in ACTIVE:
                return None
            billed, actual = accounting.settled_cost(
                job["rate_micro_per_hour"],
                job["started_at"],
                ended_at,
                billed_seconds=billed_seconds,
                actual_micro=actual_micro,
            )
            values = {
                "state": "settled",
                "ended_at": ended_at,
                "settled_at": now,
                "billed_seconds": billed,
                "actual_micro": actual,
                "outcome": outcome,
            }
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))
            start, end = accounting.incurred_span(job["started_at"], ended_at)
            self._add_spend(conn, job["scope"], actual, start, end)
            self.headroom(conn, org)
        return {**job, **values}

    def _add_spend(
        self, conn: Connection, scope: str, actual: int, start: float, end: float
    ) -> None:
        by_scope = {rule.scope: rule for rule in path_rules(conn, scope)}
        add_to_periods(conn, accounting.book(scope, actual, start, end, by_scope), by_scope)

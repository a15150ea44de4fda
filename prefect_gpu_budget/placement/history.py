"""What the ledger saw of each offering: the history `choice.place` expects its cost and start
from, read from the ledger's jobs and the clouds' bills.

Keyed `(instance_type, provisioning, "")`: a job's `instance_type` is already `cloud:type` (the
offering's `key`), and a job's region is not recorded, so each machine's history stands for every
region of it (`place` falls back to the `""` region). Per key:

- `waits_s`: admission to start (`started_at - admitted_at`) of the jobs that started, oldest
  first, the latest `MOST_WAITS` of them (by start);
- `run_hours`: what the ended jobs ran, per node (`ended_at - started_at`: the hours they held
  their machines, which is what a machine is taken back per; a launcher's billed seconds may be
  fewer), in hours;
- `interruptions`: the ended jobs whose machine was taken back (`TAKEN_BACK`);
- `billed_over_reserved`: of the jobs whose bill is final, what the bill charged over what the
  gate's rate comes to for the time they ran (`rate_micro_per_hour x (ended_at - started_at)`:
  the rate times the wall-clock hours, which is what `choice.expect` multiplies the figure by).
  Where no final bill names a job of the key, the same figure from what the ledger settled for
  its ended jobs, known the moment they end: 1 where the ledger charged the rate for the time
  they ran, less where the launcher said the cloud billed less (SageMaker managed spot bills
  only part of the time it trained); None for a key with no ended job.

Three queries, one per figure (the run hours and the interruptions share one), each aggregated
in SQL or limited per key there, and each over a bounded part of the ledger: the jobs over the
newest `RECENT_JOBS` (read down the `requested_at` index), the bills over the latest
`RECENT_BILLS` final ones, so a ledger of a million jobs is read no slower than one of fifty
thousand, and nothing but the figures is brought into memory. `since_s` narrows all three to
the jobs asked for in that window. The same SQL runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import Ledger, jobs
from prefect_gpu_budget.admission.ledger.engine import reconnecting
from prefect_gpu_budget.admission.ledger.tables import PREEMPTED, bill_jobs
from prefect_gpu_budget.placement.choice import History

HistoryKey = tuple[str, str, str]

MOST_WAITS = 200
"""The latest waits kept per offering: enough for a median and a ninetieth percentile that
follow the capacity as it changes."""
RECENT_JOBS = 50_000
"""The waits, run hours and interruptions are those of the ledger's newest this many jobs."""
RECENT_BILLS = 50_000
"""The billed-over-reserved is that of the jobs of the latest this many final bills (a bill is
final weeks after its jobs ran: the newest jobs have none yet)."""

TAKEN_BACK = (PREEMPTED, "interrupted")
"""The outcomes of a job whose machine was taken back from under it:

- `preempted`: the gate asked it to stop because a job of higher claim takes its capacity (a
  pool team reclaiming what it lent, or its own team's higher-priority work: `tables.PREEMPTED`,
  `lifecycle.STOP_OUTCOMES`, `rules/preemption.py`);
- `interrupted`: a cloud took a spot machine back after the job started (a Vertex AI Spot VM
  preempted, a SageMaker managed spot job not resumed within its wait: `launchers.base.INTERRUPTED`,
  told apart in `vertex_outcome` and `sagemaker_outcome`).

`cancelled`, `failed`, `timed_out` and `wait_expired` are the job's own ends, its owner's or a
limit's: not counted."""


def _recent(since_s: float | None, now: float | None) -> sa.Subquery:
    """The ledger's newest `RECENT_JOBS` jobs (of the last `since_s` seconds before `now`, when
    given), read newest first down the `requested_at` index: never the whole table."""
    query = (
        sa.select(
            jobs.c.id,
            jobs.c.instance_type,
            jobs.c.provisioning,
            jobs.c.admitted_at,
            jobs.c.started_at,
            jobs.c.ended_at,
            jobs.c.actual_micro,
            jobs.c.rate_micro_per_hour,
            jobs.c.outcome,
        )
        .order_by(jobs.c.requested_at.desc())
        .limit(RECENT_JOBS)
    )
    if since_s is not None:
        now = time.time() if now is None else now
        query = query.where(jobs.c.requested_at >= now - since_s)
    return query.subquery("recent")


def _waits(conn: sa.Connection, recent: sa.Subquery) -> Iterable[sa.Row]:
    """(instance_type, provisioning, wait) of each key's latest `MOST_WAITS` started jobs,
    oldest first."""
    latest = sa.func.row_number().over(
        partition_by=(recent.c.instance_type, recent.c.provisioning),
        order_by=(recent.c.started_at.desc(), recent.c.id.desc()),
    )
    started = (
        sa.select(
            recent.c.instance_type,
            recent.c.provisioning,
            recent.c.id,
            recent.c.started_at,
            (recent.c.started_at - recent.c.admitted_at).label("wait"),
            latest.label("n"),
        )
        .where(recent.c.started_at.is_not(None), recent.c.admitted_at.is_not(None))
        .subquery("started")
    )
    query = (
        sa.select(started.c.instance_type, started.c.provisioning, started.c.wait)
        .where(started.c.n <= MOST_WAITS)
        .order_by(
            started.c.instance_type, started.c.provisioning, started.c.started_at, started.c.id
        )
    )
    return conn.execute(query)


def _runs(conn: sa.Connection, recent: sa.Subquery) -> Iterable[sa.Row]:
    """(instance_type, provisioning, run seconds, interruptions, settled, priced) of the ended
    jobs, per key: `settled` over `priced` is what they were settled for, over the gate's rate
    times the hours they ran."""
    ran = recent.c.ended_at - recent.c.started_at
    taken_back = sa.case((recent.c.outcome.in_(TAKEN_BACK), 1), else_=0)
    wall = recent.c.rate_micro_per_hour * (recent.c.ended_at - recent.c.started_at) / 3600.0
    query = (
        sa.select(
            recent.c.instance_type,
            recent.c.provisioning,
            sa.func.sum(ran).label("seconds"),
            sa.func.sum(taken_back).label("interruptions"),
            sa.func.sum(recent.c.actual_micro).label("settled"),
            sa.func.sum(wall).label("priced"),
        )
        .where(recent.c.started_at.is_not(None), recent.c.ended_at.is_not(None))
        .group_by(recent.c.instance_type, recent.c.provisioning)
    )
    return conn.execute(query)


def _bills(conn: sa.Connection, since_s: float | None, now: float | None) -> Iterable[sa.Row]:
    """(instance_type, provisioning, billed, priced) of the jobs of the latest `RECENT_BILLS`
    final bills: what the bill charged, and the gate's rate times the hours they ran."""
    final = (
        sa.select(bill_jobs.c.job_id, bill_jobs.c.billed_micro)
        .where(bill_jobs.c.final.is_(sa.true()))
        .order_by(bill_jobs.c.updated_at.desc())
        .limit(RECENT_BILLS)
        .subquery("final")
    )
    priced = jobs.c.rate_micro_per_hour * (jobs.c.ended_at - jobs.c.started_at) / 3600.0
    query = (
        sa.select(
            jobs.c.instance_type,
            jobs.c.provisioning,
            sa.func.sum(final.c.billed_micro).label("billed"),
            sa.func.sum(priced).label("priced"),
        )
        .select_from(final.join(jobs, jobs.c.id == final.c.job_id))
        .where(jobs.c.started_at.is_not(None), jobs.c.ended_at.is_not(None))
        .group_by(jobs.c.instance_type, jobs.c.provisioning)
    )
    if since_s is not None:
        now = time.time() if now is None else now
        query = query.where(jobs.c.requested_at >= now - since_s)
    return conn.execute(query)


@reconnecting
def offering_histories(
    ledger: Ledger, *, since_s: float | None = None, now: float | None = None
) -> dict[HistoryKey, History]:
    """Each machine and provisioning's history in `ledger` (see the module's docstring), of the
    jobs asked for in the last `since_s` seconds before `now` (every job without `since_s`)."""
    recent = _recent(since_s, now)
    waits: dict[HistoryKey, list[float]] = defaultdict(list)
    hours: dict[HistoryKey, tuple[float, int]] = {}
    ratios: dict[HistoryKey, float] = {}
    with ledger.db.read() as conn:
        for row in _waits(conn, recent):
            waits[row.instance_type, row.provisioning, ""].append(max(0.0, float(row.wait)))
        for row in _runs(conn, recent):
            key = (row.instance_type, row.provisioning, "")
            hours[key] = (float(row.seconds or 0.0) / 3600.0, int(row.interruptions or 0))
            if row.priced and float(row.priced) > 0:
                ratios[key] = float(row.settled or 0) / float(row.priced)
        for row in _bills(conn, since_s, now):
            if row.priced and float(row.priced) > 0:
                key = (row.instance_type, row.provisioning, "")
                ratios[key] = float(row.billed) / float(row.priced)
    return {
        key: History(
            waits_s=tuple(waits.get(key, ())),
            run_hours=hours.get(key, (0.0, 0))[0],
            interruptions=hours.get(key, (0.0, 0))[1],
            billed_over_reserved=ratios.get(key),
        )
        for key in sorted({*waits, *hours, *ratios})
    }

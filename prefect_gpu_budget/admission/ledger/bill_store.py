"""The rows of the imported bills, read and written for `bills.Bills` (the lines on their way
in, and each line's kind: `bill_staging`): what a job's lines of other periods bill
(`booked_elsewhere`), each job's figure from all its lines (`refigure`), what final figures
book in the periods (`trueup_shares`, `trueups`, which the audit and a budget set again read
too), and the closed periods over their budget by it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.queries import path_rules, subtree
from prefect_gpu_budget.admission.ledger.tables import (
    bill_accepts,
    bill_jobs,
    bill_lines,
    jobs,
    over_by_bill,
    period_spend,
)
from prefect_gpu_budget.admission.rules import accounting
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import USAGE_TYPES
from prefect_gpu_budget.billing.results import OverByBill
from prefect_gpu_budget.billing.trueup import (
    BilledJob,
    held_reason,
    provisional_reason,
)


@dataclass(frozen=True)
class Figure:
    """A job's bill as the ledger holds it after an import."""

    scope: str
    final: bool
    billed_micro: int
    held: bool
    reason: str | None
    """Why it is not final (provisional, or held for an admin); None when final."""


def billed_job(row: Any) -> BilledJob:
    return BilledJob(**{name: row[name] for name in BilledJob.__dataclass_fields__})


JOB_COLUMNS = [jobs.c[name] for name in BilledJob.__dataclass_fields__]


def chunks(values: list[str], size: int = 500) -> Iterable[list[str]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def booked_elsewhere(
    conn: Connection, source: str, billing_period: str, job_ids: list[str]
) -> dict[str, tuple[int, bool]]:
    """{job id: (what its lines of `source`'s other billing periods bill, whether any of them
    bills usage)}."""
    out: dict[str, tuple[int, bool]] = {}
    for chunk in chunks(job_ids):
        query = sa.select(
            bill_lines.c.job_id, bill_lines.c.billed_micro, bill_lines.c.line_type
        ).where(
            bill_lines.c.job_id.in_(chunk),
            bill_lines.c.source == source,
            bill_lines.c.billing_period != billing_period,
        )
        for job_id, amount, kind in conn.execute(query):
            total, usage = out.get(job_id, (0, False))
            out[job_id] = (total + amount, usage or (kind.lower() in USAGE_TYPES and amount > 0))
    return out


def line_view(row: Any) -> dict[str, Any]:
    return {
        name: row[name]
        for name in (
            "source",
            "billing_period",
            "line_id",
            "kind",
            "line_type",
            "usage_start",
            "usage_end",
            "billed_micro",
            "mark",
            "resource_id",
            "description",
            "reason",
        )
    }


def refigure(
    conn: Connection, job_ids: list[str], provisional_hours: float, now: float
) -> dict[str, Figure]:
    """Each job's bill from all its lines, final, provisional or held: written to `bill_jobs`
    (a job no line names any more is taken out)."""
    if not job_ids:
        return {}
    spans: dict[str, list[tuple[int, float]]] = defaultdict(list)
    accepted: dict[str, int] = {}
    rows: list[Any] = []
    for chunk in chunks(job_ids):
        for job_id, amount, end in conn.execute(
            sa.select(bill_lines.c.job_id, bill_lines.c.billed_micro, bill_lines.c.usage_end).where(
                bill_lines.c.job_id.in_(chunk)
            )
        ):
            spans[job_id].append((amount, end))
        accepted.update(
            conn.execute(
                sa.select(bill_accepts.c.job_id, bill_accepts.c.accepted_micro).where(
                    bill_accepts.c.job_id.in_(chunk)
                )
            ).all()
        )
        rows += conn.execute(sa.select(*JOB_COLUMNS).where(jobs.c.id.in_(chunk))).mappings().all()
        conn.execute(bill_jobs.delete().where(bill_jobs.c.job_id.in_(chunk)))
    state: dict[str, Figure] = {}
    for job in map(billed_job, rows):
        if job.id not in spans:
            continue
        billed = sum(amount for amount, _ in spans[job.id])
        reason = provisional_reason(job, (end for _, end in spans[job.id]), now, provisional_hours)
        held = reason is None and (reason := held_reason(job, billed, accepted.get(job.id)))
        state[job.id] = Figure(job.scope, reason is None, billed, bool(held), reason)
        conn.execute(
            bill_jobs.insert().values(
                job_id=job.id,
                org=job.org,
                scope=job.scope,
                billed_micro=billed,
                final=reason is None,
                held=bool(held),
                reason=reason,
                updated_at=now,
            )
        )
    return state


def trueup_shares(
    conn: Connection, job_ids: Iterable[str], rules: dict[str, BudgetRule] | None = None
) -> dict[tuple[str, float], int]:
    """What the final bills of `job_ids` book in the period budgets now, on top of their
    settlements (`accounting.book_trueup`), from the lines the ledger holds; `rules` (by
    scope) default to each job's path's budgets."""
    out: dict[tuple[str, float], int] = defaultdict(int)
    for _, shares in trueups(conn, job_ids, rules):
        for key, share in shares.items():
            out[key] += share
    return dict(out)


def trueups(
    conn: Connection, job_ids: Iterable[str], rules: dict[str, BudgetRule] | None = None
) -> list[tuple[float, dict[tuple[str, float], int]]]:
    """(when, shares) of each job of `job_ids` whose bill is final: when its figure last
    changed, and what it books on top of its settlement (`trueup_shares`, job by job)."""
    ids = list(job_ids)
    found: dict[str, tuple[BilledJob, float]] = {}
    for chunk in chunks(ids):
        for row in conn.execute(
            sa.select(*JOB_COLUMNS, bill_jobs.c.updated_at)
            .select_from(bill_jobs.join(jobs, jobs.c.id == bill_jobs.c.job_id))
            .where(bill_jobs.c.job_id.in_(chunk), bill_jobs.c.final.is_(True))
        ).mappings():
            found[row["id"]] = (billed_job(row), row["updated_at"])
    spans: dict[str, list[accounting.Spend]] = defaultdict(list)
    for chunk in chunks(list(found)):
        for job_id, amount, start, end in conn.execute(
            sa.select(
                bill_lines.c.job_id,
                bill_lines.c.billed_micro,
                bill_lines.c.usage_start,
                bill_lines.c.usage_end,
            ).where(bill_lines.c.job_id.in_(chunk))
        ):
            spans[job_id].append((amount, start, end))
    out = []
    for job, at in found.values():
        path = rules if rules is not None else {r.scope: r for r in path_rules(conn, job.scope)}
        settled = accounting.row_spend(
            {
                "actual_micro": job.actual_micro,
                "started_at": job.started_at,
                "ended_at": job.ended_at,
                "settled_at": job.settled_at,
            }
        )
        out.append((at, accounting.book_trueup(job.scope, spans[job.id], settled, path)))
    return out


def booked_drift(conn: Connection, job_ids: Iterable[str]) -> int:
    """What the final bills of `job_ids` book on top of their settlements, counted once (per
    job: its bill less its settlement), whatever the number of budgets on its path."""
    total = 0
    for chunk in chunks(list(job_ids)):
        query = (
            sa.select(bill_jobs.c.billed_micro, jobs.c.actual_micro)
            .select_from(bill_jobs.join(jobs, jobs.c.id == bill_jobs.c.job_id))
            .where(bill_jobs.c.job_id.in_(chunk), bill_jobs.c.final.is_(True))
        )
        total += sum(billed - (settled or 0) for billed, settled in conn.execute(query))
    return total


def final_bill_jobs(conn: Connection, scope: str) -> list[str]:
    """The jobs of `scope`'s subtree whose bill is final (their true-up is in the periods)."""
    return list(
        conn.execute(
            sa.select(bill_jobs.c.job_id).where(
                subtree(bill_jobs.c.scope, scope), bill_jobs.c.final.is_(True)
            )
        ).scalars()
    )


def mark_over(
    conn: Connection,
    touched: set[tuple[str, float]],
    rules: dict[str, BudgetRule],
    now: float,
) -> list[OverByBill]:
    """Mark each closed period of `touched` whose spend passes its budget now; unmark one
    that no longer does. Returns the newly marked (or marked higher)."""
    found = []
    for scope, p_start in sorted(touched):
        rule = rules.get(scope)
        row = conn.execute(
            sa.select(period_spend).where(
                period_spend.c.scope == scope, period_spend.c.period_start == p_start
            )
        ).first()
        if rule is None or rule.period_budget_micro is None or row is None or row.period_end > now:
            continue
        key = (over_by_bill.c.scope == scope) & (over_by_bill.c.period_start == p_start)
        was = conn.execute(sa.select(over_by_bill.c.spent_micro).where(key)).scalar()
        conn.execute(over_by_bill.delete().where(key))
        if row.settled_micro <= rule.period_budget_micro:
            continue
        mark = OverByBill(
            scope, p_start, row.period_end, rule.period_budget_micro, row.settled_micro
        )
        conn.execute(
            over_by_bill.insert().values(
                scope=scope,
                period_start=p_start,
                period_end=row.period_end,
                budget_micro=rule.period_budget_micro,
                spent_micro=row.settled_micro,
                marked_at=now,
            )
        )
        if was is None or was < row.settled_micro:
            found.append(mark)
    return found

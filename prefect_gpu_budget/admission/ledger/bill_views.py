"""What the ledger shows of the imported bills: the drift per job and per scope, the lines no
job's bill counts (with the reason), and the closed periods over their budget by the bill."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.bill_store import line_view
from prefect_gpu_budget.admission.ledger.queries import subtree
from prefect_gpu_budget.admission.ledger.tables import (
    bill_imports,
    bill_jobs,
    bill_lines,
    jobs,
)
from prefect_gpu_budget.admission.ledger.tables import (
    over_by_bill as over_table,
)
from prefect_gpu_budget.billing.results import OverByBill

APART = ("untagged", "account", "refused", "copy")
"""The kinds of line shown apart from the jobs' bills, in the order they are shown."""


def over_by_bill(conn: Connection, scope: str | None) -> list[OverByBill]:
    """The closed periods marked over their budget by the bill (of `scope`'s subtree)."""
    query = sa.select(over_table).order_by(over_table.c.scope, over_table.c.period_start)
    if scope is not None:
        query = query.where(subtree(over_table.c.scope, scope))
    return [
        OverByBill(r.scope, r.period_start, r.period_end, r.budget_micro, r.spent_micro)
        for r in conn.execute(query)
    ]


def figure(row: Any) -> str:
    """A bill's figure in a word: final, provisional or held."""
    return "final" if row["final"] else "held" if row["held"] else "provisional"


def drift(conn: Connection, scope: str | None, period: str | None = None) -> dict[str, Any]:
    """`Bills.drift`'s answer, read in one transaction; with `period` (a billing period,
    `YYYY-MM`), only the jobs a line of that period bills (each with all its lines' bill) and
    that period's lines no job owns: a month of the bills, however many months the ledger
    holds. `imports` lists every import."""
    unowned = sa.select(bill_lines).where(bill_lines.c.kind != "job")
    billed = None
    if period is not None:
        sources = sa.select(bill_imports.c.source).distinct().scalar_subquery()
        in_period = sa.and_(bill_lines.c.source.in_(sources), bill_lines.c.billing_period == period)
        unowned = unowned.where(in_period)
        billed = sa.select(bill_lines.c.job_id).where(in_period, bill_lines.c.kind == "job")
    lines = (
        conn.execute(
            unowned.order_by(
                bill_lines.c.billing_period, bill_lines.c.usage_start, bill_lines.c.line_id
            )
        )
        .mappings()
        .all()
    )
    imports = conn.execute(sa.select(bill_imports)).mappings().all()
    per_job = [job_entry(row) for row in _billed_jobs(conn, scope, billed)]
    return {
        "jobs": per_job,
        "scopes": scope_totals(per_job),
        **{kind: [line_view(r) for r in lines if r["kind"] == kind] for kind in APART},
        "imports": [dict(r) for r in imports],
    }


def latest_period(conn: Connection) -> str | None:
    """The latest billing period any bill was imported for (None: no import yet)."""
    return conn.execute(sa.select(sa.func.max(bill_imports.c.billing_period))).scalar_one()


def _billed_jobs(conn: Connection, scope: str | None, billed: Any = None) -> Sequence[Any]:
    """The bills' jobs (in `scope`'s subtree; of the `billed` ids' select) with what the
    ledger holds of each."""
    query = (
        sa.select(
            bill_jobs.c.job_id,
            bill_jobs.c.scope,
            bill_jobs.c.billed_micro,
            bill_jobs.c.final,
            bill_jobs.c.held,
            bill_jobs.c.reason,
            jobs.c.reserved_micro,
            jobs.c.actual_micro,
            jobs.c.state,
            jobs.c.name,
        )
        .select_from(bill_jobs.join(jobs, jobs.c.id == bill_jobs.c.job_id))
        .order_by(bill_jobs.c.scope, bill_jobs.c.job_id)
    )
    if scope is not None:
        query = query.where(subtree(bill_jobs.c.scope, scope))
    if billed is not None:  # driven by the period's lines (their key), not by every bill
        ids = billed.distinct().subquery()
        query = query.join(ids, ids.c.job_id == bill_jobs.c.job_id)
    return conn.execute(query).mappings().all()


def job_entry(row: Any) -> dict[str, Any]:
    """One job's line of the drift: reserved, settled, billed, drift, its figure and why."""
    settled = row["actual_micro"] or 0
    return {
        "job_id": row["job_id"],
        "name": row["name"],
        "scope": row["scope"],
        "reserved_micro": row["reserved_micro"] or 0,
        "settled_micro": settled,
        "billed_micro": row["billed_micro"],
        "drift_micro": row["billed_micro"] - settled,
        "final": bool(row["final"]),
        "figure": figure(row),
        "reason": row["reason"] or "",
    }


def scope_totals(per_job: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per scope, the totals of its jobs' lines: settled, billed, drift, and how many
    figures are provisional and held."""
    totals: dict[str, dict[str, int]] = {}
    for entry in per_job:
        total = totals.setdefault(
            entry["scope"],
            {"settled_micro": 0, "billed_micro": 0, "drift_micro": 0, "provisional": 0, "held": 0},
        )
        for name in ("settled_micro", "billed_micro", "drift_micro"):
            total[name] += entry[name]
        total["provisional"] += entry["figure"] == "provisional"
        total["held"] += entry["figure"] == "held"
    return totals

"""`Views.status`'s read of budgeted scopes: the open jobs of their orgs, read once and put
under each scope on their path, and each current period's settled spend from its total, read
per period start; neither grows with the settled jobs the ledger holds."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger.queries import subtree
from prefect_gpu_budget.admission.ledger.rows import hold_of
from prefect_gpu_budget.admission.ledger.tables import ACTIVE, jobs, period_spend
from prefect_gpu_budget.admission.rules.policy import BudgetRule, held_in
from prefect_gpu_budget.units import org_of, scope_path

_OPEN_COLUMNS = (
    jobs.c.scope,
    jobs.c.state,
    jobs.c.rate_micro_per_hour,
    jobs.c.max_runtime_s,
    jobs.c.reserved_micro,
    jobs.c.admitted_at,
    jobs.c.started_at,
    jobs.c.reserve_seconds,
)


def open_by_scope(
    conn: sa.Connection, rules: list[BudgetRule], scope: str | None
) -> dict[str, list[Any]]:
    """The queued, admitted and running jobs of the rules' orgs (of `scope`'s subtree), under
    each scope on their path: one read, by the org's open-job index."""
    orgs = sorted({org_of(r.scope) for r in rules})
    if not orgs:
        return {}
    query = sa.select(*_OPEN_COLUMNS).where(
        jobs.c.org.in_(orgs), jobs.c.state.in_(("queued", *ACTIVE))
    )
    if scope:
        query = query.where(subtree(jobs.c.scope, scope))
    found: dict[str, list[Any]] = {}
    for row in conn.execute(query):
        for level in scope_path(row.scope):
            found.setdefault(level, []).append(row)
    return found


def settled_now(conn: sa.Connection, starts: dict[str, float]) -> dict[str, int]:
    """Each scope's settled spend in its period starting at `starts[scope]`, from the period
    totals: one read per period start (by the totals' key), not one per scope."""
    by_start: dict[float, list[str]] = {}
    for budget_scope, p_start in starts.items():
        by_start.setdefault(p_start, []).append(budget_scope)
    out: dict[str, int] = {}
    for p_start, scopes in by_start.items():
        for i in range(0, len(scopes), _IN_CHUNK):
            out.update(
                conn.execute(
                    sa.select(period_spend.c.scope, period_spend.c.settled_micro).where(
                        period_spend.c.scope.in_(scopes[i : i + _IN_CHUNK]),
                        period_spend.c.period_start == p_start,
                    )
                ).all()
            )
    return out


_IN_CHUNK = 500
"""Scopes per `IN` list (SQLite bounds a statement's parameters)."""


def scope_status(
    rule: BudgetRule,
    rows: list[Any],
    bounds: tuple[float, float],
    settled_by_scope: dict[str, int],
    now: float,
) -> dict[str, Any]:
    """`Views.status` of one budgeted scope, from its subtree's open jobs (`rows`)."""
    p_start, p_end = bounds
    reserved = sum(
        held_in(hold_of(r._mapping, rule.scope, now), now, rule, p_start)
        for r in rows
        if r.state in ACTIVE
    )
    settled = settled_by_scope.get(rule.scope, 0)
    budget = rule.period_budget_micro
    cap = rule.hourly_cap_cents
    return {
        "scope": rule.scope,
        "hourly_cap_micro": None if cap is None else cap * 10_000,
        "running_rate_micro": sum(r.rate_micro_per_hour for r in rows if r.state in ACTIVE),
        "period": rule.period,
        "period_start": p_start,
        "period_end": p_end,
        "timezone": rule.timezone,
        "period_budget_micro": budget,
        "settled_micro": settled,
        "reserved_micro": reserved,
        "remaining_micro": None if budget is None else budget - settled - reserved,
        "running": sum(1 for r in rows if r.state == "running"),
        "admitted": sum(1 for r in rows if r.state == "admitted"),
        "queued": sum(1 for r in rows if r.state == "queued"),
    }

"""What the policy sees of an org, read inside the transaction that decides it: its open jobs
as holds and a queue, the budgets on their paths, their open periods' settled spend, how far
estimates overran, and the org's pools, quotas and placed jobs where any job uses a pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.queries import (
    OPEN_JOBS,
    OPEN_PERIODS,
    load_pools,
    load_quotas,
)
from prefect_gpu_budget.admission.ledger.rows import budget_rule, hold_of, placed_of, shape_of
from prefect_gpu_budget.admission.ledger.tables import budgets
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Hold, LedgerState
from prefect_gpu_budget.admission.rules.quota import Placed
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.admission.rules.timing import STALE_WAITER_S
from prefect_gpu_budget.units import scope_path

Overrun = Callable[[Connection, str, float], dict[str, float]]
"""`overrun(conn, org, now)`: per scope, how far its settled jobs overran their estimates
(`Queue._overrun`, which caches it)."""


def load_state(
    conn: Connection,
    org: str,
    now: float,
    deciding: str,
    path: list[BudgetRule] | None = None,
    overrun: Overrun | None = None,
) -> tuple[LedgerState, list[Request]]:
    """The org's ledger state and queue, as the policy sees them, for deciding the job
    `deciding` ("": the whole queue). `path`: the budgets on that job's path, read already in
    this transaction, not read again. A queued job whose waiter has been silent for
    `STALE_WAITER_S` holds no place in the queue (it is decided again when it comes back).

    1. the org's open jobs, as holds, a queue and placed jobs; 2. the budgets on their paths;
    3. their open periods' settled spend, and the overrun figures where estimate mode asks;
    4. the org's pools and quotas, where any of its jobs uses a pool."""
    rows = conn.execute(OPEN_JOBS, {"org": org}).all()
    if not deciding and all(r.state != "queued" for r in rows):  # no queue to decide
        return LedgerState(now=now, budgets={}, holds=(), settled={}), []
    holds, queue, placed = _open_jobs(rows, now, deciding)
    rules = _budgets_on_paths(conn, rows, deciding, path)
    settled = {
        (r.scope, r.period_start): r.settled_micro
        for r in conn.execute(OPEN_PERIODS, {"scopes": list(rules), "now": now})
    }
    overran = (
        overrun(conn, org, now)
        if overrun is not None and any(r.reservation_mode == "estimate" for r in rules.values())
        else {}
    )
    state = LedgerState(now=now, budgets=rules, holds=holds, settled=settled, overrun=overran)
    if not placed and all(req.shape is None for req in queue):
        return state, queue
    org_pools = {p.name: p for p in load_pools(conn, org)}
    quotas = {(q.pool, q.team): q for q in load_quotas(conn, org)}
    return replace(state, pools=org_pools, quotas=quotas, placed=tuple(placed)), queue


def _open_jobs(
    rows: Sequence[Any], now: float, deciding: str
) -> tuple[list[Hold], list[Request], list[Placed]]:
    """The open jobs' rows as the policy sees them: admitted and running jobs' holds, the
    queue (live waiters, and the job being decided), and the jobs placed in pools."""
    holds, queue, placed = [], [], []
    for r in rows:
        shape = shape_of(r._mapping)
        if r.state == "queued":
            if r.heartbeat_at >= now - STALE_WAITER_S or r.id == deciding:
                queue.append(Request.of(r.id, r, r.requested_at, shape))
        else:
            holds.append(hold_of(r._mapping, now=now))
            if shape is not None:
                placed.append(placed_of(r._mapping, stopping=r.preempt_at is not None))
    return holds, queue, placed


def _budgets_on_paths(
    conn: Connection, rows: Sequence[Any], deciding: str, path: list[BudgetRule] | None
) -> dict[str, BudgetRule]:
    """The budgets on the open jobs' paths, by scope (`path`: those of the job being
    decided, read already)."""
    scopes = {s for scope in {r.scope for r in rows} for s in scope_path(scope)}
    rules: dict[str, BudgetRule] = {}
    if path is not None:
        rules = {rule.scope: rule for rule in path}
        scopes -= set(scope_path(next(r.scope for r in rows if r.id == deciding)))
    if scopes:
        query = sa.select(budgets).where(budgets.c.scope.in_(scopes))
        rules |= {row["scope"]: budget_rule(row) for row in conn.execute(query).mappings()}
    return rules

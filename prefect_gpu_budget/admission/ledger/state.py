"""What the policy sees of an org, read inside the transaction that decides it: its open jobs
as holds and a queue, the budgets on their paths, their open periods' settled spend, how far
estimates overran, and the org's pools, quotas and placed jobs where any job uses a pool.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.rows import (
    _OPEN_JOBS,
    _OPEN_PERIODS,
    _load_pools,
    _load_quotas,
    _rule,
    hold_of,
)
from prefect_gpu_budget.admission.ledger.tables import budgets
from prefect_gpu_budget.admission.rules.policy import BudgetRule, LedgerState
from prefect_gpu_budget.admission.rules.quota import Placed, Shape
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
    `STALE_WAITER_S` holds no place in the queue (it is decided again when it comes back)."""
    rows = conn.execute(_OPEN_JOBS, {"org": org}).all()
    if not deciding and all(r.state != "queued" for r in rows):  # no queue to decide
        return LedgerState(now=now, budgets={}, holds=(), settled={}), []
    holds, queue, placed = [], [], []
    scopes = {s for scope in {r.scope for r in rows} for s in scope_path(scope)}
    for r in rows:
        shape = (
            None
            if r.pool is None
            else Shape(r.pool, r.team, (r.node_gpus, r.node_vcpu, r.node_memory_gib), r.nodes)
        )
        if r.state == "queued":
            if r.heartbeat_at >= now - STALE_WAITER_S or r.id == deciding:
                queue.append(Request.of(r.id, r, r.requested_at, shape))
        else:
            holds.append(hold_of(r._mapping, now=now))
            if shape is not None:
                where = tuple(int(i) for i in (r.placement or "").split(",") if i)
                stopping = r.preempt_at is not None
                placed.append(Placed(r.id, shape, where, r.priority, r.admitted_at, stopping))
    rules: dict[str, BudgetRule] = {}
    if path is not None:
        rules = {rule.scope: rule for rule in path}
        scopes -= set(scope_path(next(r.scope for r in rows if r.id == deciding)))
    if scopes:
        rules |= {
            row["scope"]: _rule(row)
            for row in conn.execute(
                sa.select(budgets).where(budgets.c.scope.in_(scopes))
            ).mappings()
        }
    settled = {
        (r.scope, r.period_start): r.settled_micro
        for r in conn.execute(_OPEN_PERIODS, {"scopes": list(rules), "now": now})
    }
    overran = (
        overrun(conn, org, now)
        if overrun is not None and any(r.reservation_mode == "estimate" for r in rules.values())
        else {}
    )
    if not placed and all(req.shape is None for req in queue):
        state = LedgerState(now=now, budgets=rules, holds=holds, settled=settled, overrun=overran)
        return state, queue
    org_pools = {p.name: p for p in _load_pools(conn, org)}
    quotas = {(q.pool, q.team): q for q in _load_quotas(conn, org)}
    state = LedgerState(
        now=now,
        budgets=rules,
        holds=holds,
        settled=settled,
        pools=org_pools,
        quotas=quotas,
        placed=tuple(placed),
        overrun=overran,
    )
    return state, queue

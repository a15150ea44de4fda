"""The reads and writes several of the ledger's stores share, as functions over a connection:
a scope's subtree (`subtree`), a keyset page of jobs and its filters (`page_query`, `narrowed`),
budgets and the ones on a path, the period spend a settlement
adds to, an org's pools and team quotas, the states of jobs, a decided job's recorded
`Decision`, the statements every request runs (built once: `WAITER_AHEAD`, `OPEN_JOBS`,
`OPEN_PERIODS`), and how far a scope's jobs overran their estimates (`read_overrun`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.rows import (
    LEARNED_OUTCOMES,
    OVERRUN_SAMPLE,
    NewJob,
    budget_rule,
)
from prefect_gpu_budget.admission.ledger.tables import (
    ACTIVE,
    budgets,
    jobs,
    period_spend,
    pools,
    team_quotas,
)
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.deciding import BLOCKING_LIMITS
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Decision, overrun_factors
from prefect_gpu_budget.admission.rules.quota import TEAM_SETTINGS, Pool, TeamQuota, team_of
from prefect_gpu_budget.units import MAX_SCOPE_DEPTH, scope_path


def subtree(column: Any, scope: str) -> sa.ColumnElement[bool]:
    """`column` names `scope` or a scope under it (`acme` matches `acme` and `acme/vision`,
    not `acmex`; `_` and `%` in a scope match only themselves). A session (a scope of the
    deepest kind) has no scope under it: it matches itself alone, an equality an index on the
    column serves."""
    if scope.count("/") + 1 >= MAX_SCOPE_DEPTH:
        return column == scope
    return sa.or_(column == scope, column.startswith(scope + "/", autoescape=True))


def page_query(conn: sa.Connection, before: str | None) -> Any:
    """`select(jobs)`, of the jobs requested before job `before` (in the order `requested_at`,
    `id`: a keyset), or of all when `before` is None; None when there is no such job."""
    query = sa.select(jobs)
    if before is None:
        return query
    key = conn.execute(sa.select(jobs.c.requested_at, jobs.c.id).where(jobs.c.id == before)).first()
    if key is None:
        return None
    return query.where(
        jobs.c.requested_at <= key.requested_at,  # the bound an index on it starts from
        sa.or_(
            jobs.c.requested_at < key.requested_at,
            sa.and_(jobs.c.requested_at == key.requested_at, jobs.c.id < key.id),
        ),
    )


def narrowed(
    query: Any,
    scope: str | None,
    states: tuple[str, ...] | None,
    flow_run_id: str | None,
    since: float | None,
) -> Any:
    """`query` of jobs narrowed to a scope's subtree, states, a flow run, and the jobs not
    ended before `since`. A session's jobs are found by its scope (`ix_gpu_jobs_scope_ended`):
    its states are then compared in a form no index serves, so that neither database walks
    every org's jobs of a state (`ix_gpu_jobs_state_requested`) to find a session's few. A
    team's jobs are found by their `team` (`ix_gpu_jobs_team_requested`, in request order), not
    by walking every team's jobs for its scopes."""
    if flow_run_id is not None:
        query = query.where(jobs.c.flow_run_id == flow_run_id)
    session = bool(scope) and scope.count("/") + 1 >= MAX_SCOPE_DEPTH
    if scope and scope.count("/") == 1:
        query = query.where(jobs.c.team == scope)
    elif scope:
        query = query.where(subtree(jobs.c.scope, scope))
    if states:
        state = sa.func.coalesce(jobs.c.state, "") if session else jobs.c.state
        query = query.where(state.in_(states))
    if since is not None:
        query = query.where(sa.or_(jobs.c.ended_at.is_(None), jobs.c.ended_at >= since))
    return query


def read_budgets(conn: Connection, org: str | None = None) -> list[BudgetRule]:
    """Every budget (of `org`), by scope."""
    query = sa.select(budgets).order_by(budgets.c.scope)
    if org:
        query = query.where(budgets.c.org == org)
    return [budget_rule(row) for row in conn.execute(query).mappings()]


_PATH_RULES = sa.select(budgets).where(budgets.c.scope.in_(sa.bindparam("path", expanding=True)))
"""Built once: building a statement costs more than running it (hot-path reads do this)."""


def path_rules(conn: Connection, scope: str) -> list[BudgetRule]:
    """The budgets a job in `scope` must fit, outermost first."""
    path = scope_path(scope)
    rows = conn.execute(_PATH_RULES, {"path": path}).mappings()
    found = {row["scope"]: budget_rule(row) for row in rows}
    return [found[s] for s in path if s in found]


def add_to_periods(
    conn: Connection, shares: dict[tuple[str, float], int], rules: dict[str, BudgetRule]
) -> None:
    """Add each (budget scope, period start) share (`accounting.book`'s) to that period's
    settled spend, making its row where it has none (`rules`, by scope, give its end)."""
    for (budget_scope, p_start), share in shares.items():
        key = (period_spend.c.scope == budget_scope) & (period_spend.c.period_start == p_start)
        updated = conn.execute(
            period_spend.update()
            .where(key)
            .values(settled_micro=period_spend.c.settled_micro + share)
        )
        if updated.rowcount == 0:
            rule = rules[budget_scope]
            p_end = periods.bounds(rule.period, rule.timezone, p_start)[1]
            conn.execute(
                period_spend.insert().values(
                    scope=budget_scope, period_start=p_start, period_end=p_end, settled_micro=share
                )
            )


def load_pools(conn: Connection, org: str) -> list[Pool]:
    return [
        Pool(
            org=r.org,
            name=r.name,
            nodes=r.nodes,
            node=(r.gpus, r.vcpu, r.memory_gib),
            instance_types=tuple(t for t in r.instance_types.split(",") if t),
            gpu_model=r.gpu_model,
            kind=r.kind,
            backfill=bool(r.backfill),
        )
        for r in conn.execute(_POOLS, {"org": org})
    ]


_POOLS = sa.select(pools).where(pools.c.org == sa.bindparam("org")).order_by(pools.c.name)


def load_quotas(conn: Connection, org: str) -> list[TeamQuota]:
    return [
        TeamQuota(
            pool=r.pool,
            team=r.team,
            quota=(r.gpus, r.vcpu, r.memory_gib),
            borrow_pct=r.borrow_pct,
            lend_pct=r.lend_pct,
            weight=r.weight,
            **{k: getattr(r, k) for k in TEAM_SETTINGS if getattr(r, k) is not None},
        )
        for r in conn.execute(
            sa.select(team_quotas).where(team_quotas.c.org == org).order_by(team_quotas.c.team)
        )
    ]


def job_states(conn: Connection, job_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    if not job_ids:
        return {}
    query = sa.select(jobs.c.id, jobs.c.state, jobs.c.wait_key).where(jobs.c.id.in_(job_ids))
    return {row.id: (row.state, row.wait_key) for row in conn.execute(query)}


def recorded(conn: Connection, row: Any) -> Decision:
    """The decision already recorded for a job that is no longer queued; an admission with what
    its holder needs to take over (the capped scopes on its path, its pool and placement)."""
    return recorded_all(conn, [row])[row["id"]]


def recorded_all(conn: Connection, rows: list[Any]) -> dict[str, Decision]:
    """`recorded` of each of `rows` (jobs no longer queued), the caps read once for all."""
    paths = {row["id"]: scope_path(row["scope"]) for row in rows}
    caps = dict(
        conn.execute(
            sa.select(budgets.c.scope, budgets.c.hourly_cap_cents).where(
                budgets.c.scope.in_({s for path in paths.values() for s in path}),
                budgets.c.hourly_cap_cents.is_not(None),
            )
        ).all()
    )
    out = {}
    for row in rows:
        state = row["state"]
        if state in ACTIVE or state == "settled":
            out[row["id"]] = Decision(
                "admit",
                row["reason"],
                reserved_micro=row["reserved_micro"],
                reserve_seconds=row["reserve_seconds"],
                caps=tuple((s, caps[s]) for s in paths[row["id"]] if s in caps),
                placement=tuple(int(i) for i in (row["placement"] or "").split(",") if i),
                pool=row["pool"],
            )
        elif state == "timed_out":
            out[row["id"]] = Decision("timeout", row["reason"])
        elif state == "cancelled":  # by its owner, or its agent's revoked grant
            out[row["id"]] = Decision("reject", row["reason"] or state, limit="cancelled")
        else:
            out[row["id"]] = Decision("reject", row["reason"] or state)
    return out


WAITER_AHEAD = {
    team_is_none: sa.select(
        jobs.c.id, jobs.c.scope, jobs.c.priority, jobs.c.requested_at, jobs.c.wait_key
    )
    .where(
        jobs.c.org == sa.bindparam("org"),
        jobs.c.state == "queued",
        jobs.c.id != sa.bindparam("job_id"),
        jobs.c.pool.is_(None),
        jobs.c.team.is_(None) if team_is_none else jobs.c.team == sa.bindparam("team"),
        jobs.c.wait_key.in_(sa.bindparam("keys", expanding=True)),
        jobs.c.heartbeat_at >= sa.bindparam("alive_since"),
        sa.or_(
            jobs.c.priority > sa.bindparam("priority"),
            sa.and_(
                jobs.c.priority == sa.bindparam("priority"),
                jobs.c.requested_at <= sa.bindparam("now"),
            ),
        ),
    )
    .order_by(jobs.c.priority.desc(), jobs.c.requested_at, jobs.c.id)
    .limit(1)
    for team_is_none in (False, True)
}
"""The live waiter a new job would queue behind (`Queue._behind_a_waiter`), by whether the
job's scope has a team. Like the statements below, built once: building a statement costs more
than running it, and these run on every request."""

OPEN_JOBS = sa.select(
    jobs.c.id,
    jobs.c.scope,
    jobs.c.state,
    jobs.c.rate_micro_per_hour,
    jobs.c.rate_cents,
    jobs.c.max_runtime_s,
    jobs.c.expected_runtime_s,
    jobs.c.priority,
    jobs.c.requested_at,
    jobs.c.heartbeat_at,
    jobs.c.on_limit,
    jobs.c.max_wait_s,
    jobs.c.reserved_micro,
    jobs.c.admitted_at,
    jobs.c.started_at,
    jobs.c.reserve_seconds,
    jobs.c.nodes,
    jobs.c.pool,
    jobs.c.team,
    jobs.c.node_gpus,
    jobs.c.node_vcpu,
    jobs.c.node_memory_gib,
    jobs.c.placement,
    jobs.c.preempt_at,
).where(jobs.c.org == sa.bindparam("org"), jobs.c.state.in_(("queued", *ACTIVE)))
"""An org's queued and admitted or running jobs, as the policy sees them (`Queue._load`)."""

LONGEST_PERIOD_S = 32 * 86400.0
"""Longer than any budget period (a month, in any time zone): a period not yet over began
less than this long ago."""
OPEN_PERIODS = sa.select(period_spend).where(
    period_spend.c.scope.in_(sa.bindparam("scopes", expanding=True)),
    period_spend.c.period_start > sa.bindparam("now") - LONGEST_PERIOD_S,
    period_spend.c.period_end > sa.bindparam("now"),
)
"""The settled spend of the named scopes' periods not yet over: read by the totals' key
(scope, period start) from the last month on, not through a year of a scope's periods."""


def read_overrun(conn: Connection, org: str) -> dict[str, float]:
    """Per scope, how far its latest settled jobs ran past their expected runtime."""
    rows = conn.execute(
        sa.select(jobs.c.scope, jobs.c.billed_seconds, jobs.c.expected_runtime_s)
        .where(
            jobs.c.org == org,
            jobs.c.state == "settled",
            jobs.c.outcome.in_(LEARNED_OUTCOMES),
            jobs.c.expected_runtime_s > 0,
            jobs.c.billed_seconds > 0,
        )
        .order_by(jobs.c.settled_at.desc(), jobs.c.id)
        .limit(OVERRUN_SAMPLE)
    )
    return overrun_factors((r.scope, r.billed_seconds / r.expected_runtime_s) for r in rows)


def waiter_ahead(
    conn: Connection, org: str, job_id: str, job: NewJob, now: float, stale_s: float
) -> Any:
    """The live waiter (silent for less than `stale_s`) a new job would queue behind: one held
    by a budget on its path in its own team's queue (a budget holds only its own team's later
    jobs), ahead of it by priority, then arrival; None when there is none."""
    team = team_of(job.scope)
    path = scope_path(job.scope)
    return conn.execute(
        WAITER_AHEAD[team is None],
        {
            "org": org,
            "job_id": job_id,
            "team": team,
            "keys": [f"{limit} {scope}" for limit in BLOCKING_LIMITS for scope in path],
            "alive_since": now - stale_s,
            "priority": job.priority,
            "now": now,
        },
    ).first()


def ask_to_stop(conn: Connection, job_ids: Iterable[str], now: float, reason: str) -> int:
    """Ask the admitted or running jobs of `job_ids` not asked yet to stop (preemption); how
    many were asked."""
    return conn.execute(
        jobs.update()
        .where(jobs.c.id.in_(list(job_ids)), jobs.c.state.in_(ACTIVE), jobs.c.preempt_at.is_(None))
        .values(preempt_at=now, reason=reason)
    ).rowcount

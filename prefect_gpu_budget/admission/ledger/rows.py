"""What the ledger's rows stand for, and the reads that find them: a budget row as a
`BudgetRule`, an admitted job's row as a `Hold`, an org's pools and team quotas, the states of
jobs, a decided job's recorded `Decision`, what holds a waiting job, the statements every
request runs (built once: `_WAITER_AHEAD`, `_OPEN_JOBS`, `_OPEN_PERIODS`), and how far a
scope's jobs overran their estimates (`_overrun`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.tables import (
    ACTIVE,
    budgets,
    jobs,
    period_spend,
    pools,
    team_quotas,
)
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import (
    OVERRUN_WINDOW,
    BudgetRule,
    Decision,
    Hold,
    overrun_factors,
)
from prefect_gpu_budget.admission.rules.quota import TEAM_SETTINGS, Pool, TeamQuota
from prefect_gpu_budget.units import scope_path


@dataclass(frozen=True)
class NewJob:
    """What the gate records when a job asks to be admitted."""

    scope: str
    name: str
    instance_type: str
    provisioning: str
    nodes: int
    rate_micro_per_hour: int
    rate_cents: int
    priority: int
    max_runtime_s: float
    expected_runtime_s: float | None
    holder: str
    launcher: str = "local"
    on_limit: str | None = None
    max_wait_s: float | None = None
    flow_run_id: str | None = None
    pool: str | None = None
    """A pool the job names; None: the pool serving its instance type, if any."""
    node_gpus: int = 0
    node_vcpu: int = 0
    node_memory_gib: int = 0
    grant: str | None = None
    """An agent's grant id: the job queues only while the grant is live (see `revoke_agent`)."""
    partial: bool = False
    """The job asks for a part of each machine (`GpuJob.gpus`...): it needs a capacity pool."""
    priority_class: str | None = None
    """An org's own class the job names: `priority` is set from it when it is recorded."""


def _rule(row: Any) -> BudgetRule:
    return BudgetRule(
        scope=row["scope"],
        hourly_cap_cents=row["hourly_cap_cents"],
        period_budget_micro=row["period_budget_micro"],
        period=row["period"],
        timezone=row["timezone"],
        on_limit=row["on_limit"],
        max_wait_s=row["max_wait_s"],
        reservation_mode=row["reservation_mode"],
        notify_block=row["notify_block"],
    )


def _budgets(conn: Connection, org: str | None = None) -> list[BudgetRule]:
    """Every budget (of `org`), by scope."""
    query = sa.select(budgets).order_by(budgets.c.scope)
    if org:
        query = query.where(budgets.c.org == org)
    return [_rule(row) for row in conn.execute(query).mappings()]


_PATH_RULES = sa.select(budgets).where(budgets.c.scope.in_(sa.bindparam("path", expanding=True)))
"""Built once: building a statement costs more than running it (hot-path reads do this)."""


def _path_rules(conn: Connection, scope: str) -> list[BudgetRule]:
    """The budgets a job in `scope` must fit, outermost first."""
    path = scope_path(scope)
    rows = conn.execute(_PATH_RULES, {"path": path}).mappings()
    found = {row["scope"]: _rule(row) for row in rows}
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


def hold_of(row: Any, scope: str | None = None, now: float | None = None) -> Hold:
    """The Hold an admitted job's row stands for (`scope` where the row does not carry it).

    Given `now`, the hold is anchored where its spend can fall: at the job's start once it has
    started (a cloud job may wait hours for capacity after admission), else at `now` (nothing is
    spent before it starts) and marked unstarted (`policy.held_in` counts it whole in every
    period from now on). Without `now`, at its admission, as the decision then saw it.
    """
    start, began = row["admitted_at"], True
    if now is not None:
        started = row.get("started_at")
        began = started is not None and started <= now
        start = started if began else max(start, now)
    return Hold(
        scope or row["scope"],
        row.get("rate_cents", 0),
        row["reserved_micro"],
        start,
        start + row["reserve_seconds"],
        row["rate_micro_per_hour"],
        start + row["max_runtime_s"],
        began,
    )


def _load_pools(conn: Connection, org: str) -> list[Pool]:
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


def _load_quotas(conn: Connection, org: str) -> list[TeamQuota]:
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


def _states(conn: Connection, job_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    if not job_ids:
        return {}
    query = sa.select(jobs.c.id, jobs.c.state, jobs.c.wait_key).where(jobs.c.id.in_(job_ids))
    return {row.id: (row.state, row.wait_key) for row in conn.execute(query)}


def _recorded(conn: Connection, row: Any) -> Decision:
    """The decision already recorded for a job that is no longer queued; an admission with what
    its holder needs to take over (the capped scopes on its path, its pool and placement)."""
    return _recorded_all(conn, [row])[row["id"]]


def _recorded_all(conn: Connection, rows: list[Any]) -> dict[str, Decision]:
    """`_recorded` of each of `rows` (jobs no longer queued), the caps read once for all."""
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


SLOTS_HELD = "prefect_slots"
"""What holds an admission given back because Prefect's limit was full (`Queue.unadmit`)."""
STARTING = "starting"
"""A job's wait from its admission to its start (`wait_spans`)."""


def wait_key(decision: Decision) -> str | None:
    """What holds a waiting job, as its row's `wait_key` says: `limit scope` (None: nothing)."""
    if decision.verdict != "wait":
        return None
    return f"{decision.limit} {decision.scope}" if decision.scope else str(decision.limit)


def _wait_tally(row: Any, decision: Decision, now: float) -> dict[str, Any]:
    """The columns that say what held a queued job and for how long: the limit and scope
    holding it now (`wait_key`) since when, and seconds per limit and scope that held it before
    (`waits`, JSON). Only a change of what holds it writes anything."""
    old = row["wait_key"] if row is not None else None
    key = wait_key(decision)
    if key == old and row is not None:
        return {}
    out: dict[str, Any] = {"wait_key": key, "wait_since": now if key else None}
    if old is not None:
        waits = json.loads(row["waits"] or "{}")
        waits[old] = round(waits.get(old, 0.0) + now - (row["wait_since"] or now), 3)
        out["waits"] = json.dumps(waits)
    return out


_WAITER_AHEAD = {
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

_OPEN_JOBS = sa.select(
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

_OPEN_PERIODS = sa.select(period_spend).where(
    period_spend.c.scope.in_(sa.bindparam("scopes", expanding=True)),
    period_spend.c.period_end > sa.bindparam("now"),
)
"""The settled spend of the named scopes' periods not yet over."""


LEARNED_OUTCOMES = ("completed", "failed", "timed_out")
"""Jobs that ran their course: cancelled, preempted or reconciled ones teach nothing."""
OVERRUN_SAMPLE = 20 * OVERRUN_WINDOW
"""How many of an org's latest settled jobs estimate mode learns from."""
OVERRUN_REFRESH_S = 30.0


def _overrun(conn: Connection, org: str) -> dict[str, float]:
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

"""What an admin sets: budgets and session templates (with the period spend rebuilt when a
budget changes), capacity pools and team quotas, and an org's own priority classes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget import priorities
from prefect_gpu_budget.admission.ledger.bills import final_bill_jobs, trueup_shares
from prefect_gpu_budget.admission.ledger.engine import Db, reconnecting
from prefect_gpu_budget.admission.ledger.queries import (
    load_pools,
    load_quotas,
    path_rules,
    read_budgets,
    subtree,
)
from prefect_gpu_budget.admission.ledger.rows import budget_rule
from prefect_gpu_budget.admission.ledger.tables import (
    budgets,
    jobs,
    period_spend,
    pools,
    priority_classes,
    team_quotas,
    templates,
)
from prefect_gpu_budget.admission.rules import accounting, periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import TEAM_SETTINGS, Pool, TeamQuota
from prefect_gpu_budget.units import (
    MAX_CAP_CENTS,
    MAX_CAP_RULE,
    BudgetInputError,
    scope_path,
    validate_scope,
)


def check_rule(rule: BudgetRule) -> None:
    """A budget the Prefect edge can hold: its hourly cap fits a Prefect concurrency limit."""
    if rule.hourly_cap_cents is not None and rule.hourly_cap_cents > MAX_CAP_CENTS:
        raise BudgetInputError("hourly_cap", MAX_CAP_RULE)


def check_pool(pool: Pool, quotas: list[TeamQuota]) -> None:
    """One-line errors for a pool or quota that cannot be right."""
    from prefect_gpu_budget.units import SEGMENT_RE

    if not SEGMENT_RE.fullmatch(pool.org) or not SEGMENT_RE.fullmatch(pool.name):
        raise BudgetInputError(
            "pool", f"org and name must be 1-48 of a-z 0-9 - _, got {pool.name!r}"
        )
    if not 1 <= pool.nodes <= 100_000 or min(pool.node) < 0 or max(pool.node) > 10**7:
        raise BudgetInputError("nodes", "a pool has 1-100000 nodes of non-negative size")
    if pool.kind not in ("inventory", "quota"):
        raise BudgetInputError("kind", f"must be inventory or quota, got {pool.kind!r}")
    for q in quotas:
        if q.team.count("/") != 1 or validate_scope(q.team).split("/")[0] != pool.org:
            raise BudgetInputError("team", f"must be '{pool.org}/TEAM', got {q.team!r}")
        if min(q.quota) < 0 or not 0 <= q.borrow_pct <= 1000 or not 0 <= q.lend_pct <= 100:
            raise BudgetInputError(
                "quota", f"{q.team}: quota >= 0, borrow 0-1000%, lend 0-100% expected"
            )
        if not 0 <= q.weight <= 100:
            raise BudgetInputError("weight", f"{q.team}: must be 0-100, got {q.weight}")
        for name, allowed in TEAM_SETTINGS.items():
            if getattr(q, name) not in allowed:
                raise BudgetInputError(
                    name, f"{q.team}: must be {' or '.join(allowed)}, got {getattr(q, name)!r}"
                )


def _quota_row(pool: Pool, quota: TeamQuota, now: float) -> dict[str, Any]:
    """A team's quota in a pool as a `team_quotas` row."""
    return {
        "org": pool.org,
        "pool": pool.name,
        "team": quota.team,
        "gpus": quota.quota[0],
        "vcpu": quota.quota[1],
        "memory_gib": quota.quota[2],
        "borrow_pct": quota.borrow_pct,
        "lend_pct": quota.lend_pct,
        "weight": quota.weight,
        "updated_at": now,
        **{name: getattr(quota, name) for name in TEAM_SETTINGS},
    }


MAX_ORG_CLASSES = 10
"""An org's own priority classes, at most (HyperPod's limit; built-in ones are not counted)."""


class Config:
    """Budgets, session templates, pools and team quotas, priority classes, over the ledger's
    database; `headroom` (the queue's) ends a change that may have made room."""

    def __init__(self, db: Db, headroom: Callable[[Connection, str], None]) -> None:
        self.db, self.headroom = db, headroom

    @reconnecting
    def set_budget(self, rule: BudgetRule, now: float | None = None) -> None:
        """Create or replace a scope's budget, and rebuild its current period's settled spend."""
        now = time.time() if now is None else now
        org = rule.scope.split("/")[0]
        check_rule(rule)
        with self.db.write(org) as conn:
            _upsert_rule(conn, budgets, rule, now)
            self._rebuild_period(conn, rule, now)
            self.headroom(conn, org)

    @reconnecting
    def set_session_template(self, rule: BudgetRule, now: float | None = None) -> None:
        """Give every session under team `rule.scope` this budget when it first asks for a job
        and has none (anycloud's recommended setup for agents: a small daily budget each)."""
        if rule.scope.count("/") != 1:
            raise BudgetInputError(
                "scope", f"a session template belongs to a team 'org/team', got {rule.scope!r}"
            )
        check_rule(rule)
        now = time.time() if now is None else now
        with self.db.write(rule.scope.split("/")[0]) as conn:
            _upsert_rule(conn, templates, rule, now)

    @reconnecting
    def update_budget(
        self,
        scope: str,
        merge: Callable[[BudgetRule | None], BudgetRule],
        *,
        template: bool = False,
        now: float | None = None,
    ) -> BudgetRule:
        """Change a scope's budget (or a team's session template) field-wise and atomically.

        `merge` gets the rule as it stands (None if there is none) and returns the new one; it
        runs inside the transaction that holds the org's lock, so concurrent changes to
        different fields all survive. Whatever `merge` raises (a bad value) writes nothing.
        """
        validate_scope(scope)
        if template and scope.count("/") != 1:
            raise BudgetInputError(
                "scope", f"a session template belongs to a team 'org/team', got {scope!r}"
            )
        table = templates if template else budgets
        org = scope.split("/")[0]
        with self.db.write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            row = conn.execute(sa.select(table).where(table.c.scope == scope)).mappings().first()
            rule = merge(None if row is None else budget_rule(row))
            if rule.scope != scope:
                raise BudgetInputError("scope", f"a change to {scope!r} named {rule.scope!r}")
            check_rule(rule)
            _upsert_rule(conn, table, rule, now)
            if not template:
                self._rebuild_period(conn, rule, now)
                self.headroom(conn, org)
        return rule

    @reconnecting
    def session_templates(self) -> list[BudgetRule]:
        with self.db.read() as conn:
            return [
                budget_rule(row)
                for row in conn.execute(sa.select(templates).order_by(templates.c.scope)).mappings()
            ]

    def _rebuild_period(self, conn: Connection, rule: BudgetRule, now: float) -> None:
        p_start, p_end = periods.bounds(rule.period, rule.timezone, now)
        rows = conn.execute(
            sa.select(jobs.c.actual_micro, jobs.c.started_at, jobs.c.ended_at).where(
                subtree(jobs.c.scope, rule.scope),
                jobs.c.state == "settled",
                jobs.c.ended_at >= p_start,
                jobs.c.started_at < p_end,
            )
        )
        total = accounting.settled_in_period(
            (
                (actual or 0, *accounting.incurred_span(started, ended))
                for actual, started, ended in rows
            ),
            rule,
            p_start,
        )
        billed = trueup_shares(conn, final_bill_jobs(conn, rule.scope))  # the bill's word
        total += billed.get((rule.scope, p_start), 0)
        conn.execute(
            period_spend.delete().where(
                period_spend.c.scope == rule.scope, period_spend.c.period_start == p_start
            )
        )
        conn.execute(
            period_spend.insert().values(
                scope=rule.scope, period_start=p_start, period_end=p_end, settled_micro=total
            )
        )

    @reconnecting
    def budgets(self, org: str | None = None) -> list[BudgetRule]:
        with self.db.read() as conn:
            return read_budgets(conn, org)

    @reconnecting
    def path_budgets(self, scope: str) -> list[BudgetRule]:
        """The budgets a job in `scope` must fit, outermost first."""
        with self.db.read() as conn:
            return path_rules(conn, scope)

    @reconnecting
    def set_pool(
        self, pool: Pool, quotas: list[TeamQuota] | None = None, now: float | None = None
    ) -> None:
        """Create or replace a capacity pool; with `quotas`, replace all its team quotas."""
        check_pool(pool, quotas or [])
        now = time.time() if now is None else now
        values = {
            "nodes": pool.nodes,
            "gpus": pool.node[0],
            "vcpu": pool.node[1],
            "memory_gib": pool.node[2],
            "gpu_model": pool.gpu_model,
            "instance_types": ",".join(pool.instance_types),
            "kind": pool.kind,
            "backfill": pool.backfill,
            "updated_at": now,
        }
        with self.db.write(pool.org) as conn:
            where = sa.and_(pools.c.org == pool.org, pools.c.name == pool.name)
            if conn.execute(pools.update().where(where).values(**values)).rowcount == 0:
                conn.execute(pools.insert().values(org=pool.org, name=pool.name, **values))
            if quotas is not None:
                conn.execute(
                    team_quotas.delete().where(
                        team_quotas.c.org == pool.org, team_quotas.c.pool == pool.name
                    )
                )
                for q in quotas:
                    conn.execute(team_quotas.insert().values(**_quota_row(pool, q, now)))
            self.headroom(conn, pool.org)

    @reconnecting
    def set_team_quota(
        self,
        org: str,
        pool_name: str,
        make: Callable[[Pool, TeamQuota | None], TeamQuota],
        now: float | None = None,
        *,
        team: str,
    ) -> tuple[Pool, TeamQuota]:
        """Create or replace `team`'s quota in a pool, leaving the pool and the other teams'
        quotas as they are. `make` builds the quota from the pool and the team's quota as they
        stand (None: it has none yet), inside the transaction that holds the org's lock, so
        that what an admin leaves out keeps its value; what it raises writes nothing."""
        with self.db.write(org) as conn:
            now = time.time() if now is None else now
            found = [p for p in load_pools(conn, org) if p.name == pool_name]
            if not found:
                raise BudgetInputError("pool", f"no capacity pool {pool_name!r} in {org}")
            pool = found[0]
            current = [q for q in load_quotas(conn, org) if (q.pool, q.team) == (pool_name, team)]
            quota = make(pool, current[0] if current else None)
            if quota.team != team:
                raise BudgetInputError("team", f"a change to {team!r} named {quota.team!r}")
            check_pool(pool, [quota])
            conn.execute(
                team_quotas.delete().where(
                    team_quotas.c.org == org,
                    team_quotas.c.pool == pool_name,
                    team_quotas.c.team == quota.team,
                )
            )
            conn.execute(team_quotas.insert().values(**_quota_row(pool, quota, now)))
            self.headroom(conn, org)
        return pool, quota

    @reconnecting
    def capacity(self, org: str) -> tuple[list[Pool], list[TeamQuota]]:
        with self.db.read() as conn:
            return load_pools(conn, org), load_quotas(conn, org)

    @reconnecting
    def set_priority_class(
        self, org: str, name: str, value: int, description: str = "", now: float | None = None
    ) -> None:
        """Define (or redefine) one of `org`'s own priority classes; jobs recorded from now on
        that name it get `value` (queued and running jobs keep theirs, as in Kueue). An org
        defines at most `MAX_ORG_CLASSES` of its own, as HyperPod's task governance allows:
        one more is refused in one line, with nothing written."""
        if validate_scope(org).count("/"):
            raise BudgetInputError("org", f"priority classes belong to an org, got {org!r}")
        name, value = priorities.check_class(name, value)
        with self.db.write(org) as conn:
            others = sorted(
                conn.execute(
                    sa.select(priority_classes.c.name).where(
                        priority_classes.c.org == org, priority_classes.c.name != name
                    )
                ).scalars()
            )
            if len(others) >= MAX_ORG_CLASSES:
                raise BudgetInputError(
                    "name",
                    f"{org} has {len(others)} priority classes of its own, the most an org may "
                    f"define (as HyperPod's task governance): remove one first "
                    f"({', '.join(others)})",
                )
            conn.execute(
                priority_classes.delete().where(
                    priority_classes.c.org == org, priority_classes.c.name == name
                )
            )
            conn.execute(
                priority_classes.insert().values(
                    org=org,
                    name=name,
                    value=value,
                    description=description[:200],
                    updated_at=time.time() if now is None else now,
                )
            )

    @reconnecting
    def remove_priority_class(self, org: str, name: str) -> bool:
        """Remove one of `org`'s own classes; False if it had none of that name."""
        with self.db.write(org) as conn:
            gone = conn.execute(
                priority_classes.delete().where(
                    priority_classes.c.org == org, priority_classes.c.name == name
                )
            )
            return gone.rowcount > 0

    @reconnecting
    def priority_classes(self, org: str) -> list[dict[str, Any]]:
        """Every class a job of `org` may name, highest first: `org`'s own and the built-in
        and environment ones (`defined_by`: org, built-in or environment)."""
        with self.db.read() as conn:
            rows = conn.execute(
                sa.select(priority_classes).where(priority_classes.c.org == org)
            ).mappings()
            own = {r["name"]: (r["value"], r["description"]) for r in rows}
        builtin = priorities.PRIORITY_CLASSES
        found = [
            {
                "name": name,
                "value": value,
                "defined_by": "built-in" if builtin.get(name) == value else "environment",
                "description": "",
            }
            for name, value in priorities.priority_classes().items()
        ]
        found += [
            {"name": n, "value": v, "defined_by": org, "description": d}
            for n, (v, d) in own.items()
        ]
        return sorted(found, key=lambda c: (-c["value"], c["name"]))

    def priority_values(self, scope: str) -> dict[str, int]:
        """The value of every class a job in `scope`'s org may name."""
        return {c["name"]: c["value"] for c in self.priority_classes(scope.split("/")[0])}


_REQUEST_RULES = sa.union_all(
    sa.select(budgets, sa.literal(0).label("template")).where(
        budgets.c.scope.in_(sa.bindparam("path", expanding=True))
    ),
    sa.select(templates, sa.literal(1).label("template")).where(
        templates.c.scope == sa.bindparam("team")
    ),
)
"""The budgets on a request's path and its team's session template, in one read."""


def request_rules(conn: Connection, scope: str, now: float) -> list[BudgetRule]:
    """The budgets a request in `scope` must fit, outermost first (as `path_rules`), a session
    scope (`org/team/session`) with no budget first given its team's session template, if
    there is one, in the caller's transaction (its first request). One read: a session that
    has neither (its team's budget binds it) asks no second question at each request."""
    path = scope_path(scope)
    is_session = scope.count("/") == 2
    found: dict[str, BudgetRule] = {}
    template: Any = None
    team = scope.rsplit("/", 1)[0] if is_session else ""
    for row in conn.execute(_REQUEST_RULES, {"path": path, "team": team}).mappings():
        if row["template"]:
            template = row
        else:
            found[row["scope"]] = budget_rule(row)
    rules = [found[s] for s in path if s in found]
    if not is_session or scope in found or template is None:
        return rules
    session = replace(budget_rule(template), scope=scope)
    _upsert_rule(conn, budgets, session, now)
    return [*rules, session]


def _upsert_rule(conn: Connection, table: sa.Table, rule: BudgetRule, now: float) -> None:
    values = {
        "org": rule.scope.split("/")[0],
        "hourly_cap_cents": rule.hourly_cap_cents,
        "period_budget_micro": rule.period_budget_micro,
        "period": rule.period,
        "timezone": rule.timezone,
        "on_limit": rule.on_limit,
        "max_wait_s": rule.max_wait_s,
        "reservation_mode": rule.reservation_mode,
        "notify_block": rule.notify_block,
        "updated_at": now,
    }
    if (
        conn.execute(table.update().where(table.c.scope == rule.scope).values(**values)).rowcount
        == 0
    ):
        conn.execute(table.insert().values(scope=rule.scope, **values))


def priority_class_values(conn: Connection, org: str) -> dict[str, int]:
    rows = conn.execute(
        sa.select(priority_classes.c.name, priority_classes.c.value).where(
            priority_classes.c.org == org
        )
    )
    return {name: value for name, value in rows}

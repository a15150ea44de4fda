"""The ledger read: versions and states (what a waiter watches), jobs, per-scope status,
orphans, period spend, pools with their queues, and how long a job was held by what."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger.engine import Db, reconnecting
from prefect_gpu_budget.admission.ledger.queries import (
    job_states,
    load_pools,
    load_quotas,
    narrowed,
    page_query,
    read_budgets,
    subtree,
)
from prefect_gpu_budget.admission.ledger.rows import STARTING, placed_of
from prefect_gpu_budget.admission.ledger.scope_status import (
    open_by_scope,
    scope_status,
    settled_now,
)
from prefect_gpu_budget.admission.ledger.tables import (
    ACTIVE,
    PREEMPTED,
    STOPPED,
    agent_limits,
    budgets,
    jobs,
    period_spend,
    pools,
    priority_classes,
    team_quotas,
    templates,
    versions,
)
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.capacity import Capacity
from prefect_gpu_budget.admission.rules.quota import Pool
from prefect_gpu_budget.admission.rules.timing import STALE_AFTER_S
from prefect_gpu_budget.identity import holder_alive
from prefect_gpu_budget.units import near, org_of, scope_path


class Views:
    """The read models over the ledger's database: versions and states (what waiters watch),
    jobs, per-scope status, orphans, period spend, and each pool's use and queue."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self._scopes_that_exist: set[str] = set()
        """Levels `unknown_scope` found to exist (none is ever removed)."""

    @reconnecting
    def version(self, org: str) -> int:
        """Changes whenever headroom may have appeared in `org`: waiters poll this cheaply."""
        with self.db.read() as conn:
            return (
                conn.execute(
                    sa.select(versions.c.version).where(versions.c.org == org)
                ).scalar_one_or_none()
                or 0
            )

    @reconnecting
    def versions(self, orgs: Iterable[str]) -> dict[str, int]:
        """`version` of several orgs in one read (a watcher's poll on SQLite)."""
        with self.db.read() as conn:
            return dict(
                conn.execute(
                    sa.select(versions.c.org, versions.c.version).where(
                        versions.c.org.in_(list(orgs))
                    )
                ).all()
            )

    @reconnecting
    def states(self, job_ids: Iterable[str]) -> dict[str, tuple[str, str | None]]:
        """(state, what blocks it) of each job, in one read: how a watcher learns which of the
        jobs it waits for were decided."""
        with self.db.read() as conn:
            return job_states(conn, list(job_ids))

    @reconnecting
    def job(self, job_id: str) -> dict[str, Any]:
        with self.db.read() as conn:
            return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())

    @reconnecting
    def jobs(
        self,
        scope: str | None = None,
        states: tuple[str, ...] | None = None,
        *,
        limit: int | None = None,
        flow_run_id: str | None = None,
        before: str | None = None,
        since: float | None = None,
        named: str | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs in `scope` (and below) in request order; with `limit`, only the newest that
        many, and with `before` (a job's id, with `limit`) the newest that many requested
        before it: a keyset page, as cheap deep in the ledger as at its head; with `since`,
        only the jobs not ended before then; with `flow_run_id`, only that run's; with
        `named`, only those whose name starts so (a sweep's trials: `<sweep>/`). All chosen in
        SQL, not in memory."""
        newest = limit is not None
        with self.db.read() as conn:
            query = page_query(conn, before) if newest else sa.select(jobs)
            if query is None:  # no such job to page from
                return []
            if newest:
                query = query.order_by(jobs.c.requested_at.desc(), jobs.c.id.desc()).limit(
                    max(0, limit or 0)
                )
            elif since is not None:  # sorted, not walked in order: a window is found by its
                query = query.order_by(jobs.c.requested_at + 0)  # end (`ix_gpu_jobs_ended`)
            else:
                query = query.order_by(jobs.c.requested_at)
            query = narrowed(query, scope, states, flow_run_id, since)
            if named is not None:
                query = query.where(jobs.c.name.startswith(named, autoescape=True))
            found = [dict(row) for row in conn.execute(query).mappings()]
        return found[::-1] if newest else found

    @reconnecting
    def status(self, scope: str | None = None, now: float | None = None) -> list[dict[str, Any]]:
        """Per budgeted scope: cap, running rate (of its admitted and running jobs: both hold
        their slots), period spend (settled, reserved), and its jobs: `running` (started),
        `admitted` (not started yet: a cloud may still be finding capacity, as Slurm's
        CONFIGURING or a flex-start job's wait) and `queued`. Read in a few statements however
        many scopes and settled jobs there are: the orgs' open jobs once, and each current
        period's settled spend from its total (`gpu_period_spend`)."""
        now = time.time() if now is None else now
        with self.db.read() as conn:
            rules = [r for r in read_budgets(conn) if _within(r.scope, scope)]
            bounds = {r.scope: periods.bounds(r.period, r.timezone, now) for r in rules}
            settled = settled_now(conn, {s: b[0] for s, b in bounds.items()})
            open_rows = open_by_scope(conn, rules, scope)
        return [
            scope_status(rule, open_rows.get(rule.scope, []), bounds[rule.scope], settled, now)
            for rule in rules
        ]

    def orphans(
        self, now: float | None = None, stale_after: float = STALE_AFTER_S
    ) -> list[dict[str, Any]]:
        """Active or queued jobs whose holder is gone: dead on this host, or silent too long."""
        now = time.time() if now is None else now
        found = []
        for row in self.jobs(states=("queued", *ACTIVE)):
            alive = holder_alive(row["holder"])
            if alive is False or (alive is None and row["heartbeat_at"] < now - stale_after):
                found.append(row)
        return found

    @reconnecting
    def period_settled(self, scope: str, period_start: float) -> int:
        with self.db.read() as conn:
            return (
                conn.execute(
                    sa.select(period_spend.c.settled_micro).where(
                        period_spend.c.scope == scope, period_spend.c.period_start == period_start
                    )
                ).scalar_one_or_none()
                or 0
            )

    @reconnecting
    def capacity_status(self, org: str) -> list[dict[str, Any]]:
        """Per pool: its size, used, each team's quota / used / borrowed / lendable, and its
        queue with the reasons (for `status` and the spend report)."""
        with self.db.read() as conn:
            org_pools, quotas = load_pools(conn, org), load_quotas(conn, org)
            if not org_pools:
                return []
            rows = (
                conn.execute(
                    sa.select(jobs)
                    .where(jobs.c.org == org, jobs.c.pool.is_not(None))
                    .where(jobs.c.state.in_(("queued", *ACTIVE)))
                    .order_by(jobs.c.requested_at)
                )
                .mappings()
                .all()
            )
        placed = [placed_of(r) for r in rows if r["state"] in ACTIVE]
        cap = Capacity(
            {p.name: p for p in org_pools}, {(q.pool, q.team): q for q in quotas}, placed
        )
        return [_pool_status(org, p, cap, rows) for p in org_pools]

    @reconnecting
    def unknown_scope(self, scope: str) -> str | None:
        """Why no job may run in `scope`, in one line: a level that nobody created (its org,
        its team), with the name it may have meant (`acme/visoin` beside `acme/vision`); None
        when every one exists. An org exists once anything names it (a budget, a session
        template, a pool, a share in a pool, agent limits, a priority class, a job). A team
        (`org/team`) exists once an admin named it or a scope under it: a budget, a session
        template, a share in a pool or agent limits. A job's rows name a team only in an org
        that has none of those (where a two-level scope is a session, and accepted): in an org
        with teams a job in a team nobody created is refused, so its rows cannot let the next
        one in.

        The team is asked about also when it is the scope's last level (`acme/visoin`), in an
        org that has any team: as Kueue admits no workload whose LocalQueue does not exist. An
        org that has no team at all keeps using two-level scopes (`acme/agent-8`) as sessions
        under its own budget. The last level of a deeper scope is never asked about: a new
        session under a known team gets its team's template, or no budget of its own.

        A level found to exist is remembered by this ledger object (no budget or share is
        ever removed), so a gate reads nothing more for the jobs after the first of a team."""
        seen = self._scopes_that_exist
        path = scope_path(scope)
        levels = [level for level in path[:2] if level not in seen]
        if not levels or len(path) == 1:
            return None
        with self.db.read() as conn:
            for level in levels:
                if level == path[-1] and ("/" not in level or not _has_teams(conn, org_of(level))):
                    continue  # the last level: a new session, or a team in a teamless org
                if _created(conn, level):
                    seen.add(level)
                    continue
                if "/" in level and _named_by_jobs(conn, level) and not _has_teams(conn, path[0]):
                    continue  # an org without teams: its accepted jobs' rows name it (not kept)
                kind = "org" if "/" not in level else "team"
                peers = _created_peers(conn, level)
                close = near(level, peers)
                if close:
                    hint = f"did you mean {close[0]}?"
                else:
                    known = sorted(peers)[:5]
                    hint = f"create it first (`prefect-gpu-budget budget set {level} ...`)" + (
                        f"; known {kind}s: {', '.join(known)}" if known else ""
                    )
                names = "or job" if kind == "org" else "or agent limits"
                return (
                    f"{kind} {level} of scope {scope} does not exist (nothing names it: no "
                    f"budget, session template, pool share {names}); {hint}"
                )
        return None

    @reconnecting
    def stop_asked(self, job_id: str) -> str | None:
        """Why this admitted or running job must stop now: `preempted` (a job within its team's
        quota takes back capacity this one borrowed) or `stopped` (its owner asked:
        `ask_stop`); None while it may run on."""
        with self.db.read() as conn:
            row = conn.execute(
                sa.select(jobs.c.preempt_at, jobs.c.stop_asked_at).where(jobs.c.id == job_id)
            ).first()
        if row is None:
            return None
        if row.stop_asked_at is not None:  # its owner's word wins: not queued again
            return STOPPED
        return PREEMPTED if row.preempt_at is not None else None


def _pool_status(org: str, pool: Pool, cap: Capacity, rows: Sequence[Any]) -> dict[str, Any]:
    """`Views.capacity_status` of one pool (`rows`: the org's open jobs in its pools)."""
    return {
        "org": org,
        "pool": pool.name,
        "kind": pool.kind,
        "nodes": pool.nodes,
        "node": pool.node,
        "gpu_model": pool.gpu_model,
        "backfill": pool.backfill,
        "used": cap.pool_used(pool.name),
        "total": pool.total,
        "teams": cap.status(pool.name),
        "queue": [
            {
                "job_id": r["id"],
                "scope": r["scope"],
                "nodes": r["nodes"],
                "priority": r["priority"],
                "reason": r["reason"],
            }
            for r in rows
            if r["pool"] == pool.name and r["state"] == "queued"
        ],
    }


def wait_spans(row: dict[str, Any]) -> dict[str, float]:
    """Seconds a job was held, per limit and scope that held it (`hourly_cap acme/vision`,
    `period_budget acme`, `queue` behind an earlier job, `prefect_slots` held outside the
    ledger ...), and `starting`, from its admission to its start (its Prefect slots taken, its
    process or cloud job started, a cloud's wait for capacity); empty for a job nothing held.
    A wait a job has no row to show for is not left unnamed."""
    waits = json.loads(row.get("waits") or "{}")
    if row.get("wait_key") and row.get("wait_since"):
        end = row.get("admitted_at") or row.get("ended_at") or time.time()
        waits[row["wait_key"]] = waits.get(row["wait_key"], 0.0) + end - row["wait_since"]
    if row.get("admitted_at") and row.get("started_at"):
        waits[STARTING] = max(0.0, row["started_at"] - row["admitted_at"])
    return {key: round(seconds, 3) for key, seconds in waits.items() if round(seconds, 3)}


def _created(conn: sa.Connection, level: str) -> bool:
    """Whether anything names `level` (an org or a team) or a scope under it: one row is
    enough, read table by table (a budget, most often, answers first)."""
    org = org_of(level)
    if "/" not in level:
        named = [
            (budgets.c.scope, budgets.c.org == org),
            (templates.c.scope, templates.c.org == org),
            (team_quotas.c.team, team_quotas.c.org == org),
            (agent_limits.c.team, agent_limits.c.org == org),
            (pools.c.name, pools.c.org == org),
            (priority_classes.c.name, priority_classes.c.org == org),
            (jobs.c.id, jobs.c.org == org),
        ]
    else:  # an admin's doing only: a job never makes a team
        named = [
            (budgets.c.scope, sa.and_(budgets.c.org == org, subtree(budgets.c.scope, level))),
            (templates.c.scope, sa.and_(templates.c.org == org, subtree(templates.c.scope, level))),
            (team_quotas.c.team, sa.and_(team_quotas.c.org == org, team_quotas.c.team == level)),
            (agent_limits.c.team, agent_limits.c.team == level),
        ]
    return any(
        conn.execute(sa.select(column).where(where).limit(1)).first() for column, where in named
    )


def _named_by_jobs(conn: sa.Connection, level: str) -> bool:
    """Whether a job (ever) ran in team `level` or a scope under it."""
    where = sa.and_(jobs.c.org == org_of(level), subtree(jobs.c.scope, level))
    return conn.execute(sa.select(jobs.c.id).where(where).limit(1)).first() is not None


def _has_teams(conn: sa.Connection, org: str) -> bool:
    """Whether an admin created any team in `org` (`_created`): then a scope's second level is
    a team, and must exist even when it is the scope's last."""
    under = org + "/"
    named = [
        (budgets.c.scope, sa.and_(budgets.c.org == org, budgets.c.scope.startswith(under))),
        (templates.c.scope, templates.c.org == org),
        (team_quotas.c.team, team_quotas.c.org == org),
        (agent_limits.c.team, agent_limits.c.org == org),
    ]
    return any(
        conn.execute(sa.select(column).where(where).limit(1)).first() for column, where in named
    )


def _created_peers(conn: sa.Connection, level: str) -> set[str]:
    """The orgs (for an org) or the teams of its org (for a team) that exist: what a typo of
    `level` may have meant. Read only when `level` does not exist (a job being refused)."""
    depth = level.count("/") + 1
    if depth == 1:
        columns = [
            budgets.c.org,
            templates.c.org,
            team_quotas.c.org,
            agent_limits.c.org,
            pools.c.org,
            priority_classes.c.org,
            versions.c.org,
        ]
        return {
            name
            for column in columns
            for name in conn.execute(sa.select(column).distinct()).scalars()
        }
    org = org_of(level)
    columns = [
        (budgets.c.scope, budgets.c.org),
        (templates.c.scope, templates.c.org),
        (team_quotas.c.team, team_quotas.c.org),
        (agent_limits.c.team, agent_limits.c.org),
    ]
    names = {
        name
        for column, of in columns
        for name in conn.execute(sa.select(column).where(of == org).distinct()).scalars()
        if name
    }
    return {"/".join(n.split("/")[:depth]) for n in names if n.count("/") + 1 >= depth}


def _within(scope: str, parent: str | None) -> bool:
    return parent is None or scope == parent or scope.startswith(parent + "/")

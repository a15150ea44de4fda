"""Agents: the tokens that bind an agent to one session scope (only their hashes are kept),
their revocation, the ceilings an admin sets on a team's agents, and the refusal of an agent's
job that may not even queue."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from prefect_gpu_budget.admission.ledger.engine import Db, reconnecting
from prefect_gpu_budget.admission.ledger.tables import (
    ACTIVE,
    agent_grants,
    agent_limits,
    budgets,
    ended_unrun,
    jobs,
    templates,
)
from prefect_gpu_budget.units import AGENT_MAX_QUEUED, BudgetInputError, validate_scope

REVOKED = "its agent's grant was revoked"
"""Why a revoked session's jobs were cancelled or stopped, and why its next one is refused."""


class Grants:
    """Agent grants (tokens), their revocation, and the limits on a team's agents, over the
    ledger's database; `headroom` (the queue's) ends a revocation."""

    def __init__(self, db: Db, headroom: Callable[[Connection, str], None]) -> None:
        self.db, self.headroom = db, headroom

    @reconnecting
    def grant_agent(self, scope: str, now: float | None = None) -> str:
        """A new token that lets an agent spend in session `scope` only. Shown once: only its
        hash is stored. Refused for a session with no budget of its own and no team session
        template: an agent is never bounded by its org's budget alone."""
        if validate_scope(scope).count("/") != 2:
            raise BudgetInputError(
                "scope", f"an agent is granted one session 'org/team/session', got {scope!r}"
            )
        team = scope.rsplit("/", 1)[0]
        with self.db.read() as conn:
            bounded = (
                conn.execute(sa.select(budgets.c.scope).where(budgets.c.scope == scope)).first()
                or conn.execute(
                    sa.select(templates.c.scope).where(templates.c.scope == team)
                ).first()
            )
        if not bounded:
            raise BudgetInputError(
                "scope",
                f"{scope} has no budget and {team} no session template: set one first "
                f"(`budget set {scope} ...` or `budget set {team} --session-template ...`)",
            )
        token = "gpub_" + secrets.token_urlsafe(32)
        with self.db.tx() as conn:
            conn.execute(
                agent_grants.insert().values(
                    token_sha256=_token_hash(token),
                    scope=scope,
                    created_at=time.time() if now is None else now,
                )
            )
        return token

    @reconnecting
    def revoke_agent(self, scope: str, now: float | None = None) -> tuple[int, int, int]:
        """Revoke every token granted for `scope`, cancel the session's queued jobs and ask its
        holders to stop its admitted and running ones, in one transaction under the org's
        lock: no job of the session is admitted after it, and none of its processes is left
        once their holders have seen the ask (within a second; each is settled for what it
        ran, and its user's leftovers go with its last job). Returns (tokens revoked, queued
        jobs cancelled, running jobs stopped)."""
        org = validate_scope(scope).split("/")[0]
        with self.db.write(org) as conn:
            now = time.time() if now is None else now
            revoked = conn.execute(
                agent_grants.update()
                .where(agent_grants.c.scope == scope, agent_grants.c.revoked_at.is_(None))
                .values(revoked_at=now)
            ).rowcount
            cancelled = conn.execute(
                jobs.update()
                .where(jobs.c.scope == scope, jobs.c.state == "queued")
                .values(**ended_unrun("cancelled", REVOKED, now))
            ).rowcount
            stopped = conn.execute(
                jobs.update()
                .where(jobs.c.scope == scope, jobs.c.state.in_(ACTIVE))
                .where(jobs.c.stop_asked_at.is_(None))
                .values(stop_asked_at=now, reason=REVOKED)
            ).rowcount
            self.headroom(conn, org)
        return revoked, cancelled, stopped

    @reconnecting
    def agent_grant(self, token: str) -> tuple[str, str]:
        """(session scope, grant id) of a live token; BudgetInputError otherwise."""
        grant = _token_hash(token)
        scope = self.grant_scope(grant)
        if scope is None:
            raise BudgetInputError("agent_token", "unknown or revoked token")
        return scope, grant

    def agent_scope(self, token: str) -> str:
        """The session scope a live token was granted; BudgetInputError otherwise."""
        return self.agent_grant(token)[0]

    @reconnecting
    def grant_scope(self, grant: str) -> str | None:
        """The session of a live grant (by id); None when unknown or revoked."""
        with self.db.read() as conn:
            return _live_grant(conn, grant)

    @reconnecting
    def set_agent_limits(self, team: str, limits: dict[str, Any], now: float | None = None) -> None:
        """Store an admin's ceilings for the agents of `team`'s sessions (validated by the
        caller, `models.AgentLimits`)."""
        if validate_scope(team).count("/") != 1:
            raise BudgetInputError(
                "team", f"agent limits belong to a team 'org/team', got {team!r}"
            )
        org = team.split("/")[0]
        with self.db.write(org) as conn:
            conn.execute(agent_limits.delete().where(agent_limits.c.team == team))
            conn.execute(
                agent_limits.insert().values(
                    team=team,
                    org=org,
                    limits=json.dumps(limits, sort_keys=True),
                    updated_at=time.time() if now is None else now,
                )
            )

    @reconnecting
    def agent_limits(self, team: str) -> dict[str, Any] | None:
        """The ceilings an admin set for `team`'s agents; None: the defaults apply."""
        with self.db.read() as conn:
            return _limits_of(conn, team)


def grant_refusal(conn: Connection, scope: str, grant: str) -> str:
    """Why an agent's job in `scope` may not even queue: its grant is gone, or its session
    already has as many queued jobs as its team's agents may ("" when it may)."""
    if _live_grant(conn, grant) != scope:
        return REVOKED
    limits = _limits_of(conn, scope.rsplit("/", 1)[0]) or {}
    most = int(limits.get("max_queued", AGENT_MAX_QUEUED))
    queued = conn.execute(
        sa.select(sa.func.count())
        .select_from(jobs)
        .where(jobs.c.scope == scope, jobs.c.state == "queued")
    ).scalar_one()
    if queued >= most:
        return f"{scope} has {queued} queued jobs, the most its agents may have queued"
    return ""


def _token_hash(token: object) -> str:
    return hashlib.sha256(str(token).encode("utf-8", "replace")).hexdigest()


def _live_grant(conn: Connection, grant: str) -> str | None:
    row = conn.execute(
        sa.select(agent_grants.c.scope).where(
            agent_grants.c.token_sha256 == grant, agent_grants.c.revoked_at.is_(None)
        )
    ).first()
    return None if row is None else row.scope


def _limits_of(conn: Connection, team: str) -> dict[str, Any] | None:
    text = conn.execute(
        sa.select(agent_limits.c.limits).where(agent_limits.c.team == team)
    ).scalar_one_or_none()
    return None if text is None else json.loads(text)

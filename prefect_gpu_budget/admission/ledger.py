"""The one place that remembers: the spend ledger in SQL (SQLite by default, PostgreSQL shared).

Every admission is a row in `jobs` from request to settlement. Admission and settlement run in a
transaction serialised per org (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: a transaction-scoped
advisory lock on the org), so any number of processes on any number of machines see one order.
Settled spend is also summed per (scope, period) in `period_spend`, so a decision reads a few
rows however long the ledger grows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from prefect_gpu_budget import priorities
from prefect_gpu_budget.admission import accounting, periods
from prefect_gpu_budget.admission.policy import (
    NOT_REACHED,
    OVERRUN_WINDOW,
    BudgetRule,
    Decision,
    Hold,
    LedgerState,
    Request,
    committed,
    decide,
    overrun_factors,
    plan,
    share_in,
)
from prefect_gpu_budget.admission.quota import (
    Capacity,
    Placed,
    Pool,
    Shape,
    TeamQuota,
    job_share,
    pool_for,
    team_of,
)
from prefect_gpu_budget.admission.timing import STALE_AFTER_S, STALE_WAITER_S
from prefect_gpu_budget.identity import holder_alive as holder_alive
from prefect_gpu_budget.identity import holder_id as holder_id
from prefect_gpu_budget.identity import process_start_ticks as process_start_ticks
from prefect_gpu_budget.units import (
    AGENT_MAX_QUEUED,
    MAX_CAP_CENTS,
    MAX_CAP_RULE,
    BudgetInputError,
    scope_path,
    validate_scope,
)

P = ParamSpec("P")
T = TypeVar("T")
ACTIVE = ("admitted", "running")
FINAL = ("settled", "rejected", "timed_out", "cancelled")

metadata = sa.MetaData()


def _budget_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        metadata,
        sa.Column("scope", sa.String(160), primary_key=True),
        sa.Column("org", sa.String(48), nullable=False, index=True),
        sa.Column("hourly_cap_cents", sa.BigInteger),
        sa.Column("period_budget_micro", sa.BigInteger),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("on_limit", sa.String(8), nullable=False),
        sa.Column("max_wait_s", sa.Float, nullable=False),
        sa.Column("reservation_mode", sa.String(12), nullable=False),
        sa.Column("notify_block", sa.String(200)),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


budgets = _budget_table("gpu_budgets")
templates = _budget_table("gpu_session_templates")
"""Keyed by a team scope: the budget each of its sessions gets when it first asks for a job."""

jobs = sa.Table(
    "gpu_jobs",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("org", sa.String(48), nullable=False),
    sa.Column("scope", sa.String(160), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("instance_type", sa.String(120), nullable=False),
    sa.Column("provisioning", sa.String(16), nullable=False),
    sa.Column("nodes", sa.Integer, nullable=False),
    sa.Column("rate_micro_per_hour", sa.BigInteger, nullable=False),
    sa.Column("rate_cents", sa.BigInteger, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("max_runtime_s", sa.Float, nullable=False),
    sa.Column("expected_runtime_s", sa.Float),
    sa.Column("on_limit", sa.String(8)),
    sa.Column("max_wait_s", sa.Float),
    sa.Column("state", sa.String(12), nullable=False),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("reserved_micro", sa.BigInteger, nullable=False, default=0),
    sa.Column("reserve_seconds", sa.Float, nullable=False, default=0.0),
    sa.Column("actual_micro", sa.BigInteger),
    sa.Column("billed_seconds", sa.Float),
    sa.Column("outcome", sa.String(16)),
    sa.Column("requested_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),
    sa.Column("admitted_at", sa.Float),
    sa.Column("started_at", sa.Float),
    sa.Column("ended_at", sa.Float),
    sa.Column("settled_at", sa.Float),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("launcher", sa.String(200), nullable=False, default="local"),
    sa.Column("external_id", sa.String(200)),
    sa.Column("lease_id", sa.String(64)),
    sa.Column("flow_run_id", sa.String(36)),
    sa.Column("pool", sa.String(48)),
    sa.Column("team", sa.String(100)),
    sa.Column("node_gpus", sa.Integer),
    sa.Column("node_vcpu", sa.Integer),
    sa.Column("node_memory_gib", sa.Integer),
    sa.Column("placement", sa.String(400)),
    sa.Column("preempt_at", sa.Float),
    sa.Column("wait_key", sa.String(200)),
    sa.Column("wait_since", sa.Float),
    sa.Column("waits", sa.Text),
    sa.Index("ix_gpu_jobs_org_state", "org", "state"),
    sa.Index("ix_gpu_jobs_org_settled", "org", "state", "settled_at"),
    sa.Index("ix_gpu_jobs_scope_ended", "scope", "ended_at"),
    sa.Index("ix_gpu_jobs_requested", "requested_at"),
    sa.Index("ix_gpu_jobs_flow_run", "flow_run_id"),
)

period_spend = sa.Table(
    "gpu_period_spend",
    metadata,
    sa.Column("scope", sa.String(160), primary_key=True),
    sa.Column("period_start", sa.Float, primary_key=True),
    sa.Column("period_end", sa.Float, nullable=False),
    sa.Column("settled_micro", sa.BigInteger, nullable=False),
)

pools = sa.Table(
    "gpu_pools",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("name", sa.String(48), primary_key=True),
    sa.Column("nodes", sa.Integer, nullable=False),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("vcpu", sa.Integer, nullable=False),
    sa.Column("memory_gib", sa.Integer, nullable=False),
    sa.Column("gpu_model", sa.String(64), nullable=False, default=""),
    sa.Column("instance_types", sa.Text, nullable=False, default=""),
    sa.Column("kind", sa.String(12), nullable=False, default="inventory"),
    sa.Column("backfill", sa.Boolean, nullable=False, default=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
"""What can run at once in an org: machines of one shape, or a cloud quota."""

team_quotas = sa.Table(
    "gpu_team_quotas",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("pool", sa.String(48), primary_key=True),
    sa.Column("team", sa.String(100), primary_key=True),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("vcpu", sa.Integer, nullable=False),
    sa.Column("memory_gib", sa.Integer, nullable=False),
    sa.Column("borrow_pct", sa.Integer, nullable=False),
    sa.Column("lend_pct", sa.Integer, nullable=False),
    sa.Column("weight", sa.Integer, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

agent_grants = sa.Table(
    "gpu_agent_grants",
    metadata,
    sa.Column("token_sha256", sa.String(64), primary_key=True),
    sa.Column("scope", sa.String(160), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
)
"""An agent's token (only its hash is kept) binds it to one session scope. The hash is the
grant's id: what an agent's sweep carries instead of the token."""

agent_limits = sa.Table(
    "gpu_agent_limits",
    metadata,
    sa.Column("team", sa.String(120), primary_key=True),
    sa.Column("org", sa.String(48), nullable=False),
    sa.Column("limits", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
"""Keyed by a team scope, like the session template: an admin's ceilings (JSON, validated by
`models.AgentLimits`) on what the agents of the team's sessions may ask for."""

priority_classes = sa.Table(
    "gpu_priority_classes",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("value", sa.Integer, nullable=False),
    sa.Column("description", sa.String(200), nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
"""An org's own priority classes, as Kueue's WorkloadPriorityClass objects: a job naming one
gets its value when it is recorded (see `priorities`)."""

versions = sa.Table(
    "gpu_versions",
    metadata,
    sa.Column("org", sa.String(48), primary_key=True),
    sa.Column("version", sa.BigInteger, nullable=False),
)


schema = sa.Table("gpu_schema", metadata, sa.Column("digest", sa.String(64), primary_key=True))
"""The digests of the schemas this ledger has been brought up to."""
SCHEMA = hashlib.sha256(
    repr(
        sorted(
            (
                t.name,
                sorted((c.name, str(c.type)) for c in t.columns),
                sorted(i.name for i in t.indexes),
            )
            for t in metadata.sorted_tables
        )
    ).encode()
).hexdigest()
"""This version's schema, as a digest: its tables, columns and indexes."""


def default_url() -> str:
    from prefect_gpu_budget.settings import default_ledger_url

    return default_ledger_url()


_open: dict[str, Ledger] = {}
_opening = threading.Lock()


def open_ledger(url: str) -> Ledger:
    """The one open ledger of this process for `url` (its engine pools the connections of every
    job in the process), built once even when many threads ask for it at the same moment."""
    with _opening:
        if url not in _open:
            _open[url] = Ledger(url)
        return _open[url]


def normalise_url(url: str) -> str:
    """Plain `postgresql://` URLs use the psycopg (v3) driver that this package installs.

    A user name or password with an unencoded `@` (or `/`, `:`) is percent-encoded: the
    credentials run to the LAST `@`, never into the host name (where a connection error would
    show the password's tail)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    scheme, sep, rest = url.partition("://")
    if sep and rest.count("@") > 1:
        from urllib.parse import quote

        userinfo, _, location = rest.rpartition("@")
        user, colon, password = userinfo.partition(":")
        safe = "!$&'()*+,;=%-._~"  # keep what needs no encoding, and escapes already made
        userinfo = quote(user, safe=safe) + colon + quote(password, safe=safe)
        url = f"{scheme}://{userinfo}@{location}"
    return url


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
    }


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


def check_rule(rule: BudgetRule) -> None:
    """A budget the Prefect edge can hold: its hourly cap fits a Prefect concurrency limit."""
    if rule.hourly_cap_cents is not None and rule.hourly_cap_cents > MAX_CAP_CENTS:
        raise BudgetInputError("hourly_cap", MAX_CAP_RULE)


def _token_hash(token: object) -> str:
    return hashlib.sha256(str(token).encode("utf-8", "replace")).hexdigest()


def _org_lock_key(org: str) -> int:
    return int.from_bytes(hashlib.blake2b(org.encode(), digest_size=8).digest(), "big", signed=True)


NOTICE_CHANNEL = "gpu_budget_decided"
"""The PostgreSQL channel on which a transaction that decided queued jobs names them."""
_NOTICE_BYTES = 7900  # PostgreSQL's limit on a payload is 8000 bytes


def notice_payloads(org: str, job_ids: Iterable[str]) -> list[str]:
    """`org|id,id,...` notices naming the jobs decided, each under PostgreSQL's payload limit
    (one notice, naming none, when the org changed but no job's decision did)."""
    out, ids = [], list(job_ids)
    while True:
        chunk: list[str] = []
        while ids and len(org) + sum(len(i) + 1 for i in chunk) + len(ids[0]) < _NOTICE_BYTES:
            chunk.append(ids.pop(0))
        out.append(f"{org}|{','.join(chunk)}")
        if not ids:
            return out


def read_notice(payload: str) -> tuple[str, list[str]]:
    """The org and the job ids of a notice (`notice_payloads`)."""
    org, _, ids = payload.partition("|")
    return org, [i for i in ids.split(",") if i]


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


def _reconnecting(method: Callable[P, T]) -> Callable[P, T]:
    """Run a ledger call once more if the database dropped its pooled connection (a restart).

    Every call is one transaction that either committed or rolled back; settling is
    idempotent, and a request is retried under the same job id, so it is recorded once.
    """

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(*args, **kwargs)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            return method(*args, **kwargs)

    return wrapper


class Ledger:
    """Durable admission records. Safe to share between threads and processes."""

    def __init__(self, url: str | None = None, *, create: bool = True) -> None:
        self.url = normalise_url(url or default_url())
        self.engine = _make_engine(self.url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._overrun_cache: dict[str, tuple[float, dict[str, float]]] = {}
        if create:
            self.create()

    def create(self) -> None:
        """Make the tables, and the columns an earlier version lacked, unless the ledger says it
        has this version's schema already (one query instead of an inspection per table: the
        CLI opens the ledger on every command)."""
        if self._schema_is_current():
            return
        for attempt in range(5):
            try:
                metadata.create_all(self.engine)
                self._add_new_columns()
                with self.engine.begin() as conn:
                    if not conn.execute(schema.select().where(schema.c.digest == SCHEMA)).first():
                        conn.execute(schema.insert().values(digest=SCHEMA))
                return
            except sa.exc.DBAPIError:  # another process created the same table at once
                if attempt == 4:
                    raise
                time.sleep(0.1 * (attempt + 1))

    def _schema_is_current(self) -> bool:
        try:
            with self.engine.connect() as conn:
                return bool(conn.execute(schema.select().where(schema.c.digest == SCHEMA)).first())
        except sa.exc.DBAPIError:  # no such table yet: a new ledger, or an older one
            return False

    def _add_new_columns(self) -> None:
        """A ledger made by an earlier version lacks the newer (nullable) columns and indexes."""
        have = {c["name"] for c in sa.inspect(self.engine).get_columns(jobs.name)}
        for column in jobs.columns:
            if column.name not in have:
                kind = column.type.compile(self.engine.dialect)
                with self.engine.begin() as conn:
                    conn.exec_driver_sql(f"ALTER TABLE {jobs.name} ADD COLUMN {column.name} {kind}")
        for index in jobs.indexes:
            index.create(self.engine, checkfirst=True)

    def _overrun(self, conn: Connection, org: str, now: float) -> dict[str, float]:
        """Per scope, how far its settled jobs overran their estimates; read at most every
        OVERRUN_REFRESH_S per org and process (it changes slowly, and the read is not free)."""
        cached = self._overrun_cache.get(org)
        if cached is None or not 0 <= now - cached[0] < OVERRUN_REFRESH_S:
            cached = (now, _overrun(conn, org))
            self._overrun_cache[org] = cached
        return cached[1]

    def dispose(self) -> None:
        self.engine.dispose()

    # -- transactions -------------------------------------------------------------------

    @contextmanager
    def _write(self, org: str) -> Iterator[Connection]:
        with self.engine.connect() as conn, conn.begin():
            if not self.is_sqlite:
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _org_lock_key(org)})
            yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(gpu_budget_read=True) as conn, conn.begin():
            yield conn

    def _bump(
        self, conn: Connection, org: str, decided: Iterable[str] = (), *, decide: bool = True
    ) -> None:
        """Headroom may have appeared in `org` (a job settled, left the queue, a budget or a pool
        changed): decide its queue once, admitting every job that now fits whichever process
        holds it, bump the org's version and notify (PostgreSQL) the jobs decided, `decided`
        included, all in the caller's transaction. Their holders' watchers wake only them."""
        decided = [*decided, *(self._decide_queue(conn, org, time.time()) if decide else ())]
        updated = conn.execute(
            versions.update().where(versions.c.org == org).values(version=versions.c.version + 1)
        )
        if updated.rowcount == 0:
            conn.execute(versions.insert().values(org=org, version=1))
        if not self.is_sqlite:
            for payload in notice_payloads(org, decided):
                conn.execute(
                    sa.text("SELECT pg_notify(:channel, :payload)"),
                    {"channel": NOTICE_CHANNEL, "payload": payload},
                )

    def _decide_queue(self, conn: Connection, org: str, now: float) -> list[str]:
        """Decide every queued job of `org` the policy reaches this round (`plan`) and write what
        it says; the ids whose state or whatever holds them changed. Jobs it does not reach
        (behind a job that holds what they need) are left as they are."""
        state, queue = self._load(conn, org, now, "")
        if not queue:
            return []
        reached = {k: d for k, d in plan(state, queue).items() if d is not NOT_REACHED}
        if not reached:
            return []
        rows = {
            row["id"]: row
            for row in conn.execute(
                sa.select(
                    jobs.c.id, jobs.c.reason, jobs.c.wait_key, jobs.c.wait_since, jobs.c.waits
                ).where(jobs.c.id.in_(list(reached)))
            ).mappings()
        }
        decided = []
        for job_id, decision in reached.items():
            changed, _ = self._write_decision(
                conn, job_id, decision, now, rows[job_id], holder=False
            )
            if changed:
                decided.append(job_id)
        return decided

    @_reconnecting
    def version(self, org: str) -> int:
        """Changes whenever headroom may have appeared in `org`: waiters poll this cheaply."""
        with self._read() as conn:
            return (
                conn.execute(
                    sa.select(versions.c.version).where(versions.c.org == org)
                ).scalar_one_or_none()
                or 0
            )

    @_reconnecting
    def versions(self, orgs: Iterable[str]) -> dict[str, int]:
        """`version` of several orgs in one read (a watcher's poll on SQLite)."""
        with self._read() as conn:
            return dict(
                conn.execute(
                    sa.select(versions.c.org, versions.c.version).where(
                        versions.c.org.in_(list(orgs))
                    )
                ).all()
            )

    @_reconnecting
    def states(self, job_ids: Iterable[str]) -> dict[str, tuple[str, str | None]]:
        """(state, what holds it) of each job, in one read: how a watcher learns which of the
        jobs it waits for were decided."""
        with self._read() as conn:
            return _states(conn, list(job_ids))

    @_reconnecting
    def recheck(
        self, org: str, waiting: Iterable[str], now: float | None = None
    ) -> dict[str, tuple[str, str | None]]:
        """A watcher's safety pass over `org`, in one transaction: stamp the rows of the jobs it
        waits for (`waiting`: they keep their place), decide the org's queue (time alone can
        make room: a period rolls over, a waiter elsewhere went silent), and return `states`.
        It catches what a lost notice would have said."""
        waiting = list(waiting)
        with self._write(org) as conn:
            now = time.time() if now is None else now
            if waiting:
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id.in_(waiting), jobs.c.state == "queued")
                    .values(heartbeat_at=now)
                )
            decided = self._decide_queue(conn, org, now)
            if decided:
                self._bump(conn, org, decided, decide=False)
            return _states(conn, waiting)

    # -- budgets ------------------------------------------------------------------------

    @_reconnecting
    def set_budget(self, rule: BudgetRule, now: float | None = None) -> None:
        """Create or replace a scope's budget, and rebuild its current period's settled spend."""
        now = time.time() if now is None else now
        org = rule.scope.split("/")[0]
        check_rule(rule)
        with self._write(org) as conn:
            _upsert_rule(conn, budgets, rule, now)
            self._rebuild_period(conn, rule, now)
            self._bump(conn, org)

    @_reconnecting
    def set_session_template(self, rule: BudgetRule, now: float | None = None) -> None:
        """Give every session under team `rule.scope` this budget when it first asks for a job
        and has none (anycloud's recommended setup for agents: a small daily budget each)."""
        if rule.scope.count("/") != 1:
            raise BudgetInputError(
                "scope", f"a session template belongs to a team 'org/team', got {rule.scope!r}"
            )
        check_rule(rule)
        now = time.time() if now is None else now
        with self._write(rule.scope.split("/")[0]) as conn:
            _upsert_rule(conn, templates, rule, now)

    @_reconnecting
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
        with self._write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            row = conn.execute(sa.select(table).where(table.c.scope == scope)).mappings().first()
            rule = merge(None if row is None else _rule(row))
            if rule.scope != scope:
                raise BudgetInputError("scope", f"a change to {scope!r} named {rule.scope!r}")
            check_rule(rule)
            _upsert_rule(conn, table, rule, now)
            if not template:
                self._rebuild_period(conn, rule, now)
                self._bump(conn, org)
        return rule

    @_reconnecting
    def session_templates(self) -> list[BudgetRule]:
        with self._read() as conn:
            return [
                _rule(row)
                for row in conn.execute(sa.select(templates).order_by(templates.c.scope)).mappings()
            ]

    def _ensure_session_budget(self, conn: Connection, scope: str, now: float) -> None:
        if scope.count("/") != 2:
            return
        if conn.execute(sa.select(budgets.c.scope).where(budgets.c.scope == scope)).first():
            return
        team = scope.rsplit("/", 1)[0]
        row = conn.execute(sa.select(templates).where(templates.c.scope == team)).mappings().first()
        if row is not None:
            _upsert_rule(conn, budgets, replace(_rule(row), scope=scope), now)

    def _rebuild_period(self, conn: Connection, rule: BudgetRule, now: float) -> None:
        p_start, p_end = periods.bounds(rule.period, rule.timezone, now)
        rows = conn.execute(
            sa.select(jobs.c.actual_micro, jobs.c.started_at, jobs.c.ended_at).where(
                sa.or_(
                    jobs.c.scope == rule.scope,
                    jobs.c.scope.startswith(rule.scope + "/", autoescape=True),
                ),
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

    @_reconnecting
    def budgets(self, org: str | None = None) -> list[BudgetRule]:
        query = sa.select(budgets).order_by(budgets.c.scope)
        if org:
            query = query.where(budgets.c.org == org)
        with self._read() as conn:
            return [_rule(row) for row in conn.execute(query).mappings()]

    @_reconnecting
    def path_budgets(self, scope: str) -> list[BudgetRule]:
        """The budgets a job in `scope` must fit, outermost first."""
        path = scope_path(scope)
        with self._read() as conn:
            rows = conn.execute(sa.select(budgets).where(budgets.c.scope.in_(path))).mappings()
            found = {row["scope"]: _rule(row) for row in rows}
        return [found[s] for s in path if s in found]

    def request(
        self, job: NewJob, now: float | None = None, job_id: str | None = None
    ) -> tuple[str, Decision]:
        """Record a job asking to be admitted and decide it at once, in one transaction.

        A session scope with no budget first gets its team's session template, if any.
        Asking again with the same `job_id` (after an outage) records the job once.
        """
        job_id = job_id or str(uuid.uuid4())  # fixed before any retry: recorded once
        return job_id, self._request(job_id, job, now)

    @_reconnecting
    def _request(self, job_id: str, job: NewJob, now: float | None) -> Decision:
        org = job.scope.split("/")[0]
        with self._write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            done = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().first()
            if done is not None:  # committed before the connection dropped
                return _recorded(conn, done)
            self._ensure_session_budget(conn, job.scope, now)
            if job.priority_class is not None:
                value = priorities.resolve(job.priority_class, _classes_of(conn, org), org)
                job = replace(job, priority=value)
            refusal = self._grant_refusal(conn, job) if job.grant is not None else ""
            conn.execute(
                jobs.insert().values(
                    id=job_id,
                    org=org,
                    state="queued",
                    reason="",
                    requested_at=now,
                    heartbeat_at=now,
                    reserved_micro=0,
                    reserve_seconds=0.0,
                    team=team_of(job.scope),
                    **{
                        k: v
                        for k, v in self._in_pool(conn, org, job).__dict__.items()
                        if k not in ("grant", "partial", "priority_class")
                    },
                )
            )
            if refusal:  # on record like any refusal, and nothing reserved
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id == job_id)
                    .values(**_ended_unrun("rejected", refusal, now))
                )
                return Decision("reject", refusal, limit="agent")
            return self._decide(conn, job_id, org, now, reason="", waited=None)

    def _in_pool(self, conn: Connection, org: str, job: NewJob) -> NewJob:
        """The job with the pool it runs in (named, or serving its instance type) and its
        per-node shape (`job_share`: vCPU and memory left at 0 take the pool's proportional
        default; a job that names no GPUs, vCPU or memory takes a whole machine)."""
        found = pool_for(_load_pools(conn, org), job.instance_type, job.pool)
        if job.pool is not None and found is None:
            raise BudgetInputError("pool", f"no capacity pool {job.pool!r} in {org}")
        if found is None and job.partial:
            raise BudgetInputError(
                "gpus",
                f"a part of a machine runs only in a capacity pool, and no pool of {org} "
                f"serves {job.instance_type}",
            )
        if found is None:
            return replace(job, pool=None)
        vcpu, memory = job.node_vcpu or None, job.node_memory_gib or None
        res = job_share(found, job.node_gpus, vcpu, memory)
        return replace(
            job, pool=found.name, node_gpus=res[0], node_vcpu=res[1], node_memory_gib=res[2]
        )

    @_reconnecting
    def try_admit(self, job_id: str, scope: str, now: float | None = None) -> Decision:
        """Decide a queued job against everything else in its org, in one transaction.

        Writes what the decision says: the admission and its reservation, a rejection or a
        time-out, or the reason it still waits (so `status` can say why).
        """
        org = scope.split("/")[0]
        with self._write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one()
            if row["state"] == "admitted":  # by another's transaction: its holder takes over
                conn.execute(jobs.update().where(jobs.c.id == job_id).values(heartbeat_at=now))
            if row["state"] != "queued":
                return _recorded(conn, row)
            return self._decide(conn, job_id, org, now, reason=row["reason"], waited=row)

    def _decide(
        self, conn: Connection, job_id: str, org: str, now: float, reason: str, waited: Any
    ) -> Decision:
        """Run the policy for a queued job and write what it says, heartbeat included, and what
        held it for how long (`waited`: the job's row as it stood, None for a new job)."""
        state, queue = self._load(conn, org, now, job_id)
        decision = decide(state, queue, job_id)
        _, asked = self._write_decision(conn, job_id, decision, now, waited, reason=reason)
        if decision.verdict != "wait" or asked:
            self._bump(conn, org)
        return decision

    def _write_decision(
        self,
        conn: Connection,
        job_id: str,
        decision: Decision,
        now: float,
        waited: Any,
        reason: str | None = None,
        *,
        holder: bool = True,
    ) -> tuple[bool, bool]:
        """Write a queued job's decision (`waited`: its row as it stood, None for a new job).
        Returns whether its state or what holds it changed, and whether it asked borrowed jobs
        to stop. Only its `holder` deciding stamps a waiting job's row: a job decided by
        another's transaction must not look alive when its holder is gone (an admission stamps
        it: the holder has `LIMIT_RETRY_S` from then to take its slots)."""
        reason = waited["reason"] if reason is None else reason
        tally = _wait_tally(waited, decision, now)
        values: dict[str, Any] = dict(tally)
        if holder or decision.verdict != "wait":
            values["heartbeat_at"] = now
        if decision.verdict == "admit":
            values.update(
                state="admitted",
                admitted_at=now,
                reserved_micro=decision.reserved_micro,
                reserve_seconds=decision.reserve_seconds,
                reason=decision.reason,
                placement=",".join(map(str, decision.placement)),
            )
        elif decision.verdict in ("reject", "timeout"):
            ended = "rejected" if decision.verdict == "reject" else "timed_out"
            values.update(_ended_unrun(ended, decision.reason, now))
        elif decision.reason != reason:
            values["reason"] = decision.reason
        if values:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))
        asked = 0
        if decision.preempt:  # borrowed work gives lent capacity back: its holders stop it
            asked = conn.execute(
                jobs.update()
                .where(
                    jobs.c.id.in_(decision.preempt),
                    jobs.c.state.in_(ACTIVE),
                    jobs.c.preempt_at.is_(None),
                )
                .values(preempt_at=now, reason=f"preempted for job {job_id[:8]}")
            ).rowcount
        return decision.verdict != "wait" or bool(tally), bool(asked)

    def _load(
        self, conn: Connection, org: str, now: float, deciding: str
    ) -> tuple[LedgerState, list[Request]]:
        rows = conn.execute(
            sa.select(
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
            ).where(jobs.c.org == org, jobs.c.state.in_(("queued", *ACTIVE)))
        ).all()
        holds, queue, scopes, placed = [], [], set(), []
        for r in rows:
            scopes.update(scope_path(r.scope))
            shape = (
                None
                if r.pool is None
                else Shape(r.pool, r.team, (r.node_gpus, r.node_vcpu, r.node_memory_gib), r.nodes)
            )
            if r.state == "queued":
                if r.heartbeat_at >= now - STALE_WAITER_S or r.id == deciding:
                    queue.append(
                        Request(
                            job_id=r.id,
                            scope=r.scope,
                            rate_micro_per_hour=r.rate_micro_per_hour,
                            rate_cents=r.rate_cents,
                            max_runtime_s=r.max_runtime_s,
                            expected_runtime_s=r.expected_runtime_s,
                            priority=r.priority,
                            requested_at=r.requested_at,
                            on_limit=r.on_limit,
                            max_wait_s=r.max_wait_s,
                            shape=shape,
                        )
                    )
            else:
                holds.append(hold_of(r._mapping, now=now))
                if shape is not None:
                    where = tuple(int(i) for i in (r.placement or "").split(",") if i)
                    placed.append(Placed(r.id, shape, where, r.priority, r.admitted_at))
        rules = {
            row["scope"]: _rule(row)
            for row in conn.execute(
                sa.select(budgets).where(budgets.c.scope.in_(scopes))
            ).mappings()
        }
        settled = {
            (r.scope, r.period_start): r.settled_micro
            for r in conn.execute(
                sa.select(period_spend).where(
                    period_spend.c.scope.in_(list(rules)), period_spend.c.period_end > now
                )
            )
        }
        overrun = (
            self._overrun(conn, org, now)
            if any(r.reservation_mode == "estimate" for r in rules.values())
            else {}
        )
        if not placed and all(req.shape is None for req in queue):
            state = LedgerState(
                now=now, budgets=rules, holds=holds, settled=settled, overrun=overrun
            )
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
            overrun=overrun,
        )
        return state, queue

    @_reconnecting
    def unadmit(
        self,
        job_id: str,
        scope: str,
        reason: str,
        now: float | None = None,
        *,
        end: str | None = None,
    ) -> bool:
        """Put an admitted job that could not start back in the queue (keeping its place), or,
        with `end` (`rejected`, `timed_out`), end it unrun. One transaction either way: the
        queue decision it makes could otherwise admit the job again before it ends."""
        now = time.time() if now is None else now
        org = scope.split("/")[0]
        back = {"state": "queued", "reason": reason, "heartbeat_at": now}
        with self._write(org) as conn:
            done = conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id, jobs.c.state == "admitted")
                .values(
                    admitted_at=None,
                    reserved_micro=0,
                    reserve_seconds=0.0,
                    **(back if end is None else _ended_unrun(end, reason, now)),
                )
            ).rowcount
            self._bump(conn, org)
        return bool(done)

    @_reconnecting
    def cancel_queued(
        self,
        job_id: str,
        scope: str,
        reason: str,
        now: float | None = None,
        state: str = "cancelled",
    ) -> bool:
        """End a queued job: `cancelled`, or `timed_out` when its max wait ran out."""
        now = time.time() if now is None else now
        org = scope.split("/")[0]
        with self._write(org) as conn:
            done = conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id, jobs.c.state == "queued")
                .values(**_ended_unrun(state, reason, now))
            ).rowcount
            self._bump(conn, org)
        return bool(done)

    # -- capacity -----------------------------------------------------------------------

    @_reconnecting
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
        with self._write(pool.org) as conn:
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
            self._bump(conn, pool.org)

    @_reconnecting
    def set_team_quota(
        self,
        org: str,
        pool_name: str,
        make: Callable[[Pool], TeamQuota],
        now: float | None = None,
    ) -> tuple[Pool, TeamQuota]:
        """Create or replace one team's quota in a pool, leaving the pool and the other teams'
        quotas as they are. `make` builds the quota from the pool as it stands, inside the
        transaction that holds the org's lock; what it raises writes nothing."""
        with self._write(org) as conn:
            now = time.time() if now is None else now
            found = [p for p in _load_pools(conn, org) if p.name == pool_name]
            if not found:
                raise BudgetInputError("pool", f"no capacity pool {pool_name!r} in {org}")
            pool = found[0]
            quota = make(pool)
            check_pool(pool, [quota])
            conn.execute(
                team_quotas.delete().where(
                    team_quotas.c.org == org,
                    team_quotas.c.pool == pool_name,
                    team_quotas.c.team == quota.team,
                )
            )
            conn.execute(team_quotas.insert().values(**_quota_row(pool, quota, now)))
            self._bump(conn, org)
        return pool, quota

    @_reconnecting
    def capacity(self, org: str) -> tuple[list[Pool], list[TeamQuota]]:
        with self._read() as conn:
            return _load_pools(conn, org), _load_quotas(conn, org)

    @_reconnecting
    def capacity_status(self, org: str) -> list[dict[str, Any]]:
        """Per pool: its size, used, each team's quota / used / borrowed / lendable, and its
        queue with the reasons (for `status` and the spend report)."""
        with self._read() as conn:
            org_pools, quotas = _load_pools(conn, org), _load_quotas(conn, org)
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
        placed = [
            Placed(
                r["id"],
                Shape(
                    r["pool"],
                    r["team"],
                    (r["node_gpus"], r["node_vcpu"], r["node_memory_gib"]),
                    r["nodes"],
                ),
                tuple(int(i) for i in (r["placement"] or "").split(",") if i),
                r["priority"],
                r["admitted_at"],
            )
            for r in rows
            if r["state"] in ACTIVE
        ]
        cap = Capacity(
            {p.name: p for p in org_pools}, {(q.pool, q.team): q for q in quotas}, placed
        )
        return [
            {
                "org": org,
                "pool": p.name,
                "kind": p.kind,
                "nodes": p.nodes,
                "node": p.node,
                "gpu_model": p.gpu_model,
                "backfill": p.backfill,
                "used": cap.pool_used(p.name),
                "total": p.total,
                "teams": cap.status(p.name),
                "queue": [
                    {
                        "job_id": r["id"],
                        "scope": r["scope"],
                        "nodes": r["nodes"],
                        "priority": r["priority"],
                        "reason": r["reason"],
                    }
                    for r in rows
                    if r["pool"] == p.name and r["state"] == "queued"
                ],
            }
            for p in org_pools
        ]

    @_reconnecting
    def preempt_requested(self, job_id: str) -> bool:
        """Whether a higher-priority job asked this (borrowed) one to give its capacity back."""
        with self._read() as conn:
            return (
                conn.execute(
                    sa.select(jobs.c.preempt_at).where(jobs.c.id == job_id)
                ).scalar_one_or_none()
                is not None
            )

    # -- agents ---------------------------------------------------------------------------

    @_reconnecting
    def grant_agent(self, scope: str, now: float | None = None) -> str:
        """A new token that lets an agent spend in session `scope` only. Shown once: only its
        hash is stored. Refused for a session with no budget of its own and no team session
        template: an agent is never bounded by its org's budget alone."""
        if validate_scope(scope).count("/") != 2:
            raise BudgetInputError(
                "scope", f"an agent is granted one session 'org/team/session', got {scope!r}"
            )
        team = scope.rsplit("/", 1)[0]
        with self._read() as conn:
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
        with self.engine.begin() as conn:
            conn.execute(
                agent_grants.insert().values(
                    token_sha256=_token_hash(token),
                    scope=scope,
                    created_at=time.time() if now is None else now,
                )
            )
        return token

    @_reconnecting
    def revoke_agent(self, scope: str, now: float | None = None) -> tuple[int, int]:
        """Revoke every token granted for `scope` and cancel the session's queued jobs, in one
        transaction under the org's lock: no job of the session is admitted after it (its
        running jobs go on). Returns (tokens revoked, queued jobs cancelled)."""
        org = validate_scope(scope).split("/")[0]
        with self._write(org) as conn:
            now = time.time() if now is None else now
            revoked = conn.execute(
                agent_grants.update()
                .where(agent_grants.c.scope == scope, agent_grants.c.revoked_at.is_(None))
                .values(revoked_at=now)
            ).rowcount
            cancelled = conn.execute(
                jobs.update()
                .where(jobs.c.scope == scope, jobs.c.state == "queued")
                .values(**_ended_unrun("cancelled", "its agent's grant was revoked", now))
            ).rowcount
            self._bump(conn, org)
        return revoked, cancelled

    @_reconnecting
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

    @_reconnecting
    def grant_scope(self, grant: str) -> str | None:
        """The session of a live grant (by id); None when unknown or revoked."""
        with self._read() as conn:
            return _live_grant(conn, grant)

    @_reconnecting
    def set_agent_limits(self, team: str, limits: dict[str, Any], now: float | None = None) -> None:
        """Store an admin's ceilings for the agents of `team`'s sessions (validated by the
        caller, `models.AgentLimits`)."""
        if validate_scope(team).count("/") != 1:
            raise BudgetInputError(
                "team", f"agent limits belong to a team 'org/team', got {team!r}"
            )
        org = team.split("/")[0]
        with self._write(org) as conn:
            conn.execute(agent_limits.delete().where(agent_limits.c.team == team))
            conn.execute(
                agent_limits.insert().values(
                    team=team,
                    org=org,
                    limits=json.dumps(limits, sort_keys=True),
                    updated_at=time.time() if now is None else now,
                )
            )

    @_reconnecting
    def agent_limits(self, team: str) -> dict[str, Any] | None:
        """The ceilings an admin set for `team`'s agents; None: the defaults apply."""
        with self._read() as conn:
            return _limits_of(conn, team)

    @_reconnecting
    def set_priority_class(
        self, org: str, name: str, value: int, description: str = "", now: float | None = None
    ) -> None:
        """Define (or redefine) one of `org`'s own priority classes; jobs recorded from now on
        that name it get `value` (queued and running jobs keep theirs, as in Kueue)."""
        if validate_scope(org).count("/"):
            raise BudgetInputError("org", f"priority classes belong to an org, got {org!r}")
        name, value = priorities.check_class(name, value)
        with self._write(org) as conn:
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

    @_reconnecting
    def remove_priority_class(self, org: str, name: str) -> bool:
        """Remove one of `org`'s own classes; False if it had none of that name."""
        with self._write(org) as conn:
            gone = conn.execute(
                priority_classes.delete().where(
                    priority_classes.c.org == org, priority_classes.c.name == name
                )
            )
            return gone.rowcount > 0

    @_reconnecting
    def priority_classes(self, org: str) -> list[dict[str, Any]]:
        """Every class a job of `org` may name, highest first: `org`'s own and the built-in
        and environment ones (`defined_by`: org, built-in or environment)."""
        with self._read() as conn:
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

    def _grant_refusal(self, conn: Connection, job: NewJob) -> str:
        """Why an agent's job may not even queue: its grant is gone, or its session already
        has as many queued jobs as its team's agents may."""
        if _live_grant(conn, job.grant or "") != job.scope:
            return "its agent's grant was revoked"
        limits = _limits_of(conn, job.scope.rsplit("/", 1)[0]) or {}
        most = int(limits.get("max_queued", AGENT_MAX_QUEUED))
        queued = conn.execute(
            sa.select(sa.func.count())
            .select_from(jobs)
            .where(jobs.c.scope == job.scope, jobs.c.state == "queued")
        ).scalar_one()
        if queued >= most:
            return f"{job.scope} has {queued} queued jobs, the most its agents may have queued"
        return ""

    # -- running and settlement -----------------------------------------------------------

    @_reconnecting
    def mark_started(self, job_id: str, started_at: float, external_id: str | None = None) -> bool:
        """The launcher started the job (`external_id`: pid and start ticks, or a cloud job id).

        False if the job is no longer admitted (reconcile settled it): it must not run.
        """
        with self.engine.begin() as conn:
            return bool(
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id == job_id, jobs.c.state == "admitted")
                    .values(
                        state="running",
                        started_at=started_at,
                        heartbeat_at=started_at,
                        external_id=external_id,
                    )
                ).rowcount
            )

    @_reconnecting
    def record_submission(self, job_id: str, external_id: str) -> None:
        """A cloud accepted the admitted job (it may wait for capacity before it starts)."""
        with self.engine.begin() as conn:
            conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id, jobs.c.state == "admitted")
                .values(external_id=external_id)
            )

    @_reconnecting
    def record_lease(self, job_id: str, lease_id: str) -> bool:
        """Remember the Prefect lease an admission holds, so reconcile can hand it back; False
        (nothing written) when the job is no longer admitted or running: its holder must then
        release the lease itself, as nobody else will."""
        with self.engine.begin() as conn:
            return (
                conn.execute(
                    jobs.update()
                    .where(jobs.c.id == job_id, jobs.c.state.in_(ACTIVE))
                    .values(lease_id=lease_id)
                ).rowcount
                == 1
            )

    @_reconnecting
    def heartbeat(self, job_id: str, now: float | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                jobs.update()
                .where(jobs.c.id == job_id)
                .values(heartbeat_at=time.time() if now is None else now)
            )

    @_reconnecting
    def settle(
        self,
        job_id: str,
        *,
        ended_at: float,
        outcome: str,
        billed_seconds: float | None = None,
        actual_micro: int | None = None,
        scope: str | None = None,
        now: float | None = None,
    ) -> dict[str, Any] | None:
        """Replace a job's reservation with its actual cost, exactly once.

        Returns the settled row, or None if the job was settled already (settling twice
        charges once). `actual_micro` is the cloud's billed figure where known; otherwise
        rate x billed seconds (by default the time from start to end).
        """
        if scope is None:
            with self._read() as probe:
                scope = probe.execute(
                    sa.select(jobs.c.scope).where(jobs.c.id == job_id)
                ).scalar_one()
        org = scope.split("/")[0]
        with self._write(org) as conn:
            now = time.time() if now is None else now  # after the lock: stamps follow its order
            job = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one()
            if job["state"] not in ACTIVE:
                return None
            billed, actual = accounting.settled_cost(
                job["rate_micro_per_hour"],
                job["started_at"],
                ended_at,
                billed_seconds=billed_seconds,
                actual_micro=actual_micro,
            )
            values = {
                "state": "settled",
                "ended_at": ended_at,
                "settled_at": now,
                "billed_seconds": billed,
                "actual_micro": actual,
                "outcome": outcome,
            }
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))
            start, end = accounting.incurred_span(job["started_at"], ended_at)
            self._add_spend(conn, job["scope"], actual, start, end)
            self._bump(conn, org)
        return {**job, **values}

    def _add_spend(
        self, conn: Connection, scope: str, actual: int, start: float, end: float
    ) -> None:
        rules = conn.execute(
            sa.select(budgets).where(
                budgets.c.scope.in_(scope_path(scope)), budgets.c.period_budget_micro.is_not(None)
            )
        ).mappings()
        by_scope = {rule.scope: rule for rule in map(_rule, rules)}
        for (budget_scope, p_start), share in accounting.book(
            scope, actual, start, end, by_scope
        ).items():
            key = (period_spend.c.scope == budget_scope) & (period_spend.c.period_start == p_start)
            updated = conn.execute(
                period_spend.update()
                .where(key)
                .values(settled_micro=period_spend.c.settled_micro + share)
            )
            if updated.rowcount == 0:
                rule = by_scope[budget_scope]
                p_end = periods.bounds(rule.period, rule.timezone, p_start)[1]
                conn.execute(
                    period_spend.insert().values(
                        scope=budget_scope,
                        period_start=p_start,
                        period_end=p_end,
                        settled_micro=share,
                    )
                )

    # -- reading ----------------------------------------------------------------------------

    @_reconnecting
    def job(self, job_id: str) -> dict[str, Any]:
        with self._read() as conn:
            return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())

    @_reconnecting
    def jobs(
        self,
        scope: str | None = None,
        states: tuple[str, ...] | None = None,
        *,
        limit: int | None = None,
        flow_run_id: str | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs in `scope` (and below) in request order; with `limit`, only the newest that
        many, and with `flow_run_id`, only that run's (both chosen in SQL, not in memory)."""
        query = sa.select(jobs).order_by(jobs.c.requested_at)
        if limit is not None:
            query = (
                sa.select(jobs)
                .order_by(jobs.c.requested_at.desc(), jobs.c.id.desc())
                .limit(max(0, limit))
            )
        if flow_run_id is not None:
            query = query.where(jobs.c.flow_run_id == flow_run_id)
        if scope:
            query = query.where(
                sa.or_(jobs.c.scope == scope, jobs.c.scope.startswith(scope + "/", autoescape=True))
            )
        if states:
            query = query.where(jobs.c.state.in_(states))
        with self._read() as conn:
            found = [dict(row) for row in conn.execute(query).mappings()]
        return found[::-1] if limit is not None else found

    @_reconnecting
    def status(self, scope: str | None = None, now: float | None = None) -> list[dict[str, Any]]:
        """Per budgeted scope: cap, running rate, period spend (settled, reserved), queue."""
        now = time.time() if now is None else now
        rules = [r for r in self.budgets() if _within(r.scope, scope)]
        out = []
        with self._read() as conn:
            for rule in rules:
                subtree = sa.or_(
                    jobs.c.scope == rule.scope,
                    jobs.c.scope.startswith(rule.scope + "/", autoescape=True),
                )
                rows = conn.execute(
                    sa.select(
                        jobs.c.state,
                        jobs.c.rate_micro_per_hour,
                        jobs.c.max_runtime_s,
                        jobs.c.reserved_micro,
                        jobs.c.admitted_at,
                        jobs.c.started_at,
                        jobs.c.reserve_seconds,
                    ).where(subtree, jobs.c.state.in_(("queued", *ACTIVE)))
                ).all()
                p_start, p_end = periods.bounds(rule.period, rule.timezone, now)
                reserved = sum(
                    share_in(*committed(hold_of(r._mapping, rule.scope, now), now), rule, p_start)
                    for r in rows
                    if r.state in ACTIVE
                )
                settled = (
                    conn.execute(
                        sa.select(period_spend.c.settled_micro).where(
                            period_spend.c.scope == rule.scope,
                            period_spend.c.period_start == p_start,
                        )
                    ).scalar_one_or_none()
                    or 0
                )
                budget = rule.period_budget_micro
                out.append(
                    {
                        "scope": rule.scope,
                        "hourly_cap_micro": None
                        if rule.hourly_cap_cents is None
                        else rule.hourly_cap_cents * 10_000,
                        "running_rate_micro": sum(
                            r.rate_micro_per_hour for r in rows if r.state in ACTIVE
                        ),
                        "period": rule.period,
                        "period_start": p_start,
                        "period_end": p_end,
                        "timezone": rule.timezone,
                        "period_budget_micro": budget,
                        "settled_micro": settled,
                        "reserved_micro": reserved,
                        "remaining_micro": None if budget is None else budget - settled - reserved,
                        "running": sum(1 for r in rows if r.state in ACTIVE),
                        "queued": sum(1 for r in rows if r.state == "queued"),
                    }
                )
        return out

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

    @_reconnecting
    def period_settled(self, scope: str, period_start: float) -> int:
        with self._read() as conn:
            return (
                conn.execute(
                    sa.select(period_spend.c.settled_micro).where(
                        period_spend.c.scope == scope, period_spend.c.period_start == period_start
                    )
                ).scalar_one_or_none()
                or 0
            )


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
        for r in conn.execute(sa.select(pools).where(pools.c.org == org).order_by(pools.c.name))
    ]


def _load_quotas(conn: Connection, org: str) -> list[TeamQuota]:
    return [
        TeamQuota(
            pool=r.pool,
            team=r.team,
            quota=(r.gpus, r.vcpu, r.memory_gib),
            borrow_pct=r.borrow_pct,
            lend_pct=r.lend_pct,
            weight=r.weight,
        )
        for r in conn.execute(
            sa.select(team_quotas).where(team_quotas.c.org == org).order_by(team_quotas.c.team)
        )
    ]


def hold_of(row: Any, scope: str | None = None, now: float | None = None) -> Hold:
    """The Hold an admitted job's row stands for (`scope` where the row does not carry it).

    Given `now`, the hold is anchored where its spend can fall: at the job's start once it has
    started (a cloud job may wait hours for capacity after admission), else at `now` (nothing is
    spent before it starts). Without `now`, at its admission, as the decision then saw it.
    """
    start = row["admitted_at"]
    if now is not None:
        started = row.get("started_at")
        start = started if started is not None and started <= now else max(start, now)
    return Hold(
        scope or row["scope"],
        row.get("rate_cents", 0),
        row["reserved_micro"],
        start,
        start + row["reserve_seconds"],
        row["rate_micro_per_hour"],
        start + row["max_runtime_s"],
    )


def _ended_unrun(state: str, reason: str, now: float) -> dict[str, Any]:
    """The columns of a job that ends without running (rejected, timed out, cancelled): settled
    at once, at no cost."""
    return {"state": state, "ended_at": now, "settled_at": now, "actual_micro": 0, "reason": reason}


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


def wait_spans(row: dict[str, Any]) -> dict[str, float]:
    """Seconds a job was held, per limit and scope that held it (`hourly_cap acme/vision`,
    `period_budget acme`, `queue` behind an earlier job, ...); empty for a job nothing held."""
    waits = json.loads(row.get("waits") or "{}")
    if row.get("wait_key") and row.get("wait_since"):
        end = row.get("admitted_at") or row.get("ended_at") or time.time()
        waits[row["wait_key"]] = waits.get(row["wait_key"], 0.0) + end - row["wait_since"]
    return {key: round(seconds, 3) for key, seconds in waits.items()}


def _states(conn: Connection, job_ids: list[str]) -> dict[str, tuple[str, str | None]]:
    if not job_ids:
        return {}
    query = sa.select(jobs.c.id, jobs.c.state, jobs.c.wait_key).where(jobs.c.id.in_(job_ids))
    return {row.id: (row.state, row.wait_key) for row in conn.execute(query)}


def _live_grant(conn: Connection, grant: str) -> str | None:
    row = conn.execute(
        sa.select(agent_grants.c.scope).where(
            agent_grants.c.token_sha256 == grant, agent_grants.c.revoked_at.is_(None)
        )
    ).first()
    return None if row is None else row.scope


def _classes_of(conn: Connection, org: str) -> dict[str, int]:
    rows = conn.execute(
        sa.select(priority_classes.c.name, priority_classes.c.value).where(
            priority_classes.c.org == org
        )
    )
    return {name: value for name, value in rows}


def _limits_of(conn: Connection, team: str) -> dict[str, Any] | None:
    text = conn.execute(
        sa.select(agent_limits.c.limits).where(agent_limits.c.team == team)
    ).scalar_one_or_none()
    return None if text is None else json.loads(text)


def _within(scope: str, parent: str | None) -> bool:
    return parent is None or scope == parent or scope.startswith(parent + "/")


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


def _recorded(conn: Connection, row: Any) -> Decision:
    """The decision already recorded for a job that is no longer queued; an admission with what
    its holder needs to take over (the capped scopes on its path, its pool and placement)."""
    state = row["state"]
    if state in ACTIVE or state == "settled":
        path = scope_path(row["scope"])
        caps = dict(
            conn.execute(
                sa.select(budgets.c.scope, budgets.c.hourly_cap_cents).where(
                    budgets.c.scope.in_(path), budgets.c.hourly_cap_cents.is_not(None)
                )
            ).all()
        )
        return Decision(
            "admit",
            row["reason"],
            reserved_micro=row["reserved_micro"],
            reserve_seconds=row["reserve_seconds"],
            caps=tuple((s, caps[s]) for s in path if s in caps),
            placement=tuple(int(i) for i in (row["placement"] or "").split(",") if i),
            pool=row["pool"],
        )
    if state == "timed_out":
        return Decision("timeout", row["reason"])
    return Decision("reject", row["reason"] or state)


class LedgerFileReplaced(RuntimeError):
    """The SQLite ledger file this process opened was replaced or removed: writing on would
    split the ledger in two (this process on the old inode, new processes on a new file)."""


class _FileIdentity:
    """The (st_dev, st_ino) of a SQLite ledger file, taken on first connect and checked at
    every transaction's begin (one `stat`, about a microsecond)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: tuple[int, int] | None = None

    def before_first_connect(self) -> None:
        """A missing file whose write-ahead log is still there was removed under a live
        process: opening it would fail later with a bare `disk I/O error`."""
        if self.seen is None and not os.path.exists(self.path):
            left = [s for s in ("-wal", "-shm") if os.path.exists(self.path + s)]
            if left:
                raise LedgerFileReplaced(
                    f"the ledger file {self.path} was removed while a process had it open "
                    f"({self.path}{left[0]} remains); stop the processes using it, then restore "
                    "the file or remove its -wal and -shm files"
                )

    def check(self) -> None:
        try:
            st = os.stat(self.path)
            now = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        if self.seen is None and now is not None:
            self.seen = now
        elif now != self.seen:
            raise LedgerFileReplaced(
                f"the ledger file {self.path} was replaced or removed while this process used "
                "it; refusing to admit against a copy no other process sees (restart this "
                "process once the ledger file is back in place)"
            )


def _create_private(path: str) -> None:
    """Create a new SQLite ledger file readable by its owner only (SQLite gives its -wal and
    -shm files the same mode), so other users (agents' jobs) cannot read the rows of other
    sessions. An existing file keeps its mode."""
    with suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        identity = None
        if path and path != ":memory:" and not path.startswith("file:"):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            identity = _FileIdentity(os.path.abspath(path))
            identity.before_first_connect()
            _create_private(path)
        engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=60000")
            cursor.close()
            if identity is not None:
                identity.check()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            if identity is not None:
                identity.check()
            read = conn.get_execution_options().get("gpu_budget_read")
            conn.exec_driver_sql("BEGIN DEFERRED" if read else "BEGIN IMMEDIATE")

        return engine
    # No pre-ping (a round trip per checkout on the hot path): a connection the server dropped
    # fails its first statement, the pool is invalidated, and `_reconnecting` runs the call again.
    # One connection kept per process, a few more only while that many threads write at once
    # (then closed): a process whose jobs only wait holds this one and its watcher's.
    return sa.create_engine(
        url,
        pool_size=1,
        max_overflow=3,
        pool_timeout=120,
        connect_args={"application_name": "prefect-gpu-budget"},
    )

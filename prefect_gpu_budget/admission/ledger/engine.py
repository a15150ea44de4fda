"""How the ledger reaches its database: URLs, the engine, and the one transaction per call.

Writes run in a transaction serialised per org (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: a
transaction-scoped advisory lock on the org), so any number of processes on any number of
machines see one order. A write that may have made headroom ends in `Queue.headroom`: the
org's queue is decided, its version bumped and (PostgreSQL) the jobs decided are named on
NOTICE_CHANNEL (`Db.bump`).
A SQLite ledger file is watched for being replaced under a live process (`_FileIdentity`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from prefect_gpu_budget.admission.ledger.tables import SCHEMA, jobs, metadata, schema, versions
from prefect_gpu_budget.admission.rules.quota import team_of

P = ParamSpec("P")
T = TypeVar("T")


def default_url() -> str:
    from prefect_gpu_budget.settings import default_ledger_url

    return default_ledger_url()


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


def reconnecting(method: Callable[P, T]) -> Callable[P, T]:
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


def _org_lock_key(org: str) -> int:
    return int.from_bytes(hashlib.blake2b(org.encode(), digest_size=8).digest(), "big", signed=True)


NOTICE_CHANNEL = "gpu_budget_decided"
"""The PostgreSQL channel on which a transaction that decided queued jobs names them."""
_NOTICE_BYTES = 7900  # PostgreSQL's limit on a payload is 8000 bytes


def notice_payloads(org: str, job_ids: Iterable[str]) -> list[str]:
    """`org|id,id,...` notices naming the jobs decided, each under PostgreSQL's payload limit;
    none when no job's decision changed. (Every listening backend of the database runs a
    transaction to read each notice, whatever its channel: a notice that wakes nobody costs
    one transaction per listening process.)"""
    out, ids = [], list(job_ids)
    while ids:
        chunk: list[str] = []
        while ids and len(org) + sum(len(i) + 1 for i in chunk) + len(ids[0]) < _NOTICE_BYTES:
            chunk.append(ids.pop(0))
        out.append(f"{org}|{','.join(chunk)}")
    return out


def read_notice(payload: str) -> tuple[str, list[str]]:
    """The org and the job ids of a notice (`notice_payloads`)."""
    org, _, ids = payload.partition("|")
    return org, [i for i in ids.split(",") if i]


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
    # fails its first statement, the pool is invalidated, and `reconnecting` runs the call again.
    # One connection per process, which its threads take in turn (a call is one short
    # transaction, and no thread holds two: `Db.connection`): a process holds it and
    # its watcher's, however many of its jobs wait; and none is opened and closed under load (a
    # new backend costs PostgreSQL two transactions of its own).
    return sa.create_engine(
        url,
        pool_size=1,
        max_overflow=0,
        pool_timeout=120,
        connect_args={"application_name": "prefect-gpu-budget"},
    )


_ORG_LOCKS_GUARD = threading.Lock()


class OrgLock:
    """The writes of one org in one process, one at a time and first come, first served, except
    that a new request (`request=True`) lets every other write waiting go first: a settlement
    frees headroom, and must not wait behind a burst of a thousand requests (Python's own locks
    hand over in no order). Each waiter sleeps on an event of its own, set by the write before
    it: a hand-over wakes one thread, not every waiter. A write inside a write of the same
    thread is refused, not hung."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._writes: deque[threading.Event] = deque()
        self._requests: deque[threading.Event] = deque()
        self._owner: int | None = None

    @contextmanager
    def held(self, request: bool = False) -> Iterator[None]:
        turn = threading.Event()
        with self._mutex:
            if self._owner == threading.get_ident():
                raise RuntimeError("a ledger transaction inside another on the same thread")
            if self._owner is None and not self._writes and not self._requests:
                self._owner = threading.get_ident()
                turn.set()
            else:
                (self._requests if request else self._writes).append(turn)
        try:
            turn.wait()
        except BaseException:  # interrupted in line: leave it, or pass a turn just handed on
            with self._mutex:
                for line in (self._writes, self._requests):
                    if turn in line:
                        line.remove(turn)
                        raise
            self._hand_on()
            raise
        with self._mutex:
            self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        with self._mutex:
            line = self._writes or self._requests
            if not line:
                self._owner = None
                return
            self._owner = -1  # the next one's: it names itself once woken
            line.popleft().set()


class Db:
    """The ledger's database: its engine, its transactions and its schema brought up to date.
    The stores (`Queue`, `Settlements`, `Config`, `Grants`, `Views`) run their transactions on
    it: `write` (under the org's lock), `tx` (one row of its own) and `read`. A write that may
    have made headroom ends in the queue's `headroom`, which decides the org's queue and then
    `bump`s its version."""

    def __init__(self, url: str | None = None) -> None:
        self.url = normalise_url(url or default_url())
        self.engine = _make_engine(self.url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._org_locks: dict[str, OrgLock] = {}
        self._held = threading.local()
        """`conn`: whether this thread holds a pooled connection (`connection`)."""

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
                self._fill_teams()
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
        """A ledger made by an earlier version lacks the newer (nullable) columns and indexes,
        in any of its tables."""
        inspector = sa.inspect(self.engine)
        for table in metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name not in have:
                    kind = column.type.compile(self.engine.dialect)
                    with self.engine.begin() as conn:
                        conn.exec_driver_sql(
                            f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"
                        )
            for index in table.indexes:
                index.create(self.engine, checkfirst=True)

    def _fill_teams(self) -> None:
        """Jobs recorded before `gpu_jobs.team` was filled get their team (`org/team` of their
        scope), so a team's jobs are found by it (`ix_gpu_jobs_team_requested`). Run with the
        schema's upgrade, once: a current ledger has no such row."""
        with self.engine.begin() as conn:
            scopes = conn.execute(
                sa.select(jobs.c.scope)
                .where(jobs.c.team.is_(None), jobs.c.scope.contains("/", autoescape=True))
                .distinct()
            ).scalars()
            filled = [{"s": scope, "t": team_of(scope)} for scope in scopes]
            if filled:
                conn.execute(
                    jobs.update()
                    .where(jobs.c.scope == sa.bindparam("s"), jobs.c.team.is_(None))
                    .values(team=sa.bindparam("t")),
                    filled,
                )

    def dispose(self) -> None:
        self.engine.dispose()

    @contextmanager
    def write(self, org: str, request: bool = False) -> Iterator[Connection]:
        """A transaction under the org's lock. The org's writes are serialised anyway (the
        advisory lock, SQLite's one writer): the threads of this process queue for it here, in
        turn (`OrgLock`; a `request` after the other writes waiting), instead of each holding a
        pooled connection while the database makes it wait."""
        with self._org_lock(org).held(request), self.connection() as conn, conn.begin():
            if not self.is_sqlite:
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _org_lock_key(org)})
            yield conn

    @contextmanager
    def write_orgs(self, orgs: Iterable[str]) -> Iterator[Connection]:
        """One transaction under several orgs' locks (a bill's import touches every org its
        lines name), taken in order of name: two such writers, or one and a writer of one
        org, never wait for each other."""
        ordered = sorted(set(orgs))
        with ExitStack() as held:
            for org in ordered:
                held.enter_context(self._org_lock(org).held(False))
            conn = held.enter_context(self.connection())
            held.enter_context(conn.begin())
            if not self.is_sqlite:
                for org in ordered:
                    conn.execute(
                        sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _org_lock_key(org)}
                    )
            yield conn

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """A write transaction that needs no org's lock (one job's own row, a grant)."""
        with self.connection() as conn, conn.begin():
            yield conn

    @contextmanager
    def connection(self, read: bool = False) -> Iterator[Connection]:
        """A pooled connection for one transaction. A thread never takes a second while it
        holds one: with one pooled connection per process (PostgreSQL) that would wait for
        itself, so it is refused at once instead."""
        if getattr(self._held, "conn", False):
            raise RuntimeError("a ledger transaction inside another on the same thread")
        self._held.conn = True
        try:
            conn = self.engine.connect()
            with conn.execution_options(gpu_budget_read=True) if read else conn:
                yield conn
        finally:
            self._held.conn = False

    def _org_lock(self, org: str) -> OrgLock:
        with _ORG_LOCKS_GUARD:
            if org not in self._org_locks:
                self._org_locks[org] = OrgLock()
            return self._org_locks[org]

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.connection(read=True) as conn, conn.begin():
            yield conn

    def bump(self, conn: Connection, org: str, decided: Iterable[str] = ()) -> None:
        """Bump the org's version and notify (PostgreSQL) the jobs `decided`, in the caller's
        transaction: their holders' watchers wake only them (`Queue.headroom` decides them)."""
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

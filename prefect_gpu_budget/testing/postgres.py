"""PostgreSQL databases for benchmarks and tests: each run makes its own and drops only what it
made. A database named by the user (a `--url`, a variable) is used as it is and never dropped.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

SERVER = "postgresql://postgres@127.0.0.1:5432"
"""The server a benchmark uses when it is given no URL."""


def _driver(url: sa.URL) -> sa.URL:
    return url.set(drivername="postgresql+psycopg")


def name_of(url: str) -> str:
    """The database a URL names."""
    return sa.make_url(url).database or ""


def server_of(url: str) -> str:
    """The URL of a database's server (no database), with the psycopg driver."""
    u = sa.make_url(url)
    server = sa.URL.create("postgresql+psycopg", u.username, u.password, u.host, u.port)
    return server.render_as_string(hide_password=False)


@contextmanager
def _admin(url: str) -> Iterator[sa.Connection]:
    """A connection to the `postgres` database of the server of `url`, outside transactions."""
    target = _driver(sa.make_url(url)).set(database="postgres")
    engine = sa.create_engine(target, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def ensure_database(url: str) -> bool:
    """Create the database of `url` if its server lacks it; True when it was created here.
    Raises `sqlalchemy.exc.OperationalError` when the server does not answer."""
    name = name_of(url)
    with _admin(url) as conn:
        found = conn.execute(
            sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
        ).first()
        if found:
            return False
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        return True


def drop_database(url: str) -> None:
    """Drop the database of `url`: only for one its caller created."""
    with _admin(url) as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name_of(url)}" WITH (FORCE)'))


@contextmanager
def postgres_database(prefix: str, server: str = SERVER) -> Iterator[str]:
    """A database of its own on `server`, named `<prefix>_<8 hex digits>`: created here, its
    URL (psycopg driver) yielded, dropped afterwards."""
    url = f"{server_of(server)}/{prefix}_{uuid.uuid4().hex[:8]}"
    with _admin(url) as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name_of(url)}"'))
    try:
        yield url
    finally:
        drop_database(url)


@contextmanager
def named_or_own(url: str | None, prefix: str, server: str = SERVER) -> Iterator[str]:
    """The database a run works in: `url` (created if missing, never dropped) when the user named
    one, else one of the run's own (`postgres_database(prefix, server)`, dropped at the end)."""
    if url:
        ensure_database(url)
        yield url
        return
    with postgres_database(prefix, server) as own:
        yield own


def backends(engine: sa.Engine, application_name: str) -> int:
    """Sessions open to `engine`'s database under `application_name` (`pg_stat_activity`)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = :app"
                ),
                {"app": application_name},
            ).scalar_one()
        )


def database_work(engine: sa.Engine, names: list[str]) -> dict[str, list[int]]:
    """Per database of `names` found on `engine`'s server: cumulative committed transactions and
    rows read (returned + fetched), from `pg_stat_database`."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT datname, xact_commit, tup_returned + tup_fetched FROM pg_stat_database "
                "WHERE datname = ANY(:names)"
            ),
            {"names": names},
        )
        return {name: [int(x), int(r)] for name, x, r in rows}


def vacuum(url: str, tables: str = "") -> None:
    """`VACUUM (ANALYZE)` the comma-separated `tables` of the database of `url` (all of it when
    empty), outside a transaction, on a connection of its own (psycopg driver)."""
    target = _driver(sa.make_url(url))
    engine = sa.create_engine(target, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f"VACUUM (ANALYZE) {tables}"))
    finally:
        engine.dispose()

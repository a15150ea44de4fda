"""Whether a PostgreSQL ledger lets its user in without a password: over TCP (trust
authentication: then anyone who reaches its port may write every budget) or through the
server's unix socket (`trust` on a `local` line of pg_hba.conf). `agents serve` refuses such a
ledger (`cli.agent`)."""

from __future__ import annotations

import os

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger.engine import normalise_url

SOCKET_DIRS: tuple[str, ...] = ("/var/run/postgresql", "/tmp")
"""Where a PostgreSQL server's unix socket is looked for when it cannot be asked (Debian's
folder, then PostgreSQL's own default)."""


def passwordless_login(url: str) -> str | None:
    """For a PostgreSQL ledger: its URL without the password (as it may be shown) when the
    server let its user in without one over TCP (trust authentication: then anyone who reaches
    its port may write every budget); None when it asked for a password, or for SQLite, or when
    it could not be reached at all."""
    bare = _bare(url)
    return None if bare is None or _trusted(bare) is None else bare.render_as_string()


def passwordless_socket(url: str) -> str | None:
    """For a PostgreSQL ledger: the path of the server's unix socket when it let the ledger's
    user in through it without a password (`trust` on a `local` line of pg_hba.conf: then any
    process of this host that may open the socket may write every budget); None otherwise."""
    bare = _bare(url)
    if bare is None:
        return None
    folders = list(SOCKET_DIRS)
    if bare.host and not bare.host.startswith("/"):  # asked over TCP, password and all
        shown = _trusted(sa.engine.make_url(normalise_url(url)), "SHOW unix_socket_directories")
        if shown:
            folders = [f.strip() for f in shown.split(",") if f.strip().startswith("/")]
    port = bare.port or 5432
    for folder in folders:
        path = f"{folder}/.s.PGSQL.{port}"
        local = bare.set(host=None, port=None, query={**bare.query, "host": folder})
        if os.path.exists(path) and _trusted(local.set(query={**local.query, "port": str(port)})):
            return path
    return None


def _bare(url: str) -> sa.engine.URL | None:
    """A PostgreSQL URL without its password; None for any other database."""
    parsed = sa.engine.make_url(normalise_url(url))
    if parsed.get_backend_name() != "postgresql":
        return None
    return sa.engine.URL.create(  # `URL.set(password=None)` would keep the password
        parsed.drivername,
        username=parsed.username,
        host=parsed.host,
        port=parsed.port,
        database=parsed.database,
        query=parsed.query,
    )


def _trusted(bare: sa.engine.URL, query: str = "SELECT 1") -> str | None:
    """What `query` answers when `bare` (without a password, unless it is the ledger's own
    URL) gets in; None when it does not."""
    engine = sa.create_engine(bare, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql(query).scalar())
    except sa.exc.SQLAlchemyError:
        return None
    finally:
        engine.dispose()

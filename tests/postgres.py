"""PostgreSQL for the tests that are about the shared ledger: they fail, never skip, without it.

Every database the suite uses is named here, and each belongs to one run of the suite: the
tests share their server with other work, so they create their own databases (named
`gpu_budget_<purpose>_<run>`) and drop, at the end of the run, only those they created.

| variable | default | used by |
| --- | --- | --- |
| `GPU_BUDGET_TEST_PG_SERVER` | `postgresql://postgres@127.0.0.1:5432` | every database below |
| `GPU_BUDGET_TEST_PG_URL` | `<server>/gpu_budget_test_<run>` | the ledger tests |
| `GPU_BUDGET_CHAOS_PG_URL` | `<server>/gpu_budget_chaos_<run>` | tests/test_chaos.py |
| `GATE_SOAK_PG_URL` | `<server>/gpu_budget_soak_<run>` (and `..._prefect`) | tests/test_soak.py |
| - | `<server>/gpu_budget_own_<run>_<id>` | `fresh_database()`: one test's own, dropped after it |

A database named by a variable is used as it is, and never dropped.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

SERVER = os.environ.get("GPU_BUDGET_TEST_PG_SERVER", "postgresql://postgres@127.0.0.1:5432")
RUN = f"{os.getpid()}_{secrets.token_hex(3)}"
_created: list[str] = []


def database_url(purpose: str, variable: str) -> str:
    """The URL of the variable if set, else a database of this run for `purpose`."""
    return os.environ.get(variable) or f"{SERVER}/gpu_budget_{purpose}_{RUN}"


def _server_engine(url: str) -> sa.Engine:
    server = url.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0]
    return sa.create_engine(server + "/postgres", isolation_level="AUTOCOMMIT")


def require_postgres(url: str) -> None:
    """Fail the calling test with a one-line reason when the server of `url` does not answer;
    create the database of `url` if this run owns it and it does not exist yet."""
    engine = _server_engine(url)
    name = url.rsplit("/", 1)[1]
    try:
        with engine.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).first()
            if not exists and RUN in name:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
                _created.append(url)
    except sa.exc.OperationalError as exc:
        server = url.rsplit("/", 1)[0].split("@")[-1]
        pytest.fail(f"PostgreSQL is required at {server}: {str(exc).splitlines()[0]}")
    finally:
        engine.dispose()


def created_by_this_run(url: str) -> None:
    """Note a database this run's code created itself (for example the soak's `_prefect`)."""
    if RUN in url.rsplit("/", 1)[1]:
        _created.append(url)


def drop_created() -> None:
    """Drop the databases this run created, and no other."""
    for url in reversed(_created):
        engine = _server_engine(url)
        try:
            with engine.connect() as conn:
                conn.execute(
                    sa.text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
                )
        except sa.exc.OperationalError:
            pass  # the server is gone: nothing to drop
        finally:
            engine.dispose()
    _created.clear()


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A database of its own on the server of `url`, for this test only: created with a unique
    name, dropped afterwards (only the one created here). Fails when the server is missing."""
    require_postgres(url)
    server = url.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0]
    name = f"gpu_budget_own_{RUN}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(server + "/postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield f"{server}/{name}"
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()

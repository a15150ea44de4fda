"""PostgreSQL for the tests that are about the shared ledger: they fail, never skip, without it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa


def require_postgres(url: str) -> None:
    """Fail the calling test with a one-line reason when the server of `url` does not answer."""
    server = url.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0]
    engine = sa.create_engine(server + "/postgres")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required at {server}: {str(exc).splitlines()[0]}")
    finally:
        engine.dispose()


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A database of its own on the server of `url`, for this test only: created with a unique
    name, dropped afterwards (only the one created here). Fails when the server is missing."""
    require_postgres(url)
    server = url.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0]
    name = f"gpu_budget_test_{uuid.uuid4().hex[:16]}"
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

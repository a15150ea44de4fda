"""PostgreSQL for the tests that are about the shared ledger: they fail, never skip, without it."""

from __future__ import annotations

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

"""PostgreSQL for the tests that are about the shared ledger: they fail, never skip, without it.

Every database the suite uses is named here, and each belongs to one run of the suite: the
tests share their server with other work, so they create their own databases (named
`gpu_budget_<purpose>_<run>`) and drop, at the end of the run, only those they created.

| variable | default | used by |
| --- | --- | --- |
| `GPU_BUDGET_TEST_PG_SERVER` | `postgresql://postgres@127.0.0.1:5432` | every database below |
| `GPU_BUDGET_TEST_PG_URL` | `<server>/gpu_budget_test_<run>` | the ledger tests |
| `GPU_BUDGET_CHAOS_PG_URL` | `<server>/gpu_budget_chaos_<run>` | tests/test_chaos.py |
| `GATE_SOAK_PG_URL` | `<server>/gpu_budget_soak_<run>` | tests/test_soak.py (its Prefect server's database is the soak's own) |
| - | `<server>/gpu_budget_own_<run>_<id>` | `fresh_database()`: one test's own, dropped after it |

A database named by a variable is used as it is, and never dropped. Creating and dropping go
through the benchmarks' harness (benchmarks/harness/postgres.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from benchmarks.harness.postgres import (
    drop_database,
    ensure_database,
    name_of,
    postgres_database,
    server_of,
)

SERVER = os.environ.get("GPU_BUDGET_TEST_PG_SERVER", "postgresql://postgres@127.0.0.1:5432")
RUN = f"{os.getpid()}_{secrets.token_hex(3)}"
_created: list[str] = []


def database_url(purpose: str, variable: str) -> str:
    """The URL of the variable if set, else a database of this run for `purpose`."""
    return os.environ.get(variable) or f"{SERVER}/gpu_budget_{purpose}_{RUN}"


def _fail(url: str, exc: sa.exc.OperationalError) -> None:
    server = url.rsplit("/", 1)[0].split("@")[-1]
    pytest.fail(f"PostgreSQL is required at {server}: {str(exc).splitlines()[0]}")


def require_postgres(url: str) -> None:
    """Fail the calling test with a one-line reason when the server of `url` does not answer;
    create the database of `url` if this run owns it and it does not exist yet."""
    try:
        if RUN in name_of(url):
            if ensure_database(url):
                _created.append(url)
        else:
            engine = sa.create_engine(server_of(url) + "/postgres", poolclass=sa.NullPool)
            try:
                with engine.connect():
                    pass
            finally:
                engine.dispose()
    except sa.exc.OperationalError as exc:
        _fail(url, exc)


def created_by_this_run(url: str) -> None:
    """Note a database this run's code created itself."""
    if RUN in name_of(url):
        _created.append(url)


def drop_created() -> None:
    """Drop the databases this run created, and no other."""
    for url in reversed(_created):
        with contextlib.suppress(sa.exc.OperationalError):  # the server is gone: nothing to drop
            drop_database(url)
    _created.clear()


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A database of its own on the server of `url`, for this test only: created with a unique
    name, dropped afterwards (only the one created here). Fails when the server is missing."""
    require_postgres(url)
    with postgres_database(f"gpu_budget_own_{RUN}", server_of(url)) as own:
        yield own

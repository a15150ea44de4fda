"""PostgreSQL for the tests that are about the shared ledger: they fail, never skip, without it.

Every database the suite uses is named here, and each belongs to one run of the suite: the
tests share their server with other work, so they create their own databases (named
`gpu_budget_<purpose>_<run>`, `<run>` being the run's owner (tests/support/runs.py) and this process's
id) and drop, at the end of the run, only those they created. `drop_databases` drops those of
the runs it is asked for: at the end of a run its own (what an interrupted one left), at the
start of one those of runs that ended. The names benchmarks give (`gpu_budget_cli_<pid>`,
`<prefix>_<id>`) are not of this form: those are never dropped here.

| variable | default | used by |
| --- | --- | --- |
| `GPU_BUDGET_TEST_PG_SERVER` | `postgresql://postgres@127.0.0.1:5432` | every database below |
| `GPU_BUDGET_TEST_PG_URL` | `<server>/gpu_budget_test_<run>` | the ledger tests |
| `GPU_BUDGET_CHAOS_PG_URL` | `<server>/gpu_budget_chaos_<run>` | tests/test_chaos.py |
| `GATE_SOAK_PG_URL` | `<server>/gpu_budget_soak_<run>` | tests/test_soak.py (its Prefect server's database is the soak's own) |
| - | `<server>/gpu_budget_own_<run>_<id>` | `fresh_database()`: one test's own, dropped after it |

A test that stops and starts PostgreSQL itself never touches that server: `private_cluster()`
makes a cluster of its own (initdb in a temporary folder, a free port), and removes it after.

A database named by a variable is used as it is, and never dropped. Creating and dropping go
through prefect_gpu_budget/testing/postgres.py, which the benchmarks use too.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.testing.postgres import (
    drop_database,
    ensure_database,
    name_of,
    postgres_database,
    server_of,
)
from tests.support.runs import OWNER

SERVER = os.environ.get("GPU_BUDGET_TEST_PG_SERVER", "postgresql://postgres@127.0.0.1:5432")
RUN = f"{OWNER}_{secrets.token_hex(3)}"
_NAMED = re.compile(r"gpu_budget_[a-z_]+?_(\d+_\d+_[0-9a-f]{6})_[0-9a-f]{6}(_[0-9a-f]{8})?")
"""A database named for a run: its group 1 is the run's owner."""
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


def drop_databases(whose: Callable[[str], bool]) -> None:
    """Drop the databases on `SERVER` named for a run whose owner `whose` picks; none when
    the server does not answer."""
    engine = sa.create_engine(
        server_of(SERVER) + "/postgres", poolclass=sa.NullPool, connect_args={"connect_timeout": 10}
    )
    try:
        with engine.connect() as conn:
            names = conn.execute(sa.text("SELECT datname FROM pg_database")).scalars().all()
    except sa.exc.OperationalError:
        return
    finally:
        engine.dispose()
    for name in names:
        named = _NAMED.fullmatch(name)
        if named and whose(named[1]):
            with contextlib.suppress(sa.exc.OperationalError):
                drop_database(f"{server_of(SERVER)}/{name}")


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A database of its own on the server of `url`, for this test only: created with a unique
    name, dropped afterwards (only the one created here). Fails when the server is missing."""
    require_postgres(url)
    with postgres_database(f"gpu_budget_own_{RUN}", server_of(url)) as own:
        yield own


def _pg_program(name: str) -> str:
    """A PostgreSQL server program (initdb, pg_ctl): the newest installed version's, else PATH's."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key)
    program = found[-1] if found else shutil.which(name)
    if program is None:
        pytest.fail(f"PostgreSQL's {name} is required for a private cluster: not found")
    return program


def _version_key(path: str) -> tuple[int, ...]:
    version = Path(path).parent.parent.name
    return tuple(int(part) for part in version.split(".") if part.isdigit())


@dataclass
class PrivateCluster:
    """A PostgreSQL cluster of one test's own: its folder, port and owner (the `postgres` OS
    user when the tests run as root: PostgreSQL refuses to run as root)."""

    folder: Path
    port: int
    owner: str

    @property
    def server(self) -> str:
        return f"postgresql://{self.owner}@127.0.0.1:{self.port}"

    def _pg_ctl(self, *args: str) -> None:
        data = str(self.folder / "data")
        command = [_pg_program("pg_ctl"), "-D", data, "-l", str(self.folder / "server.log")]
        done = subprocess.run(
            [*command, *args],
            user=self.owner if os.geteuid() == 0 else None,
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if done.returncode != 0:
            log = (self.folder / "server.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"pg_ctl {' '.join(args)}: {done.stderr.strip()}\n{log}")

    def start(self) -> None:
        """Start it and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg_ctl("-w", "-t", "120", "-o", options, "start")

    def stop(self) -> None:
        """Stop it (fast: open connections are ended) and wait until it is down."""
        self._pg_ctl("-w", "-t", "120", "-m", "fast", "stop")


@contextmanager
def private_cluster(parent: str | None = None) -> Iterator[PrivateCluster]:
    """A running PostgreSQL cluster of this test's own on a free port (trust auth, user
    `postgres` when run as root, else the current user), stopped and removed afterwards: for a
    test that stops and restarts its database, which the shared server must never be. Its
    folder, which holds its unix socket, is made in `parent` (default: the temp folder)."""
    from tests.support.prefect_server import free_port

    owner = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    # pytest's tmp_path is root's only
    folder = Path(tempfile.mkdtemp(prefix="gpu-budget-pg-", dir=parent))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(owner)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    cluster = PrivateCluster(folder, free_port(), owner)
    try:
        made = subprocess.run(
            [_pg_program("initdb"), "-D", str(folder / "data"), "-U", owner, "-A", "trust"]
            + ["--no-sync", "-E", "UTF8", "--locale=C"],
            user=owner if os.geteuid() == 0 else None,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if made.returncode != 0:
            pytest.fail(f"initdb of a private cluster failed: {made.stderr.strip()[-2000:]}")
        cluster.start()
        try:
            yield cluster
        finally:
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                cluster._pg_ctl("-w", "-t", "60", "-m", "immediate", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)

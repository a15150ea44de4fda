"""An interrupted run of the suite leaves no database and no process behind, and a run reaps
what an earlier run that was killed left, and nothing of a run still going (tests/support/runs.py).

Each test runs a small pytest of its own in a subprocess, with this suite's fixtures
(`-p tests.conftest`)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.testing.postgres import drop_database, ensure_database, server_of
from tests.support import runs
from tests.support.postgres import SERVER, drop_databases, require_postgres
from tests.support.prefect_server import wait_for

ROOT = Path(__file__).resolve().parents[1]
# started pytest runs and servers: one at a time, beside the rest of the suite
pytestmark = pytest.mark.xdist_group("interrupted-runs")

HOLDER = '''
import json, os, subprocess, sys, time
from pathlib import Path

import pytest

from tests.conftest import PG_URL
from tests.support.postgres import fresh_database
from tests.support.prefect_server import PrefectServer, stop_groups
from tests.support.runs import OWNER

@pytest.fixture
def database():
    with fresh_database(PG_URL) as url:
        yield url

@pytest.fixture
def server(tmp_path):
    with PrefectServer(tmp_path / "home") as server:
        yield server

@pytest.fixture
def job():
    """A process slow to stop (a job saving its checkpoint; anything on a loaded machine): its
    teardown, the first, outlasts the few seconds pytest-xdist gives a worker to end."""
    slow = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", slow], start_new_session=True)
    yield proc
    stop_groups([proc], grace=60)

def test_holds(prefect_api, database, server, job):
    held = {"owner": OWNER, "database": database.rsplit("/", 1)[1], "pids": [server.pid, job.pid]}
    Path(os.environ["HELD"] + ".part").write_text(json.dumps(held))
    os.rename(os.environ["HELD"] + ".part", os.environ["HELD"])
    time.sleep(600)
'''


def _as_a_shell_starts_it() -> None:
    """In the run's process before it execs: SIGINT and SIGTERM at their defaults and unblocked,
    as a shell starts a command, whatever this worker was left with (an ignored or blocked
    signal is inherited across exec, and a Ctrl-C would then never reach the run)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _leaked_signals() -> str:
    """How this process's SIGINT and SIGTERM differ from a fresh one's (handled in Python is
    fine: a handler does not outlive exec), or nothing."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    odd = [f"{sig.name} blocked" for sig in (signal.SIGINT, signal.SIGTERM) if sig in blocked]
    odd += [
        f"{sig.name} ignored"
        for sig in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(sig) == signal.SIG_IGN
    ]
    return ", ".join(odd)


def _pytest(folder: Path, *args: str, **env: str) -> subprocess.Popen:
    """pytest on `folder` with this suite's fixtures, in a session of its own (so a signal to
    its process group reaches it alone), its output in `folder`/out.txt."""
    inherited = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PREFECT_API"))
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest"]
    command += ["-p", "no:cacheprovider", *args, str(folder)]
    with (folder / "out.txt").open("w") as out:
        return subprocess.Popen(
            command,
            cwd=folder,
            env={**inherited, "PYTHONPATH": str(ROOT), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_as_a_shell_starts_it,
        )


def _databases() -> set[str]:
    engine = sa.create_engine(server_of(SERVER) + "/postgres", poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())
    finally:
        engine.dispose()


@pytest.mark.parametrize("interrupt", ["SIGINT to its group", "SIGTERM to pytest"])
def test_an_interrupted_run_leaves_nothing_behind(tmp_path: Path, interrupt: str) -> None:
    """A run with a worker (as the suite's) holding a database of its own, `prefect_api`'s
    server, a `PrefectServer` and a job, is interrupted: it ends them all before it exits."""
    require_postgres(f"{SERVER}/postgres")
    if leaked := _leaked_signals():  # the run starts clean; say what an earlier test left
        warnings.warn(f"this worker's signals were left changed: {leaked}", stacklevel=1)
    (tmp_path / "test_holder.py").write_text(HOLDER)
    held_file, out = tmp_path / "held.json", tmp_path / "out.txt"
    run = _pytest(tmp_path, "-n", "1", HELD=str(held_file))
    try:
        wait_for(
            lambda: held_file.exists() or run.poll() is not None,
            300,
            "the run to hold its database and servers",
        )
        assert run.poll() is None, f"the run ended first:\n{out.read_text()[-3000:]}"
        held = json.loads(held_file.read_text())
        owner = held["owner"]
        assert held["database"] in _databases()
        assert all(runs.tag(pid) for pid in held["pids"])
        assert {pid for pid, o in runs.marked().items() if o == owner} >= set(held["pids"])

        if interrupt == "SIGINT to its group":
            os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in a terminal
        else:
            run.send_signal(signal.SIGTERM)
        try:  # its teardown: the job's 60 s grace, two servers' stops, a database dropped,
            run.wait(timeout=360)  # each slower on a loaded machine; it ends as soon as done
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interrupted run did not end in 360 s:\n{out.read_text()[-3000:]}")
        said, names = out.read_text()[-3000:], _databases()
        assert held["database"] not in names and not [d for d in names if owner in d], said

        def gone() -> bool:
            ours = [pid for pid, o in runs.marked().items() if o == owner]
            return not ours and not any(runs.tag(pid) for pid in held["pids"])

        wait_for(gone, 60, "the run's processes to end")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if held_file.exists():  # what a failure left, not to leave it to the next run
            owner = json.loads(held_file.read_text())["owner"]
            runs.end_processes(lambda o: o == owner)
            drop_databases(lambda o: o == owner)


def _sleeper(**env: str) -> subprocess.Popen:
    command = [sys.executable, "-c", "import time; time.sleep(600)"]
    return subprocess.Popen(command, env={**os.environ, **env}, start_new_session=True)


def test_a_run_reaps_what_ended_runs_left_and_nothing_of_live_ones(tmp_path: Path) -> None:
    """What a killed run left (a database named for it, a process marked with it) goes at the
    start of the next run; the same things of a run whose owner still runs stay."""
    require_postgres(f"{SERVER}/postgres")
    owners = {"ended": _sleeper(), "live": _sleeper()}
    tags = {kind: runs.tag(proc.pid) for kind, proc in owners.items()}
    owners["ended"].kill()
    owners["ended"].wait()
    assert tags["ended"] and tags["live"] and runs.ended(tags["ended"])
    assert not runs.ended(tags["live"])
    urls = {
        k: f"{server_of(SERVER)}/gpu_budget_own_{t}_{secrets.token_hex(3)}" for k, t in tags.items()
    }
    left: dict[str, subprocess.Popen] = {}
    try:
        for kind, url in urls.items():
            assert ensure_database(url)
            left[kind] = _sleeper(**{runs.MARK: tags[kind]})
        wait_for(lambda: {p.pid for p in left.values()} <= set(runs.marked()), 60, "the marks")
        (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        run = _pytest(tmp_path)
        try:
            assert run.wait(timeout=300) == 0, (tmp_path / "out.txt").read_text()[-3000:]
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()

        left["ended"].wait(timeout=60)  # ended by the run
        assert left["live"].poll() is None
        names = _databases()
        assert urls["ended"].rsplit("/", 1)[1] not in names
        assert urls["live"].rsplit("/", 1)[1] in names
    finally:
        for proc in [*left.values(), owners["live"]]:
            proc.kill()
            proc.wait()
        for url in urls.values():
            drop_database(url)

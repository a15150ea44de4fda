"""Shared fixtures: a real Prefect server (once per session), SQLite and PostgreSQL ledgers.

PostgreSQL is expected at 127.0.0.1:5432 (trust auth); the databases the suite creates there,
and the variables that name others, are listed in tests/support/postgres.py. When it is missing the
PostgreSQL tests fail: they never skip.

A run leaves no process and no database behind, however it is stopped: Ctrl-C (SIGINT to every
process of the terminal's group) or SIGTERM to the pytest process (made a KeyboardInterrupt
here). Its processes and databases are named for it (tests/support/runs.py), so at its end its top
process ends those still there and drops those left, an interrupted worker's teardown being cut
short by pytest-xdist after a few seconds; a run killed outright (SIGKILL) leaves them to the
next run, which reaps them at its start.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_UI_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# the commands' output is read here as a script reads it: at one width, whatever COLUMNS the
# shell that started the suite exports (tests of narrow terminals set their own)
os.environ["COLUMNS"] = "200"

import pytest  # noqa: E402

from tests.support import runs  # noqa: E402
from tests.support.postgres import (  # noqa: E402
    database_url,
    drop_created,
    drop_databases,
    require_postgres,
)

os.environ[runs.MARK] = runs.OWNER  # every process this run starts carries its owner
PG_URL = database_url("test", "GPU_BUDGET_TEST_PG_URL")


def _reap(whose: Callable[[str], bool]) -> None:
    runs.end_processes(whose)  # first: a server would hold its database
    drop_databases(whose)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the run as Ctrl-C does (a second one at once)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    """The run's top process (not an xdist worker) reaps what runs that ended left, and turns
    SIGTERM into an interruption."""
    if not hasattr(config, "workerinput"):
        _reap(runs.ended)
        previous = signal.signal(signal.SIGTERM, _interrupt)
        config.add_cleanup(lambda: signal.signal(signal.SIGTERM, previous))


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Iterator[None]:
    """After the fixtures' teardown, even an interrupted one: each process drops the databases
    it created, and the top process ends what is left of the run (its workers' too)."""
    try:
        return (yield)
    finally:
        drop_created()
        if not hasattr(session.config, "workerinput"):
            _reap(lambda owner: owner == runs.OWNER)


SUITE_WORKERS = 4
"""Workers for a run of the whole suite (`-n auto` in `addopts`): most tests wait on servers
and subprocesses, so more workers than the 2 cores of the machine it is measured on pay."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`SUITE_WORKERS` for the whole suite (no paths named), else none: a run of chosen tests
    stays in one process, as light on a shared machine as before (`-n 4` spreads it too).
    `PYTEST_XDIST_AUTO_NUM_WORKERS` decides when set."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    return SUITE_WORKERS if config.args_source is pytest.Config.ArgsSource.TESTPATHS else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests run in parallel workers (`addopts`); a module whose tests share a
    module-scoped fixture (a server, a pool, a worker) runs whole in one worker: set up once,
    its tests in their order. Runs before pytest-xdist reads the groups."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = info is not None and any(
            defs[-1].scope in ("module", "package", "class")
            for defs in info.name2fixturedefs.values()
        )
        if shared and not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def pytest_collection_finish(session: pytest.Session) -> None:
    """A worker whose xdist groups did not take (pytest-xdist marks a grouped test by its
    node id, which pytest 9.2 no longer lets it rename) stops here: its module-scoped tests
    would otherwise be spread over workers, each with a fixture of its own, and fail apart."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [
        i.nodeid
        for i in session.items
        if any(i.iter_markers("xdist_group")) and "@" not in i.nodeid
    ]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {lost[0]} (pin pytest<9.2)")


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prefect server subprocess; its URL is exported for child processes too."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        url = PREFECT_API_URL.value()
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            os.environ.pop("PREFECT_API_URL", None)


@pytest.fixture
def prices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user price file with the local machines the tests run on."""
    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.pricing.catalog import set_local_price

    path = tmp_path / "prices.csv"
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(path))
    set_local_price("box", "3.6", gpus=1, path=path)
    set_local_price("race", "3.6", gpus=0, path=path)
    default_catalog.cache_clear()
    yield path
    default_catalog.cache_clear()


def _fresh_pg() -> str:
    """This run's PostgreSQL ledger database, its tables dropped."""
    from prefect_gpu_budget.admission.ledger import Ledger, metadata

    require_postgres(PG_URL)
    ledger = Ledger(PG_URL, create=False)
    try:
        metadata.drop_all(ledger.db.engine)
    finally:
        ledger.db.dispose()
    return PG_URL


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test on a SQLite file and on the shared PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return _fresh_pg()


@pytest.fixture
def ledger(ledger_url: str):
    from prefect_gpu_budget.admission.ledger import Ledger

    led = Ledger(ledger_url)
    yield led
    led.db.dispose()

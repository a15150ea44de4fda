"""Local machines' prices live in the ledger (`admission.prices`, `ledger.local_prices`): two
hosts (processes with homes of their own and no price file in common) on one ledger price a
`local:` machine alike, on SQLite and PostgreSQL; a CSV is only an import and an export."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PG_URL
from tests.support.postgres import fresh_database, require_postgres


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """One ledger two hosts share: a SQLite file, or a PostgreSQL database of this test's."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared' / 'ledger.db'}"
        return
    require_postgres(PG_URL)
    with fresh_database(PG_URL) as url:
        yield url


def _host(tmp_path: Path, name: str, url: str) -> dict[str, str]:
    """The environment of a host: a home of its own (its own default price file), the ledger."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_GPU_BUDGET_")}
    env.update(PREFECT_HOME=str(tmp_path / name / ".prefect"), PREFECT_GPU_BUDGET_LEDGER_URL=url)
    env.pop("PREFECT_API_URL", None)
    return env


def _cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def test_two_hosts_on_one_ledger_read_one_price(shared_url: str, tmp_path: Path) -> None:
    one, two = _host(tmp_path, "one", shared_url), _host(tmp_path, "two", shared_url)
    said = _cli(one, "prices", "set-local", "box", "--usd-per-hour", "3.6", "--gpus", "2")
    assert "in the ledger" in said, said
    assert "$3.60/h" in _cli(two, "quote", "local:box")
    _cli(two, "prices", "set-local", "box", "--usd-per-hour", "4.25", "--gpus", "2")
    assert "$4.25/h" in _cli(one, "quote", "local:box")
    for home in (one, two):  # nothing written in either host's home price file
        assert not (Path(home["PREFECT_HOME"]) / "gpu-budget" / "prices.csv").exists()


def test_a_running_process_sees_a_price_set_on_another_host(
    shared_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-running process (a gateway, a worker) prices with what another host set, within
    the catalog's refresh interval, without a restart."""
    from prefect_gpu_budget.admission.prices import LEDGER_PRICES_TTL_S, default_catalog

    here = _host(tmp_path, "here", shared_url)
    for key in [k for k in os.environ if k.startswith("PREFECT_GPU_BUDGET_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PREFECT_HOME", here["PREFECT_HOME"])
    monkeypatch.setenv("PREFECT_GPU_BUDGET_LEDGER_URL", shared_url)
    default_catalog.cache_clear()
    try:
        elsewhere = _host(tmp_path, "elsewhere", shared_url)
        _cli(elsewhere, "prices", "set-local", "box", "--usd-per-hour", "2", "--gpus", "1")
        assert default_catalog().quote("local:box").rate_micro_per_hour == 2_000_000
        _cli(elsewhere, "prices", "set-local", "box", "--usd-per-hour", "3", "--gpus", "1")
        time.sleep(LEDGER_PRICES_TTL_S + 0.1)
        assert default_catalog().quote("local:box").rate_micro_per_hour == 3_000_000
    finally:
        default_catalog.cache_clear()


def test_the_csv_is_an_import_and_an_export(shared_url: str, tmp_path: Path) -> None:
    """A host's old price file goes into the ledger with `import-local`; `export-local` writes
    the ledger's list back as the same CSV, which another host then reads from the ledger."""
    from prefect_gpu_budget.pricing.catalog import set_local_price

    old = set_local_price("rig", "1.5", gpus=4, path=tmp_path / "old.csv", vcpu=32)
    one, two = _host(tmp_path, "one", shared_url), _host(tmp_path, "two", shared_url)
    said = _cli(one, "prices", "import-local", str(old))
    assert "1 local price put in the ledger" in said and "local:rig" in said, said
    assert "$6.00/h" in _cli(two, "quote", "local:rig", "--nodes", "4")
    exported = _cli(two, "prices", "export-local")
    lines = exported.splitlines()
    assert lines[0].startswith("cloud,instance_type,provisioning"), exported
    assert lines[1].startswith("local,rig,on-demand,local GPU,4,32,0,1.5,"), exported


def test_a_hosts_old_price_file_is_not_read_and_the_error_names_its_import(
    shared_url: str, tmp_path: Path
) -> None:
    """The file `prices set-local` wrote in a host's home before prices moved into the ledger
    prices nothing any more (or that host alone would price the machine): a quote on it fails
    in one line naming the `import-local` that moves it, and once imported both hosts read
    the ledger's one price."""
    from prefect_gpu_budget.pricing.catalog import set_local_price

    one, two = _host(tmp_path, "one", shared_url), _host(tmp_path, "two", shared_url)
    old = Path(one["PREFECT_HOME"]) / "gpu-budget" / "prices.csv"
    set_local_price("rig", "1.5", gpus=4, path=old)
    refused = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "quote", "local:rig"],
        env=one,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0, refused.stdout
    said = refused.stdout + refused.stderr
    assert f"prices import-local {old}" in " ".join(said.split()), said
    _cli(one, "prices", "import-local", str(old))
    assert "$1.50/h" in _cli(one, "quote", "local:rig") and "$1.50/h" in _cli(
        two, "quote", "local:rig"
    )

"""`serve` and `deploy` on one Prefect server: each makes the deployments of the same names its
own. Served after `deploy`, a deployment keeps its id but loses the work pool's pull steps,
queue and storage, and its runs complete in the serving process; deployed after `serve`, it is
the work pool's again."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.runner import Runner

from prefect_gpu_budget.deployments import deploy, deployments
from tests.support.prefect_server import wait_for

POOL = "gpu-takeover"
NAMES = (
    "gpu-sweep/sweep",
    "gpu-budget-spend-report/daily",
    "gpu-budget-reconcile/every-5-minutes",
    "agent-sweep/agents",
    "gpu-budget-bill-import/daily",
)
BILL = "gpu-budget-bill-import/daily"
LOGGER = "prefect_gpu_budget.deployments"


@pytest.fixture
def pool(prefect_api) -> Iterator[str]:
    """A process work pool on the session's server; the package's deployments and the pool are
    deleted after (other tests of the server register the same names)."""
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
    try:
        yield POOL
    finally:
        with get_client(sync_client=True) as client:
            for name in NAMES:
                with contextlib.suppress(ObjectNotFound):
                    client.delete_deployment(client.read_deployment_by_name(name).id)
            client.delete_work_pool(POOL)


def _register_served() -> list:
    """Registers the served deployments as `serve` does (the runner's upsert); their ids."""
    runner = Runner(pause_on_shutdown=True)
    return [runner.add_deployment(d) for d in deployments()]


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _read(name: str):
    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_serving_takes_over_what_deploy_put_on_a_work_pool(pool, caplog):
    deployed = {str(i) for i in deploy(pool)}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        served = {str(i) for i in _register_served()}
    assert served == deployed  # updated in place: the same deployments, their runs kept
    for name in NAMES:
        found = _read(name)
        assert found.work_pool_name is None, name
        assert found.work_queue_name is None, name
        assert not found.pull_steps, (name, found.pull_steps)
        assert found.storage_document_id is None, name
        assert not found.job_variables, name
        assert found.path == ".", (name, found.path)  # where the served flow's entrypoint is
    said = _said(caplog)
    assert f"gpu-sweep/sweep was deployed to work pool {pool}; serving takes it over here" in said
    assert len(said) == len(NAMES), said  # one line each


def test_serving_twice_says_nothing(pool, caplog):
    _register_served()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _register_served()
    assert not _said(caplog)


def test_deploy_after_serve_gives_them_back_to_the_work_pool(pool, caplog):
    served = _register_served()
    with get_client(sync_client=True) as client:
        client.pause_deployment(served[0])  # as `serve` leaves them when it stops
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert {str(i) for i in deploy(pool)} == {str(i) for i in served}
    said = _said(caplog)
    assert len(said) == len(NAMES), said
    assert said[0].startswith(f"gpu-sweep/sweep was served; work pool {pool} takes it over")
    for name in NAMES:
        found = _read(name)
        assert found.work_pool_name == pool, name
        assert found.pull_steps, name
        assert not found.paused, name  # a paused one would never run on the pool


@pytest.mark.timeout(400)
def test_a_run_served_after_deploy_completes(pool, tmp_path: Path):
    """The real command: `serve` after `deploy` runs the bill import (no BillingExport block
    saved: it says so and completes), where it crashed taking the work pool's pull steps."""
    deploy(pool)
    env = {
        **os.environ,
        "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
        "COLUMNS": "200",
    }
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "serve"],
        env=env,
        cwd=tmp_path,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: "serving gpu-sweep/sweep" in log.read_text(), 300, "serve")
        with get_client(sync_client=True) as client:
            run = client.create_flow_run_from_deployment(_read(BILL).id)
            ended = wait_for(
                lambda: (r := client.read_flow_run(run.id)).state.is_final() and r,
                300,
                "the run's end",
            )
    except AssertionError:
        raise AssertionError(log.read_text()[-3000:]) from None
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
    said = log.read_text()
    assert ended.state.type.value == "COMPLETED", (ended.state, said[-3000:])
    assert f"{BILL} was deployed to work pool {pool}; serving takes it over here" in said

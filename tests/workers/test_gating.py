"""The worker types' gate (workers/gating.py) outside a worker: opening the gate is an outage
the worker waits out, as every later ledger call is."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from prefect_gpu_budget.tasks import gpu_job
from prefect_gpu_budget.workers import gating


def test_a_worker_whose_ledger_is_not_there_yet_waits_for_it(prefect_api, monkeypatch, caplog):
    """Here the worker's PostgreSQL ledger database appears two seconds after it first asks."""
    from prefect_gpu_budget.testing.postgres import drop_database, ensure_database, server_of
    from tests.conftest import PG_URL
    from tests.support.postgres import RUN, require_postgres

    require_postgres(PG_URL)  # named for this run: an interrupted one's is reaped later
    url = f"{server_of(PG_URL)}/gpu_budget_worker_{RUN}_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PREFECT_GPU_BUDGET_LEDGER_URL", url)
    monkeypatch.setattr(gpu_job, "_gates", {})  # this process's gates: this test's own
    appear = threading.Timer(2.0, ensure_database, args=(url,))
    appear.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefect_gpu_budget.worker"):
            started = time.monotonic()
            gate = gating.open_worker_gate()
        assert time.monotonic() - started >= 1.5
        assert (
            gate.ledger.config.budgets() == []
        )  # its schema was created once the database was there
        said = [r.getMessage() for r in caplog.records if r.name == "prefect_gpu_budget.worker"]
        assert said and said[0].startswith(
            "opening the ledger: the ledger's database is unreachable"
        )
    finally:
        appear.join()
        for opened in gpu_job._gates.values():
            opened.ledger.db.dispose()
        drop_database(url)


def test_a_gated_worker_refuses_to_start_with_a_shared_prefect_home(prefect_api, tmp_path):
    """Its profiles hold the Prefect API's auth string: a worker whose PREFECT_HOME other users
    can read stops before it polls, in one line with the fix."""
    import os
    import subprocess
    import sys
    import tempfile

    shared = tempfile.mkdtemp(prefix="gpu-budget-shared-home-")  # the system temp: 1777
    try:
        os.chmod(shared, 0o755)
        env = {**os.environ, "PREFECT_HOME": shared, "PREFECT_API_URL": prefect_api}
        env.pop("PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME", None)
        done = subprocess.run(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "shared-home"]
            + ["--type", "gpu-budget-process", "--run-once"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        said = done.stdout + done.stderr
        assert done.returncode != 0, said[-3000:]
        assert "open to other users" in said and f"chmod 700 {shared}" in said, said[-3000:]
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize(
    ("worker_type", "told"),
    [("process.GpuBudgetProcessWorker", 0), ("vertex.GpuBudgetVertexWorker", "not-started")],
)
def test_a_run_that_ends_at_the_gate_starts_nothing_in_either_worker_type(
    worker_type, told, monkeypatch
):
    """Both worker types pass each run through the same gate (`GatedWorker`): one that ends
    there (refused, or cancelled while it waited) reaches no infrastructure; the worker hears
    it started nothing and its result says so."""
    import importlib
    from types import SimpleNamespace

    import anyio

    module, name = worker_type.split(".")
    worker_class = getattr(importlib.import_module(f"prefect_gpu_budget.workers.{module}"), name)
    assert issubclass(worker_class, gating.GatedWorker)
    assert worker_class.get_documentation_url() == gating.GatedWorker._documentation_url

    async def ended_at_the_gate(worker, flow_run, configuration):
        raise gating.RunNotStarted("OverBudget")

    monkeypatch.setattr(gating, "admit_flow_run", ended_at_the_gate)
    heard = []
    status = SimpleNamespace(started=heard.append)
    worker = worker_class(work_pool_name="gated")
    result = anyio.run(worker.run, SimpleNamespace(name="run"), SimpleNamespace(), status)
    assert (result.status_code, result.identifier) == (0, gating.NOT_STARTED)
    assert heard == [told]

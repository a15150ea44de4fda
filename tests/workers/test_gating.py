"""The worker types' gate (workers/gating.py) outside a worker: opening it is an outage the
worker waits out, as every later ledger call is."""

from __future__ import annotations

import logging
import threading
import time
import uuid

from prefect_gpu_budget.tasks import gpu_job
from prefect_gpu_budget.workers import gating


def test_a_worker_whose_ledger_is_not_there_yet_waits_for_it(prefect_api, monkeypatch, caplog):
    """Here the worker's PostgreSQL ledger database appears two seconds after it first asks."""
    from benchmarks.harness.postgres import drop_database, ensure_database, server_of
    from tests.conftest import PG_URL
    from tests.postgres import require_postgres

    require_postgres(PG_URL)
    url = f"{server_of(PG_URL)}/gpu_budget_own_worker_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PREFECT_GPU_BUDGET_LEDGER_URL", url)
    monkeypatch.setattr(gpu_job, "_gates", {})  # this process's gates: this test's own
    appear = threading.Timer(2.0, ensure_database, args=(url,))
    appear.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefect_gpu_budget.worker"):
            started = time.monotonic()
            gate = gating._open_gate()
        assert time.monotonic() - started >= 1.5
        assert gate.ledger.budgets() == []  # its schema was created once the database was there
        said = [r.getMessage() for r in caplog.records if r.name == "prefect_gpu_budget.worker"]
        assert said and said[0].startswith(
            "opening the ledger: the ledger's database is unreachable"
        )
    finally:
        appear.join()
        for opened in gpu_job._gates.values():
            opened.ledger.dispose()
        drop_database(url)

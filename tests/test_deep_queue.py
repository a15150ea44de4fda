"""The deep-queue benchmark, short: 2 agent processes x 32 waiting threads, 64 jobs through a
team cap that admits 8 at once, on PostgreSQL and on SQLite (benchmarks/deep_queue.py).

`python -m benchmarks.deep_queue` runs once as a subprocess (a real Prefect server on a
PostgreSQL database of its own, a fresh ledger per backend); the tests below read its JSON.
Asserted: every job ran and none failed, the ledger's admitted windows never held more than the
cap, at most 10 ledger transactions per job and at most 2 ledger connections per process whose
jobs only wait (PostgreSQL). No timing is asserted: the suite runs on busy machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import SERVER, require_postgres

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--waiters", "64", "--processes", "2", "--jobs", "64", "--job-s", "0.2"]


@pytest.fixture(scope="module")
def depths() -> dict[str, dict[str, Any]]:
    """The benchmark's figures per backend."""
    require_postgres(f"{SERVER}/postgres")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own server
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.deep_queue", *ARGS, "--pg-server", SERVER]
        + ["--backend", "postgresql,sqlite", "--json"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.strip(), (
        f"the benchmark failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    return {d["backend"]: d for d in json.loads(proc.stdout)["depths"]}


@pytest.mark.timeout(450)
@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_every_job_of_a_deep_queue_runs_within_the_cap(depths, backend: str) -> None:
    depth = depths[backend]
    assert depth["per_process"] == 32 and depth["processes"] == 2
    assert depth["failed"] == 0, depth["errors"]
    assert depth["ran"] == depth["jobs"] == 64
    assert 1 <= depth["cap_held_max"] <= 8  # from the rows' [admitted_at, settled_at) windows


@pytest.mark.timeout(450)
def test_a_deep_queue_costs_few_ledger_transactions_per_job(depths) -> None:
    depth = depths["postgresql"]
    assert 0 < depth["transactions_per_job"] <= 10, depth["transactions"]


@pytest.mark.timeout(450)
def test_a_process_whose_jobs_only_wait_holds_two_ledger_connections(depths) -> None:
    """Sampled every 0.1 s while none of the process's jobs was admitted, running or getting
    in line: its watcher's LISTEN and the pool's one."""
    depth = depths["postgresql"]
    assert sum(depth["only_waiting_samples_by_process"]) > 0  # such moments were sampled
    assert depth["peak_connections_only_waiting"] <= 2, depth["only_waiting_over_2_doing"]

"""The whole campaign: a fresh ledger, a Prefect server, the fork server the workers come
from; the kill runs, the fault runs, then the end; summed up."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.chaos.config import PHASES, STEPS, WORKERS, log
from benchmarks.chaos.end import end_state
from benchmarks.chaos.faults import fault_run
from benchmarks.chaos.kills import one_run
from benchmarks.chaos.report import fault_progress, progress
from benchmarks.chaos.state import Setup
from benchmarks.chaos.summary import summarise
from benchmarks.harness import ensure_database, prefect_server, serving
from benchmarks.harness.ledger import fresh_ledger
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.pricing.catalog import set_local_price


def empty_ledger(url: str) -> Ledger:
    """The ledger at `url` with no gate rows: a PostgreSQL database created if missing, the
    gate's tables dropped and recreated."""
    if not url.startswith("sqlite"):
        ensure_database(url)
    return fresh_ledger(url)


def fork_server() -> Any:
    """Workers fork from a server that imported Prefect and the gate once (call after the
    Prefect API URL is in the environment: the fork server keeps the one it starts with)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "prefect.client.orchestration",
            "prefect_gpu_budget.admission.gate",
            "prefect_gpu_budget.launchers.local",
            "psycopg",
        ]
    )
    return ctx


def run(
    runs: int,
    url: str | None,
    seed: int,
    api_url: str | None = None,
    phases: tuple[str, ...] = PHASES,
    park_at: tuple[str, ...] = (),
    faults: tuple[str, ...] = (),
    fault_repeat: int = 1,
) -> dict[str, Any]:
    """`runs` runs cycling through `phases`, then one run per step mark in `park_at`, then
    `fault_repeat` runs of each fault in `faults`; then the end: every lease expired,
    reconcile, the whole ledger audited."""
    wall = time.perf_counter()
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="gpu-budget-chaos-") as tmp:
        url = url or f"sqlite:///{tmp}/ledger.db"
        prices = set_local_price("chaos", "3.6", gpus=0, path=Path(tmp) / "prices.csv")
        ledger = empty_ledger(url)
        log(f"ledger {ledger.db.engine.dialect.name}; Prefect server {api_url or 'starting'}")
        home = Path(tmp) / "prefect-home"
        home.mkdir()
        # the server given, else one of our own (its own PREFECT_HOME, leases in durable
        # filesystem storage, its lease repossessor running); its URL is exported for the
        # workers (and for this process's client)
        server = serving(api_url) if api_url is not None else prefect_server(home)
        with server as served:
            limits = RateLimits()
            tag = uuid.uuid4().hex[:8]  # not from the seed: reruns must not share names
            ctx = fork_server()
            setup = Setup(ledger, limits, ctx, served, str(prices), rng, tag)
            plan = [(phases[i % len(phases)], None) for i in range(runs)]
            plan += [(STEPS[mark[1:]], mark) for mark in park_at]
            results, fault_results = [], []
            fault_plan = [fault for _ in range(fault_repeat) for fault in faults]
            try:
                for i, (phase, mark) in enumerate(plan):
                    result = one_run(setup, i, phase, mark)
                    results.append(result)
                    log(progress(i, len(plan), result))
                for j, fault in enumerate(fault_plan):
                    result = fault_run(setup, len(plan) + j, fault)
                    fault_results.append(result)
                    log(fault_progress(j, len(fault_plan), result))
                end = end_state(setup)
            finally:
                limits.close()
                ledger.db.dispose()
    out = summarise(results, end, fault_results)
    out.update(
        prefect_server="given" if api_url else "prefect server start (filesystem leases)",
        backend=make_backend(url),
        seed=seed,
        workers_per_run=WORKERS,
        cpus=os.cpu_count(),
        wall_s=round(time.perf_counter() - wall, 1),
    )
    return out


def make_backend(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgresql"

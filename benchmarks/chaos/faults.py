"""Faults that are not kills: one job in guaranteed mode whose start finds the ledger locked
(stall), or whose command leaves children behind (escape), its process tree watched from
outside and its real cost set against what it reserved and what it was billed."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from pathlib import Path

from benchmarks.chaos.checks import settle_again
from benchmarks.chaos.config import (
    ESCAPE_SCRIPT,
    ESCAPED_WATCH_S,
    FAULT_GRACE_S,
    FAULT_MARK_ENV,
    FAULT_MAX_RUNTIME_S,
    MAX_WAIT,
    STALE_S,
    STALL_EXTRA_S,
    WATCH_SLACK_S,
    budgets,
    log,
)
from benchmarks.chaos.state import RunResult, Setup
from prefect_gpu_budget.admission.audit import audit
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import normalise_url
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher, marked_processes
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import cost_micro


def marked(value: str) -> list[int]:
    """Live processes whose environment carries FAULT_MARK_ENV=value."""
    return marked_processes(FAULT_MARK_ENV, value)


class TreeWatch:
    """How long any process of a marked tree lives, watched from outside every 50 ms."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.first: float | None = None
        self.last: float | None = None
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            alive = marked(self.value)
            if alive:
                now = time.time()
                self.first = self.first or now
                self.last = now
                self.most = max(self.most, len(alive))
            time.sleep(0.05)

    def stop(self) -> float:
        """The tree's life in seconds (0 if it was never seen)."""
        self._stop.set()
        self._thread.join()
        return 0.0 if self.first is None or self.last is None else self.last - self.first


def hold_ledger_lock(url: str, seconds: float, held: threading.Event) -> None:
    """Lock the jobs table against writers from a connection of its own for `seconds`."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.split("///", 1)[1], isolation_level=None, timeout=60)
        try:
            conn.execute("BEGIN IMMEDIATE")
            held.set()
            time.sleep(seconds)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return
    import sqlalchemy as sa

    engine = sa.create_engine(normalise_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE gpu_jobs IN EXCLUSIVE MODE"))
            held.set()
            time.sleep(seconds)
    finally:
        engine.dispose()


def fault_run(setup: Setup, index: int, fault: str) -> RunResult:
    """One job under `fault` (stall or escape), admitted, run and settled by a Gate in this
    process; its tree's life watched from outside; the run's org audited."""
    started = time.perf_counter()
    org = f"chaos-{setup.tag}-{index}"
    rules = budgets(org)
    for rule in rules:
        setup.ledger.config.set_budget(rule)
    setup.limits.ensure([(r.scope, r.hourly_cap_cents) for r in rules if r.hourly_cap_cents])
    gate = Gate(setup.ledger, setup.limits, catalog=Catalog.load(Path(setup.prices)))
    value = uuid.uuid4().hex
    command = ["sleep", "30"] if fault == "stall" else ["sh", "-c", ESCAPE_SCRIPT]
    job = GpuJob(
        instance_type="local:chaos",
        max_runtime=FAULT_MAX_RUNTIME_S,
        kill_grace=FAULT_GRACE_S,
        max_wait=MAX_WAIT,
        command=command,
        env={FAULT_MARK_ENV: value},
    )
    admission = gate.admit(job, f"{org}/t/s1")
    locker, held = None, threading.Event()
    if fault == "stall":
        hold_s = FAULT_MAX_RUNTIME_S + FAULT_GRACE_S + STALL_EXTRA_S
        locker = threading.Thread(
            target=hold_ledger_lock, args=(setup.ledger.url, hold_s, held), daemon=True
        )
        locker.start()
        held.wait(60)
    watch = TreeWatch(value)
    errors = 0
    try:
        ended = run_admitted(gate, admission, LocalLauncher())
        result, row = ended.result, ended.row
    except Exception as exc:  # counted: the fault broke the job's bookkeeping
        log(f"fault run {fault}: {type(exc).__name__}: {exc}")
        errors, row, result = 1, setup.ledger.views.job(admission.job_id), None
    left = len(marked(value))  # what outlived the job
    gone_by = time.monotonic() + ESCAPED_WATCH_S
    while marked(value) and time.monotonic() < gone_by:  # its real life, to bill it against
        time.sleep(0.2)
    lived = watch.stop()
    if locker is not None:
        locker.join(timeout=60)
    rate = admission.quote.rate_micro_per_hour
    real = cost_micro(rate, max(0.0, lived - WATCH_SLACK_S), round_up=False)
    billed = row.get("actual_micro") or 0
    injected = (
        held.is_set() and result is not None and "could not be recorded" in result.detail
        if fault == "stall"
        else watch.most >= 3  # the children ran on their own
    )
    checked = audit(setup.ledger, setup.limits, scope=org, stale_after=STALE_S)
    return RunResult(
        org=org,
        phase=fault,
        mark=None,
        landed=fault,
        position=result.outcome if result is not None else "error",
        injected=injected,
        delay_s=0.0,
        reconciled=[],
        audit=checked,
        second_settles_charged=settle_again(setup.ledger, org),
        outlived=left,
        errors=errors,
        stuck=0,
        wall_s=time.perf_counter() - started,
        overshoot_micro=max(0, real - (row.get("reserved_micro") or 0)),
        unmetered_micro=max(0, real - billed),
        fault=fault,
    )

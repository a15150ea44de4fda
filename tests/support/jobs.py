"""How tests describe jobs: a job asking the ledger for admission (`new_job`), and a GPU job
that runs until the test says (`held_job`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect_gpu_budget.admission.ledger import Ledger, NewJob
from prefect_gpu_budget.job import GpuJob
from tests.support.prefect_server import wait_for

_DEFAULT = NewJob(
    scope="acme",
    name="j",
    instance_type="local:box",
    provisioning="on-demand",
    nodes=1,
    rate_micro_per_hour=3_600_000,
    rate_cents=360,
    priority=0,
    max_runtime_s=60.0,
    expected_runtime_s=None,
    holder="elsewhere:1:1",
)
"""$3.60 an hour for at most a minute, held by a process on another host."""


def new_job(scope: str, **changes: Any) -> NewJob:
    return replace(_DEFAULT, scope=scope, **changes)


def held_job(marker: Path, **kw: Any) -> GpuJob:
    """A job that runs until the test creates `marker` (exit 1 if it never does), so the test,
    not the machine's speed, decides when it ends."""
    code = (
        "import os, sys, time\n"
        "deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(marker)!r}):\n"
        "    if time.monotonic() > deadline: sys.exit(1)\n"
        "    time.sleep(0.05)\n"
    )
    return GpuJob(**{"instance_type": "local:box", **kw}, command=[sys.executable, "-c", code])


def until_in(url: str, scope: str, state: str) -> None:
    """Wait until a job of `scope` is in `state` in the ledger at `url`."""
    ledger = Ledger(url)
    try:
        wait_for(lambda: ledger.views.jobs(scope, states=(state,)), 120, f"a {state} job")
    finally:
        ledger.db.dispose()


def _utc(text: str) -> float:
    """An ISO 8601 instant as epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def ran_job(ledger: Ledger, scope: str, start: str, end: str, rate_usd: float, **job) -> str:
    """A job that ran from `start` to `end` at `rate_usd` an hour, settled as its launcher
    would settle it."""
    micro = round(rate_usd * 1_000_000)
    asked = new_job(scope, rate_micro_per_hour=micro, rate_cents=-(-micro // 10_000), **job)
    job_id, decision = ledger.queue.request(asked, now=_utc(start) - 5)
    assert decision.verdict == "admit", decision
    assert ledger.settlements.mark_started(job_id, _utc(start))
    ended = ledger.settlements.settle(
        job_id, ended_at=_utc(end), outcome="completed", scope=scope, now=_utc(end)
    )
    assert ended is not None
    return job_id

"""Preemption end to end: a job within its team's quota takes back capacity lent to another team.
The victim (lowest priority, most recently admitted borrowed job) gets SIGTERM, checkpoints within
its grace period, pays for what it used, and is queued again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from prefect import flow

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.prices import default_catalog
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import set_local_price
from prefect_gpu_budget.tasks.gpu_job import run_gpu_job
from tests.support.jobs import held_job

TRAINER = """
import os, signal, sys, time
ckpt = sys.argv[1]
if os.path.exists(ckpt):  # resumed from its checkpoint: finish the rest quickly
    sys.exit(0)
def stop(*_):
    open(ckpt, "w").write("step 3")  # checkpoint inside the grace period, then leave
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(ckpt + ".ready", "w").close()  # it can checkpoint from now on
time.sleep(float(sys.argv[2]))
"""


def _job(tmp: Path, name: str, seconds: float, priority: str, requeue: bool = True) -> GpuJob:
    return GpuJob(
        requeue=requeue,
        instance_type="local:h100x8",
        max_runtime="2m",
        kill_grace="5s",
        name=name,
        priority=priority,
        command=[sys.executable, "-c", TRAINER, str(tmp / f"{name}.ckpt"), str(seconds)],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("requeue", [True, False], ids=["requeued", "not requeued"])
def test_borrowed_work_is_preempted_gracefully_and_requeued(
    prefect_api, tmp_path, monkeypatch, requeue
):
    """Queued again when its job asks (`GpuJob.requeue`), else ending `Preempted` as a
    `@gpu_task` and the worker types do."""
    prices = set_local_price("h100x8", "8", gpus=8, path=tmp_path / "prices.csv")
    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", str(prices))
    default_catalog.cache_clear()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("acme", period_budget_micro=10**9))
    pool = Pool("acme", "lab-a", 2, (8, 192, 2048), ("local:h100x8",), "H100")
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "acme/a", proportional(pool, 8)),
            TeamQuota("lab-a", "acme/b", proportional(pool, 8), borrow_pct=100),
        ],
    )
    block = SpendLedger(database_url=url)

    @flow
    def contention() -> str:
        own_job = held_job(  # runs until a's job is admitted
            tmp_path / "b-own.release",
            instance_type="local:h100x8",
            max_runtime="2m",
            name="b-own",
            priority="low",
        )
        own = run_gpu_job.submit(own_job, "acme/b/s", block)
        while not ledger.views.jobs("acme/b", states=("running",)):
            time.sleep(0.1)
        borrowed = run_gpu_job.submit(
            _job(tmp_path, "b-borrowed", 60, "low", requeue), "acme/b/s", block
        )
        while len(ledger.views.jobs("acme/b", states=("running",))) < 2:
            time.sleep(0.1)
        while not (tmp_path / "b-borrowed.ckpt.ready").exists():  # its handler is set
            time.sleep(0.1)
        mine = run_gpu_job.submit(_job(tmp_path, "a-own", 1, "high"), "acme/a/s", block)
        while not [r for r in ledger.views.jobs("acme/a") if r["admitted_at"]]:
            time.sleep(0.1)
        (tmp_path / "b-own.release").touch()
        for future in (own, borrowed, mine):
            future.wait()
        assert own.state.is_completed() and mine.state.is_completed()
        return borrowed.state.name

    ended_as = contention()
    rows = {}
    for row in ledger.views.jobs():
        rows.setdefault(row["name"], []).append(row)
    [own], [mine] = rows["b-own"], rows["a-own"]
    first, *again = sorted(rows["b-borrowed"], key=lambda r: r["requested_at"])
    assert own["outcome"] == "completed" and mine["outcome"] == "completed"
    assert first["outcome"] == "preempted" and first["preempt_at"] is not None
    assert (tmp_path / "b-borrowed.ckpt").read_text() == "step 3"  # it checkpointed
    assert first["ended_at"] - first["preempt_at"] < 5  # at its SIGTERM, not its 5 s grace
    assert 0 < first["actual_micro"] < first["reserved_micro"]  # paid only for what it used
    assert mine["admitted_at"] >= first["settled_at"]  # the capacity was free when a took it
    if not requeue:
        assert not again and ended_as == "Preempted"
        return
    [again] = again
    assert ended_as == "Completed"
    assert again["outcome"] == "completed" and again["requested_at"] >= first["settled_at"]

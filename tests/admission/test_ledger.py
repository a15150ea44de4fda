"""Ledger edge cases found in review: stale waiters, LIKE wildcards in scopes."""

from __future__ import annotations

import time

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.policy import BudgetRule, Hold
from prefect_gpu_budget.simulate import SimJob, simulate


def _job(scope: str) -> NewJob:
    return NewJob(
        scope=scope,
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


def test_a_waiter_that_stalled_is_still_decided(ledger):
    ledger.set_budget(BudgetRule("st", hourly_cap_cents=360))
    first, admitted = ledger.request(_job("st/a"))
    second, waiting = ledger.request(_job("st/a"))
    assert admitted.verdict == "admit" and waiting.verdict == "wait"
    later = time.time() + 45  # its own heartbeat is older than the stale limit
    assert ledger.try_admit(second, "st/a", now=later).verdict == "wait"


def test_underscore_in_a_scope_is_not_a_wildcard(ledger):
    ledger.set_budget(BudgetRule("axb", hourly_cap_cents=10_000, period_budget_micro=10**9))
    job_id, decision = ledger.request(_job("axb/t"))
    ledger.mark_started(job_id, time.time() - 100)
    ledger.settle(job_id, ended_at=time.time(), outcome="completed", scope="axb/t")
    ledger.set_budget(BudgetRule("a_b", hourly_cap_cents=10_000, period_budget_micro=10**9))
    assert [s["settled_micro"] for s in ledger.status("a_b")] == [0]
    assert [len(ledger.jobs(scope)) for scope in ("a_b", "axb")] == [0, 1]


def test_forecast_frees_jobs_already_running_when_they_end():
    start = 1_798_761_600.0
    running = Hold("o", 100, 1_000_000, start - 600, start + 3000, 1_000_000, start + 3000)
    trial = SimJob("t", "o", start, 1_000_000, 600, 600, 600)
    result = simulate([trial], [BudgetRule("o", hourly_cap_cents=100)], holds=[running])
    [record] = result.records
    assert record.admitted_at == start + 3000

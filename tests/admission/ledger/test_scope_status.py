"""`Views.status` read in a few statements (admission/ledger/scope_status.py): each budgeted
scope sees the open jobs of its whole subtree and no other, and its current period's settled
spend from the period totals, whatever the number of scopes."""

from __future__ import annotations

import time

from prefect_gpu_budget.admission.rules.policy import BudgetRule
from tests.support.jobs import new_job


def test_each_scope_counts_its_subtrees_open_jobs_and_its_periods_total(ledger):
    for scope, period in (("ss", "month"), ("ss/a", "week"), ("ss/b", "week")):
        ledger.config.set_budget(
            BudgetRule(scope, hourly_cap_cents=100_000, period_budget_micro=10**9, period=period)
        )
    ledger.config.set_budget(BudgetRule("ss/a/s1", 360, 10**9, period="day"))
    ledger.config.set_budget(BudgetRule("other", hourly_cap_cents=100_000))
    now = time.time()
    done, _ = ledger.queue.request(new_job("ss/a/s1"), now=now - 100)
    ledger.settlements.mark_started(done, now - 90)
    ledger.settlements.settle(done, ended_at=now - 30, outcome="completed", scope="ss/a/s1")
    running, _ = ledger.queue.request(new_job("ss/a/s1"))
    ledger.settlements.mark_started(running, time.time())
    _, waiting = ledger.queue.request(new_job("ss/a/s1"))  # the session's cap holds it
    ledger.queue.request(new_job("ss/b/s2"))  # admitted, not started
    ledger.queue.request(new_job("other/x"))
    assert waiting.verdict == "wait"
    rows = {r["scope"]: r for r in ledger.views.status()}
    counts = {s: (r["running"], r["admitted"], r["queued"]) for s, r in rows.items()}
    assert counts == {
        "other": (0, 1, 0),
        "ss": (1, 1, 1),
        "ss/a": (1, 0, 1),
        "ss/a/s1": (1, 0, 1),
        "ss/b": (0, 1, 0),
    }
    rate = new_job("ss").rate_micro_per_hour
    assert (
        rows["ss"]["running_rate_micro"] == 2 * rate and rows["ss/a"]["running_rate_micro"] == rate
    )
    for scope in ("ss", "ss/a", "ss/a/s1"):
        r = rows[scope]
        assert r["settled_micro"] == ledger.views.period_settled(scope, r["period_start"]) > 0
    assert rows["ss/b"]["settled_micro"] == 0 and rows["ss/a"]["reserved_micro"] > 0
    assert [r["scope"] for r in ledger.views.status("ss/a")] == ["ss/a", "ss/a/s1"]

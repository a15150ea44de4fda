"""What the ledger shows of the bills (admission/ledger/bill_views.py): the drift of one billing
period (its jobs, with all their lines' bill, and its lines no job owns) or of all, and the
latest period imported. On SQLite and PostgreSQL."""

from __future__ import annotations

import time

from prefect_gpu_budget.admission.ledger.bill_views import drift, latest_period
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.trueup import month_of
from tests.support.jobs import new_job

HOUR = 3600.0


def _ran(ledger, scope: str, start: float) -> str:
    job = new_job(scope, launcher="sagemaker:lab", instance_type="sagemaker:ml.g5.xlarge")
    job_id, _ = ledger.queue.request(job, now=start - 1)
    ledger.settlements.mark_started(job_id, start)
    ledger.settlements.settle(
        job_id, ended_at=start + HOUR, outcome="completed", scope=scope, now=start + HOUR
    )
    return job_id


def _line(job_id: str | None, start: float, usd: str, **kw) -> BillLine:
    return BillLine(
        **{
            "source": "aws-cur2",
            "billing_period": month_of(start),
            "line_id": f"{job_id}-{start}",
            "line_type": "Usage",
            "usage_start": start,
            "usage_end": start + HOUR,
            "billed_micro": int(float(usd) * 1_000_000),
            "currency": "USD",
            "job_mark": job_id,
            **kw,
        }
    )


def test_one_billing_period_shows_its_jobs_and_its_own_unowned_lines(ledger):
    ledger.config.set_budget(BudgetRule("bv", period_budget_micro=10**12, period="month"))
    now = time.time()
    this = periods.bounds("month", "UTC", now)[0] + HOUR
    last = periods.bounds("month", "UTC", this - 86400)[0] + HOUR
    old, new = _ran(ledger, "bv/t/a", last), _ran(ledger, "bv/t/b", this)
    for start, job in ((last, old), (this, new)):
        lines = [_line(job, start, "3.00"), _line(None, start, "1.00", line_id=f"u-{start}")]
        ledger.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0, now=now)
    with ledger.db.read() as conn:
        assert latest_period(conn) == month_of(this)
        latest = drift(conn, None, month_of(this))
        before = drift(conn, "bv/t", month_of(last))
        every = drift(conn, None)
    assert [j["job_id"] for j in latest["jobs"]] == [new]
    assert [x["usage_start"] for x in latest["untagged"]] == [this]
    assert [j["job_id"] for j in before["jobs"]] == [old] and len(before["untagged"]) == 1
    assert {j["job_id"] for j in every["jobs"]} == {old, new} and len(every["untagged"]) == 2
    assert every == ledger.bills.drift()

"""The cloud's bill in the ledger (admission/ledger/bills.py): an import replaces its (source,
billing period) whole, books only the difference on every budget on a job's path in the
period its usage fell in, twice changes nothing, a restated line replaces the old, provisional
lines move no budget, a bill below the settlement frees room, a closed period over its budget
by the bill is marked, and bad input changes nothing. On SQLite and PostgreSQL."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone

import pytest

from prefect_gpu_budget.admission.audit import audit
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import BillError, BillLine
from prefect_gpu_budget.billing.trueup import month_of
from tests.support.jobs import new_job

HOUR = 3600.0


def _settled(ledger, scope: str, start: float, hours: float, **job) -> dict:
    """A SageMaker job of `scope` that ran `hours` from `start` at $3.60/h (so it settles at
    $3.60 an hour), as its launcher would record it."""
    job = {"launcher": "sagemaker:lab", "instance_type": "sagemaker:ml.g5.xlarge", **job}
    external_id = job.pop("external_id", None)
    job_id, decision = ledger.queue.request(new_job(scope, **job), now=start - 1)
    assert decision.verdict == "admit", decision
    assert ledger.settlements.mark_started(job_id, start, external_id)
    row = ledger.settlements.settle(
        job_id,
        ended_at=start + hours * HOUR,
        outcome="completed",
        scope=scope,
        now=start + hours * HOUR,
    )
    assert row is not None
    return row


def _line(job_id: str | None, start: float, hours: float, usd: str, **kw) -> BillLine:
    fields = {
        "source": "aws-cur2",
        "billing_period": month_of(start),
        "line_id": f"{job_id}-{start}-{usd}",
        "line_type": "Usage",
        "usage_start": start,
        "usage_end": start + hours * HOUR,
        "billed_micro": int(float(usd) * 1_000_000),
        "currency": "USD",
        "job_mark": job_id,
    }
    return BillLine(**{**fields, **kw})


def _month_start(t: float) -> float:
    return periods.bounds("month", "UTC", t)[0]


def _spend(ledger, scope: str, t: float) -> int:
    return ledger.views.period_settled(scope, _month_start(t))


@pytest.fixture
def lab(ledger):
    ledger.config.set_budget(
        BudgetRule("lab", period_budget_micro=1000 * 10**6, period="month", hourly_cap_cents=10**6)
    )
    ledger.config.set_budget(
        BudgetRule("lab/vision", period_budget_micro=500 * 10**6, period="month")
    )
    return ledger


def test_a_final_bill_replaces_the_settlement_on_every_budget_on_the_path(lab):
    now = time.time()
    start = _month_start(now) + 2 * HOUR  # early this month, long ended
    job = _settled(lab, "lab/vision/a7", start, 2)  # $7.20 settled
    assert _spend(lab, "lab/vision", start) == 7_200_000
    lines = [
        _line(job["id"], start, 1, "3.50"),
        _line(job["id"], start + HOUR, 1, "3.30"),
        _line(job["id"], start, 2, "-0.40", line_type="Credit"),  # a spot credit, marked
        _line(None, start, 1, "1.00"),  # nobody's usage
        _line(None, start, 720, "0.55", line_type="Tax"),  # the account's
    ]
    done = lab.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0, now=now)
    assert done.changed and done.jobs_final == 1 and done.jobs_provisional == 0
    assert (done.untagged_micro, done.account_micro) == (1_000_000, 550_000)
    for scope in ("lab", "lab/vision"):  # $3.50 + $3.30 - $0.40 = $6.40, never the others'
        assert _spend(lab, scope, start) == 6_400_000, scope
    drift = lab.bills.drift("lab/vision")
    [entry] = drift["jobs"]
    assert entry["settled_micro"] == 7_200_000 and entry["billed_micro"] == 6_400_000
    assert entry["drift_micro"] == -800_000 and entry["final"]
    assert drift["scopes"]["lab/vision/a7"]["drift_micro"] == -800_000
    assert [x["billed_micro"] for x in drift["untagged"]] == [1_000_000]
    assert [x["line_type"] for x in drift["account"]] == ["Tax"]
    checked = audit(lab, scope="lab")
    assert checked.double_charges == 0 and checked.missing_charges == 0, checked.messages


def test_the_same_export_twice_changes_nothing_and_a_restated_line_replaces_the_old(lab):
    now = time.time()
    start = _month_start(now) + 3 * HOUR
    job = _settled(lab, "lab/vision/a7", start, 1)
    lines = [_line(job["id"], start, 1, "4.00", line_id="li-1")]
    period = month_of(start)
    first = lab.bills.import_bill("aws-cur2", period, lines, provisional_hours=0, now=now)
    assert first.changed and _spend(lab, "lab", start) == 4_000_000
    again = lab.bills.import_bill("aws-cur2", period, lines, provisional_hours=0, now=now + 60)
    assert not again.changed and again.booked_micro == 0
    assert _spend(lab, "lab", start) == 4_000_000
    restated = [replace(lines[0], billed_micro=3_100_000)]
    later = lab.bills.import_bill("aws-cur2", period, restated, provisional_hours=0, now=now)
    assert later.changed and later.booked_micro == -900_000 * 2  # org and team budgets
    assert _spend(lab, "lab", start) == 3_100_000
    assert lab.bills.drift()["jobs"][0]["billed_micro"] == 3_100_000
    gone = lab.bills.import_bill("aws-cur2", period, [], provisional_hours=0, now=now)
    assert gone.changed and _spend(lab, "lab", start) == 3_600_000  # back to its settlement
    assert lab.bills.drift()["jobs"] == []


def test_provisional_lines_move_no_budget_until_they_are_final(lab):
    now = time.time()
    start = now - 3 * HOUR  # ended an hour ago
    job = _settled(lab, "lab/vision/a7", start, 2)
    lines = [_line(job["id"], start, 2, "9.00")]
    period = month_of(start)
    done = lab.bills.import_bill("aws-cur2", period, lines, provisional_hours=48, now=now)
    assert done.jobs_provisional == 1 and done.booked_micro == 0
    assert _spend(lab, "lab", start) == 7_200_000
    assert not lab.bills.drift()["jobs"][0]["final"]
    final = lab.bills.import_bill(
        "aws-cur2", period, lines, provisional_hours=48, now=now + 50 * HOUR
    )
    assert final.changed and final.jobs_final == 1
    assert _spend(lab, "lab", start) == 9_000_000


def test_a_bill_below_its_settlement_frees_room_for_a_waiting_job(ledger):
    now = time.time()
    start = _month_start(now) + HOUR
    ledger.config.set_budget(BudgetRule("tight", period_budget_micro=8_000_000, period="month"))
    job = _settled(ledger, "tight/t", start, 2)  # $7.20 of $8
    asks = new_job("tight/t", max_runtime_s=3600.0)  # holds $3.60 for its hour
    waiting_id, waiting = ledger.queue.request(asks, now=now)
    assert waiting.verdict == "wait", waiting
    lines = [_line(job["id"], start, 2, "3.00")]  # the bill says $3.00
    ledger.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0, now=now)
    assert ledger.views.job(waiting_id)["state"] == "admitted"


def test_a_closed_period_over_its_budget_by_the_bill_is_marked(ledger):
    now = time.time()
    last_month = _month_start(_month_start(now) - 1)
    start = last_month + 5 * HOUR
    ledger.config.set_budget(BudgetRule("closed", period_budget_micro=5_000_000, period="month"))
    job = _settled(ledger, "closed/c", start, 1)  # $3.60 of $5 when it ran
    lines = [_line(job["id"], start, 1, "6.25")]
    done = ledger.bills.import_bill(
        "aws-cur2", month_of(start), lines, provisional_hours=0, now=now
    )
    [over] = done.over_by_bill
    assert (over.scope, over.period_start) == ("closed", last_month)
    assert (over.budget_micro, over.spent_micro) == (5_000_000, 6_250_000)
    assert ledger.bills.over_by_bill("closed") == [over]
    again = ledger.bills.import_bill(
        "aws-cur2", month_of(start), lines, provisional_hours=0, now=now
    )
    assert again.over_by_bill == []  # marked already: not told twice
    lines = [_line(job["id"], start, 1, "4.00")]
    ledger.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0, now=now)
    assert ledger.bills.over_by_bill() == []  # a restatement brought it back under


def test_usage_is_booked_in_the_period_it_fell_in(ledger):
    """A job that ran across midnight: each day budget gets the lines of its own day."""
    ledger.config.set_budget(BudgetRule("days", period_budget_micro=100 * 10**6, period="day"))
    midnight = periods.bounds("day", "UTC", time.time())[0] - 2 * 86400
    start = midnight - HOUR
    job = _settled(ledger, "days/d", start, 2)  # $3.60 each side of midnight
    lines = [_line(job["id"], start, 1, "1.00"), _line(job["id"], midnight, 1, "5.00")]
    period = month_of(start)
    if month_of(midnight) != period:  # the first of a month: one line each billing period
        pytest.skip("the two days fall in two billing periods today")
    ledger.bills.import_bill("aws-cur2", period, lines, provisional_hours=0, now=time.time())
    assert ledger.views.period_settled("days", midnight - 86400) == 1_000_000
    assert ledger.views.period_settled("days", midnight) == 5_000_000


def test_a_sagemaker_line_without_its_tag_is_matched_by_its_training_jobs_arn(lab):
    now = time.time()
    start = _month_start(now) + HOUR
    job = _settled(
        lab, "lab/vision/a7", start, 1, launcher="sagemaker:lab", external_id="sweep-0003-a1b2"
    )
    arn = "arn:aws:sagemaker:us-east-1:111111111111:training-job/sweep-0003-a1b2"
    lines = [_line(None, start, 1, "5.00", resource_id=arn)]
    done = lab.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0, now=now)
    assert done.jobs_final == 1 and done.untagged_micro == 0
    assert lab.bills.drift()["jobs"][0]["job_id"] == job["id"]


def test_a_budget_set_again_keeps_the_bills_word(lab):
    now = time.time()
    start = _month_start(now) + HOUR
    job = _settled(lab, "lab/vision/a7", start, 1)
    lines = [_line(job["id"], start, 1, "2.00")]
    lab.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0, now=now)
    lab.config.set_budget(BudgetRule("lab/vision", period_budget_micro=400 * 10**6, period="month"))
    assert _spend(lab, "lab/vision", start) == 2_000_000  # rebuilt from the jobs and the bill


@pytest.mark.parametrize(
    "bad, rule",
    [
        ({"currency": "EUR"}, "currency 'EUR', not the budgets' USD"),
        ({"source": "gcp-billing"}, "a gcp-billing line"),
        ({"billing_period": "1999-01"}, "of 1999-01 in an import"),
    ],
)
def test_a_bad_line_changes_nothing(lab, bad: dict, rule: str):
    now = time.time()
    start = _month_start(now) + HOUR
    job = _settled(lab, "lab/vision/a7", start, 1)
    good = [_line(job["id"], start, 1, "2.00")]
    lab.bills.import_bill("aws-cur2", month_of(start), good, provisional_hours=0, now=now)
    worse = [_line(job["id"], start, 1, "9.00", where="cur.parquet, row 3", **bad)]
    with pytest.raises(BillError) as refused:
        lab.bills.import_bill("aws-cur2", month_of(start), worse, provisional_hours=0, now=now)
    assert rule in str(refused.value) and "cur.parquet, row 3" in str(refused.value)
    assert _spend(lab, "lab", start) == 2_000_000
    assert lab.bills.drift()["jobs"][0]["billed_micro"] == 2_000_000


def test_month_of_is_the_utc_month():
    t = datetime(2026, 11, 30, 23, 30, tzinfo=timezone.utc).timestamp()
    assert month_of(t) == "2026-11" and month_of(t + HOUR) == "2026-12"


def test_a_figure_not_final_says_why(lab):
    from prefect_gpu_budget.billing.results import summary

    start = _month_start(time.time()) + HOUR
    job = _settled(lab, "lab/vision/a7", start, 1)  # 01:00-02:00
    lines = [_line(job["id"], start + HOUR / 2, 1, "4.00")]  # its last hour ends at 02:30
    period = month_of(start)
    early = lab.bills.import_bill("aws-cur2", period, lines, provisional_hours=0, now=start + HOUR)
    assert early.provisional == {"usage not ended": 1} and early.jobs_final == 0
    assert "0 job(s) final, 1 provisional (usage not ended)" in summary(early)
    assert lab.bills.drift()["jobs"][0]["reason"] == "usage not ended"
    later = lab.bills.import_bill(
        "aws-cur2", period, lines, provisional_hours=48, now=start + 5 * HOUR
    )
    assert later.provisional == {"usage ended less than 48 h ago": 1}
    assert _spend(lab, "lab", start) == 3_600_000  # provisional: nothing moved
    done = lab.bills.import_bill(
        "aws-cur2", period, lines, provisional_hours=0, now=start + 5 * HOUR
    )
    assert done.jobs_final == 1 and done.drift_micro == 400_000
    assert done.moved == {"lab": 400_000, "lab/vision": 400_000} and done.booked_micro == 800_000
    said = summary(done)
    assert "drift booked $0.40; budgets moved: lab $0.40, lab/vision $0.40" in said, said

"""The bill's pure rules (billing/trueup.py), called by name: whose a line is (`owner_of`),
when a figure is final (`is_final`, `provisional_reason`), whether a line can be true of its
job (`refusal`, `booked_lines`), when a figure waits for an admin (`held_reason`), which
periods a daily import reads (`periods_to_read`); and what a final figure moves in the period
budgets (`admission.rules.accounting.book_trueup`)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

import pytest

from prefect_gpu_budget.admission.rules.accounting import book_trueup
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.trueup import (
    BilledJob,
    booked_lines,
    held_reason,
    is_final,
    month_of,
    owner_of,
    periods_to_read,
    provisional_reason,
    refusal,
    resource_name,
)

HOUR = 3600.0
T0 = datetime(2026, 11, 3, 10, tzinfo=timezone.utc).timestamp()
NOV = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()
DEC = datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
ARN = "arn:aws:sagemaker:us-east-1:123456789012:training-job/ft-7"

JOB = BilledJob(
    id="j1",
    org="acme",
    scope="acme/nlp",
    state="settled",
    launcher="sagemaker:lab",
    instance_type="sagemaker:ml.g5.xlarge",
    external_id="ft-7",
    reserved_micro=10_000_000,
    actual_micro=4_000_000,
    started_at=T0,
    ended_at=T0 + 2 * HOUR,
    settled_at=T0 + 2 * HOUR,
)


def line(usd: float = 1.0, **kw: object) -> BillLine:
    fields: dict = {
        "source": "aws-cur2",
        "billing_period": "2026-11",
        "line_id": "l1",
        "line_type": "Usage",
        "usage_start": T0,
        "usage_end": T0 + HOUR,
        "billed_micro": round(usd * 1_000_000),
        "currency": "USD",
        **kw,
    }
    return BillLine(**fields)


def test_owner_of_a_marked_line_is_the_job_its_mark_names() -> None:
    assert owner_of(line(job_mark="j1"), {"j1": JOB}, {}) == ("job", JOB)


def test_owner_of_an_unmarked_sagemaker_line_is_the_job_its_arn_names() -> None:
    assert resource_name(ARN) == "ft-7"
    assert owner_of(line(resource_id=ARN), {}, {"ft-7": JOB}) == ("job", JOB)


def test_owner_of_nobodys_line_is_untagged_usage_or_the_account() -> None:
    assert owner_of(line(job_mark="unknown"), {"j1": JOB}, {}) == ("untagged", None)
    assert owner_of(line(line_type="Tax"), {}, {}) == ("account", None)


def test_is_final_once_settled_and_every_line_ended_the_window_ago() -> None:
    ends = [T0 + HOUR, T0 + 2 * HOUR]
    assert is_final(JOB, ends, T0 + 2 * HOUR + 48 * HOUR, 48)
    assert not is_final(JOB, ends, T0 + 2 * HOUR + 47 * HOUR, 48)
    assert is_final(JOB, ends, T0 + 2 * HOUR, 0)  # 0: every line whose usage ended is final
    assert provisional_reason(JOB, ends, T0 + 3 * HOUR, 48) == "usage ended less than 48 h ago"
    assert provisional_reason(JOB, [T0 + 9 * HOUR], T0 + 3 * HOUR, 0) == "usage not ended"
    running = replace(JOB, state="running")
    assert not is_final(running, ends, T0 + 999 * HOUR, 0)
    assert provisional_reason(running, ends, T0, 0) == "the job is running, not settled"


def test_a_line_of_another_cloud_or_outside_the_run_is_refused() -> None:
    assert refusal(line(job_mark="j1"), JOB, T0) is None
    gcp = line(source="gcp-billing", job_mark="j1")
    assert refusal(gcp, JOB, T0) == "job j1 ran on AWS, not on this gcp-billing bill's cloud"
    late = line(usage_start=T0 + 5 * HOUR, usage_end=T0 + 6 * HOUR)
    assert "outside job j1's run" in (refusal(late, JOB, T0) or "")
    local = replace(JOB, launcher="local", instance_type="local:rtx4090")
    assert "no cloud bills it" in (refusal(line(), local, T0) or "")


def test_a_negative_line_books_only_as_a_credit_of_usage_and_never_below_zero() -> None:
    usage, credit = line(3.0), line(-1.0, line_id="c", line_type="Credit")
    tax_back = line(-1.0, line_id="t", line_type="Tax")
    too_much = line(-5.0, line_id="c2", line_type="Credit")
    booked, refused = booked_lines([usage, credit, tax_back, too_much])
    assert booked == [usage, credit]
    assert [(ln.line_id, why) for ln, why in refused] == [
        ("c2", "it would take the job's bill below zero"),  # taken by start, then id
        ("t", "a negative Tax line is no credit or refund"),
    ]
    assert booked_lines([credit])[1] == [(credit, "a credit for a job with no usage on this bill")]


def test_a_figure_far_past_the_reservation_is_held_until_accepted() -> None:
    assert held_reason(JOB, 20_000_000, None) is None  # 2 x the reservation: books
    assert held_reason(JOB, 20_000_001, None) == (
        "billed past 2 x its reservation or settlement: `bill accept j1`"
    )
    assert held_reason(JOB, 20_000_001, 25_000_000) is None


@pytest.mark.parametrize(
    "now, periods",
    [
        (NOV + 3 * 86400, ["2026-10", "2026-11"]),  # the closed month, for 15 days
        (NOV + 15 * 86400, ["2026-11"]),
        (DEC - 1, ["2026-11"]),
        (DEC, ["2026-11", "2026-12"]),
    ],
)
def test_periods_to_read(now: float, periods: list[str]) -> None:
    assert periods_to_read(now) == periods
    assert month_of(now) == periods[-1]


def test_book_trueup_replaces_the_settlement_by_the_bill_on_every_budget_on_the_path() -> None:
    rules = [
        BudgetRule("acme", period_budget_micro=100_000_000, period="month"),
        BudgetRule("acme/nlp", period_budget_micro=50_000_000, period="month"),
        BudgetRule("other", period_budget_micro=1, period="month"),
    ]
    billed = [(3_000_000, T0, T0 + HOUR), (2_000_000, T0 + HOUR, T0 + 2 * HOUR)]
    moved = book_trueup("acme/nlp", billed, (4_000_000, T0, T0 + 2 * HOUR), rules)
    assert moved == {("acme", NOV): 1_000_000, ("acme/nlp", NOV): 1_000_000}
    same = book_trueup(
        "acme/nlp", [(4_000_000, T0, T0 + 2 * HOUR)], (4_000_000, T0, T0 + 2 * HOUR), rules
    )
    assert same == {}

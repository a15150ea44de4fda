"""A line moves money only where it can be true: a marked line books its job only if that
cloud ran the job, within the line's window (an hour's slack); a negative line only as a
credit of a job with usage on the bill, never below zero; an enormous figure is held for an
admin (an event), and accepted. What is not booked is listed apart with its reason. Every
budget is read after each import. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.lines import BillError
from prefect_gpu_budget.billing.results import summary
from tests.billing.fixtures import HOUR, VERTEX_JOB, bill_line, settled_job

NOV = 1793491200.0  # 2026-11-01T00:00Z
START = NOV + 3 * 86400 + 10 * HOUR
NOW = NOV + 40 * 86400
SCOPES = ("lab", "lab/a", "lab/a/s1", "lab/b", "lab/b/s2")


@pytest.fixture
def lab(ledger):
    for scope in SCOPES:
        ledger.config.set_budget(
            BudgetRule(scope, period_budget_micro=10**9, period="month"), now=NOV + 60
        )
    return ledger


def _budgets(ledger) -> dict[str, int]:
    month = periods.bounds("month", "UTC", START)[0]
    return {scope: ledger.views.period_settled(scope, month) for scope in SCOPES}


def _import(ledger, lines, source="aws-cur2"):
    return ledger.bills.import_bill(source, "2026-11", lines, provisional_hours=0, now=NOW)


def _refused(ledger) -> dict[str, str]:
    return {line["line_id"]: line["reason"] for line in ledger.bills.drift()["refused"]}


@pytest.mark.parametrize(
    "job, source, said",
    [
        ({"launcher": "local", "instance_type": "local:box"}, "gcp-billing", "no cloud bills it"),
        ({"launcher": "task", "instance_type": "local:box"}, "aws-cur2", "no cloud bills it"),
        (VERTEX_JOB, "aws-cur2", "ran on GCP, not on this aws-cur2 bill's cloud"),
        ({"launcher": "sagemaker:lab"}, "gcp-billing", "ran on AWS"),
        (
            {"launcher": "deployment:gpu", "instance_type": "local:box"},
            "aws-cur2",
            "no cloud bills it",
        ),
        (
            {"launcher": "worker:gpu-budget-process", "instance_type": "gcp:a2-highgpu-1g"},
            "gcp-billing",
            "no cloud bills it",
        ),
    ],
)
def test_a_line_of_a_job_no_such_cloud_ran_moves_nothing(lab, job, source, said) -> None:
    row = settled_job(lab, "lab/a/s1", START, 1, **job)
    before = _budgets(lab)
    line = bill_line(row["id"], START, 1, "-4.00", line_type="Credit", source=source)
    usage = bill_line(row["id"], START, 1, "2.00", source=source, line_id="u")
    done = _import(lab, [line, usage], source)
    assert done.refused == 2 and done.refused_micro == -2_000_000 and done.booked_micro == 0
    assert _budgets(lab) == before
    assert all(said in reason for reason in _refused(lab).values()), _refused(lab)
    assert lab.bills.drift()["jobs"] == []


@pytest.mark.parametrize(
    "job, source",
    [
        ({"launcher": "deployment:gpu", "instance_type": "gcp:a2-highgpu-1g"}, "gcp-billing"),
        ({"launcher": "worker:ecs", "instance_type": "local:box"}, "aws-cur2"),
        (VERTEX_JOB, "gcp-billing"),
    ],
)
def test_a_line_of_a_job_that_cloud_ran_is_booked(lab, job, source) -> None:
    row = settled_job(lab, "lab/a/s1", START, 1, **job)
    done = _import(lab, [bill_line(row["id"], START, 1, "2.50", source=source)], source)
    assert done.refused == 0 and done.jobs_final == 1
    assert _budgets(lab)["lab/a/s1"] == 2_500_000


def test_a_line_outside_the_jobs_run_moves_nothing(lab) -> None:
    row = settled_job(lab, "lab/a/s1", START, 1)  # 10:00-11:00
    other = settled_job(lab, "lab/b/s2", START + 5 * HOUR, 1)  # another session's, later
    before = _budgets(lab)
    lines = [
        bill_line(row["id"], START - 30 * HOUR, 1, "9.00", line_id="day-before"),
        bill_line(row["id"], START + 3 * HOUR, 1, "9.00", line_id="after"),
        bill_line(other["id"], START, 1, "9.00", line_id="someone-elses"),
        bill_line(row["id"], START - 0.5 * HOUR, 1, "1.00", line_id="its-hour"),  # in slack
    ]
    done = _import(lab, lines)
    refused = _refused(lab)
    assert set(refused) == {"day-before", "after", "someone-elses"}
    assert all("outside job" in why for why in refused.values()), refused
    assert done.refused_micro == 27_000_000
    after = _budgets(lab)
    assert after["lab/a/s1"] == 1_000_000 and after["lab/b/s2"] == before["lab/b/s2"]
    assert after["lab"] == before["lab"] - 3_600_000 + 1_000_000
    assert "3 line(s) refused, $27.00" in summary(done)


def test_a_sagemaker_line_of_another_training_job_moves_nothing(lab) -> None:
    row = settled_job(lab, "lab/a/s1", START, 1, external_id="sweep-0001")
    arn = "arn:aws:sagemaker:us-east-1:111111111111:training-job/sweep-0002"
    _import(lab, [bill_line(row["id"], START, 1, "5.00", resource_id=arn)])
    assert "training job sweep-0002" in next(iter(_refused(lab).values()))
    assert _budgets(lab)["lab/a/s1"] == 3_600_000


def test_negative_lines_only_credit_a_job_with_usage_and_never_below_zero(lab) -> None:
    row = settled_job(lab, "lab/a/s1", START, 1)
    bare = settled_job(lab, "lab/b/s2", START, 1)
    lines = [
        bill_line(row["id"], START, 1, "3.00", line_id="use"),
        bill_line(row["id"], START, 1, "-1.00", line_type="Credit", line_id="credit"),
        bill_line(row["id"], START, 1, "-2.50", line_type="Refund", line_id="refund"),
        bill_line(row["id"], START, 1, "-0.50", line_id="negative-usage"),
        bill_line(bare["id"], START, 1, "-4.00", line_type="Credit", line_id="no-usage"),
    ]
    done = _import(lab, lines)
    refused = _refused(lab)
    assert refused == {
        "refund": "it would take the job's bill below zero",
        "negative-usage": "a negative Usage line is no credit or refund",
        "no-usage": "a credit for a job with no usage on this bill",
    }
    assert done.refused_micro == -7_000_000
    budgets = _budgets(lab)
    assert budgets["lab/a/s1"] == 2_000_000 and budgets["lab/b/s2"] == 3_600_000
    assert all(b >= 0 for b in budgets.values())


def test_an_enormous_bill_is_held_for_an_admin_and_booked_once_accepted(
    lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = settled_job(lab, "lab/a/s1", START, 10 / 3600)  # a 10-second job
    before = _budgets(lab)
    done = _import(lab, [bill_line(row["id"], START, 1 / 360, "999999999")])
    [held] = done.held
    assert held.job_id == row["id"] and held.billed_micro == 999_999_999_000_000
    assert f"bill accept {row['id']}" in held.reason and "held for an admin" in summary(done)
    assert _budgets(lab) == before and done.booked_micro == 0
    [entry] = lab.bills.drift()["jobs"]
    assert entry["figure"] == "held" and "reservation" in entry["reason"]
    again = _import(lab, [bill_line(row["id"], START, 1 / 360, "999999999")])
    assert again.held == [] and not again.changed  # told once
    sent: list[dict] = []
    from prefect_gpu_budget.flows import bill_import

    monkeypatch.setattr(bill_import, "emit_event", lambda **kw: sent.append(kw))
    bill_import.announce_held(lab, done.held)
    assert [e["event"] for e in sent] == ["gpu-budget.bill.held"]
    assert sent[0]["resource"]["gpu-budget.scope"] == "lab/a/s1"
    accepted = lab.bills.accept(row["id"], now=NOW)
    assert accepted.moved["lab"] == 999_999_999_000_000 - row["actual_micro"]
    assert lab.bills.drift()["jobs"][0]["figure"] == "final"
    with pytest.raises(BillError, match="no bill of it is held"):
        lab.bills.accept(row["id"], now=NOW)
    unchanged = _import(lab, [bill_line(row["id"], START, 1 / 360, "999999999")])
    assert unchanged.held == [] and unchanged.booked_micro == 0

"""Each line of a bill booked once, whatever the files, copies and deliveries it comes in: a
copy of an export in the same import (another file name), the same lines re-delivered under
another invoice month or billing period, and `forget`, which takes an import out whole. Every
budget is read after each step. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.files import read_bill_files
from prefect_gpu_budget.billing.imports import import_lines
from prefect_gpu_budget.billing.lines import BillError
from prefect_gpu_budget.billing.results import summary
from tests.billing import fixtures
from tests.support.jobs import ran_job

NOV = periods.bounds("month", "UTC", 1793750400.0)[0]  # 2026-11-01T00:00Z
SCOPES = ("lab", "lab/vision", "lab/vision/s1")


@pytest.fixture
def lab(ledger):
    for scope, usd in (("lab", 1000), ("lab/vision", 500), ("lab/vision/s1", 100)):
        ledger.config.set_budget(
            BudgetRule(scope, period_budget_micro=usd * 10**6, period="month"), now=NOV + 60
        )
    return ledger


def _budgets(ledger) -> dict[str, int]:
    return {scope: ledger.views.period_settled(scope, NOV) for scope in SCOPES}


def _gcp_export(path: Path, job: str, month: str = "202611") -> Path:
    rows = fixtures.gcp_rows()
    for row in rows:
        row["invoice"] = {"month": month}
    text = "".join(json.dumps(row) + "\n" for row in rows)
    path.write_text(text.replace(fixtures.GCP_JOB, job))
    return path


def _vertex_job(ledger) -> str:
    return ran_job(
        ledger,
        "lab/vision/s1",
        "2026-11-03T10:00:00Z",
        "2026-11-03T11:00:00Z",
        3.673,
        **fixtures.VERTEX_JOB,
    )


def _import(ledger, paths, **kw):
    lines = read_bill_files(paths)
    return import_lines(ledger.bills, lines, read_from="test", provisional_hours=0, **kw)


def test_a_copy_of_an_export_in_the_same_import_is_booked_once(lab, tmp_path: Path) -> None:
    job = _vertex_job(lab)
    export = _gcp_export(tmp_path / "gcp-export.jsonl", job)
    [alone] = _import(lab, [export])
    once = _budgets(lab)
    assert once == dict.fromkeys(SCOPES, 2_830_000)  # $3.52 - $1.10 + $0.41, not $3.673
    copy = tmp_path / "gcp-export (1).jsonl"
    copy.write_bytes(export.read_bytes())
    [both] = _import(lab, [export, copy])  # a glob that caught a re-download
    assert _budgets(lab) == once
    assert both.twice == 3 and not both.changed and both.lines == 3
    said = summary(both)
    assert "3 line(s) read twice, booked once" in said and "gcp-export (1).jsonl" in said
    assert [j["billed_micro"] for j in lab.bills.drift()["jobs"]] == [2_830_000]
    assert alone.drift_micro == 2_830_000 - 3_673_000


def test_a_redelivery_under_another_invoice_month_is_not_booked_again(lab, tmp_path: Path) -> None:
    job = _vertex_job(lab)
    _import(lab, [_gcp_export(tmp_path / "nov.jsonl", job)])
    once = _budgets(lab)
    [again] = _import(lab, [_gcp_export(tmp_path / "dec.jsonl", job, month="202612")])
    assert again.billing_period == "2026-12" and again.copies == {"2026-11": 3}
    assert "3 line(s) already held under gcp-billing 2026-11: not booked again" in summary(again)
    assert _budgets(lab) == once
    copies = lab.bills.drift()["copy"]
    assert len(copies) == 3
    assert {c["reason"] for c in copies} == {"already held under gcp-billing 2026-11"}
    # both at once, in one read: the earlier period holds them, the other is the copy
    both = _import(
        lab,
        [_gcp_export(tmp_path / "a.jsonl", job), _gcp_export(tmp_path / "b.jsonl", job, "202612")],
    )
    assert [b.changed for b in both] == [False, False] and _budgets(lab) == once


def test_a_cur_line_redelivered_under_another_period_is_not_booked_again(lab) -> None:
    start = NOV + 2 * fixtures.HOUR
    job = fixtures.settled_job(lab, "lab/vision/s1", start, 1)  # $3.60
    line = fixtures.bill_line(job["id"], start, 1, "5.00", line_id="li-1/2026-11-01T02")
    lab.bills.import_bill("aws-cur2", "2026-11", [line], provisional_hours=0, now=NOV + 40 * 86400)
    once = _budgets(lab)
    assert once == dict.fromkeys(SCOPES, 5_000_000)
    moved = replace(line, billing_period="2026-12")
    done = lab.bills.import_bill(
        "aws-cur2", "2026-12", [moved], provisional_hours=0, now=NOV + 40 * 86400
    )
    assert done.copies == {"2026-11": 1} and done.booked_micro == 0
    assert _budgets(lab) == once


def test_forget_takes_an_import_out_whole_and_restores_the_settlement(lab, tmp_path: Path) -> None:
    job = _vertex_job(lab)
    settled = _budgets(lab)
    assert settled == dict.fromkeys(SCOPES, 3_673_000)
    _import(lab, [_gcp_export(tmp_path / "nov.jsonl", job)])
    _import(lab, [_gcp_export(tmp_path / "dec.jsonl", job, month="202612")])
    forgot = lab.bills.forget("gcp-billing", "2026-12")  # the copies: nothing moves
    assert forgot.booked_micro == 0 and _budgets(lab) == dict.fromkeys(SCOPES, 2_830_000)
    forgot = lab.bills.forget("gcp-billing", "2026-11")
    assert forgot.lines == 3 and forgot.drift_micro == 3_673_000 - 2_830_000
    assert forgot.moved == dict.fromkeys(SCOPES, 843_000)
    assert _budgets(lab) == settled
    drift = lab.bills.drift()
    assert drift["jobs"] == [] and drift["copy"] == [] and drift["imports"] == []
    with pytest.raises(BillError, match="no import of it to forget"):
        lab.bills.forget("gcp-billing", "2026-11")
    [back] = _import(lab, [_gcp_export(tmp_path / "dec.jsonl", job, month="202612")])
    assert back.copies == {} and _budgets(lab) == dict.fromkeys(SCOPES, 2_830_000)

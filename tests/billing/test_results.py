"""What an import did (billing/results.py), as people read it (`summary`, `held_line`,
`over_line`) and as `bill import --json` prints it (`as_json`)."""

from __future__ import annotations

from datetime import datetime, timezone

from prefect_gpu_budget.billing.results import (
    BillImport,
    HeldBill,
    OverByBill,
    as_json,
    fmt_utc,
    held_line,
    over_line,
    summary,
)

NOV = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()
DEC = datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
HELD = HeldBill("j1", "acme/nlp", 90_000_000, "billed past 2 x its reservation")
OVER = OverByBill("acme", NOV, DEC, 100_000_000, 101_500_000)
DONE = BillImport(
    "aws-cur2",
    "2026-11",
    lines=7,
    changed=True,
    jobs_final=2,
    jobs_provisional=1,
    drift_micro=1_500_000,
    booked_micro=3_000_000,
    moved={"acme": 1_500_000, "acme/nlp": 1_500_000},
    over_by_bill=[OVER],
    twice=1,
    twice_where="b.csv, row 2 (as a.csv, row 2)",
    copies={"2026-10": 2},
    held=[HELD],
    untagged_micro=250_000,
    provisional={"usage ended less than 48 h ago": 1},
)


def test_a_changed_import_says_its_figures_then_what_it_booked_once() -> None:
    assert summary(DONE) == (
        "aws-cur2 2026-11: 7 lines; 2 job(s) final, 1 provisional (usage ended less than 48 h "
        "ago); 1 line(s) read twice, booked once (e.g. b.csv, row 2 (as a.csv, row 2)); "
        "2 line(s) already held under aws-cur2 2026-10: not booked again; 1 job(s) held for an "
        "admin to accept (`bill accept`); drift booked $1.50; budgets moved: acme $1.50, "
        "acme/nlp $1.50; untagged $0.25"
    )


def test_an_unchanged_import_says_so() -> None:
    same = BillImport("gcp-billing", "2026-11", lines=3, changed=False)
    assert summary(same) == "gcp-billing 2026-11: 3 lines, unchanged since the last import"


def test_a_held_figure_and_a_period_over_by_bill_in_one_line_each() -> None:
    assert held_line(HELD) == (
        "held: job j1 (acme/nlp) billed $90.00, billed past 2 x its reservation"
    )
    assert fmt_utc(NOV + 90) == "2026-11-01 00:01 UTC"
    assert over_line(OVER) == (
        "over by bill: acme spent $101.50 of its $100.00 budget in the period from "
        "2026-11-01 00:00 UTC to 2026-12-01 00:00 UTC"
    )


def test_as_json_in_dollars() -> None:
    out = as_json(DONE)
    assert out["drift_usd"] == 1.5 and out["moved_usd"] == {"acme": 1.5, "acme/nlp": 1.5}
    assert out["held"] == [
        {"job_id": "j1", "scope": "acme/nlp", "billed_usd": 90.0, "reason": HELD.reason}
    ]
    assert out["over_by_bill"] == [{"scope": "acme", "budget_usd": 100.0, "spent_usd": 101.5}]
    assert (out["read_twice"], out["copies"], out["lines"]) == (1, {"2026-10": 2}, 7)

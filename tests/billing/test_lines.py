"""One line of a bill (billing/lines.py): its money in micro-dollars (`to_micro`), what makes
two lines one (`BillLine.content`), usage against the account (`BillLine.usage`), and the
one-line error a bad export gets (`BillError`)."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from prefect_gpu_budget.billing.lines import SOURCES, BillError, BillLine, to_micro
from prefect_gpu_budget.units import BudgetInputError

LINE = BillLine(
    source="aws-cur2",
    billing_period="2026-11",
    line_id="l1",
    line_type="Usage",
    usage_start=0.0,
    usage_end=3600.0,
    billed_micro=1_500_000,
    currency="USD",
    where="a.csv, row 1",
)


@pytest.mark.parametrize(
    "value, micro",
    [("1.5", 1_500_000), (2, 2_000_000), (Decimal("0.0000005"), 1), ("-0.25", -250_000)],
)
def test_to_micro_rounds_half_up(value: object, micro: int) -> None:
    assert to_micro(value, "a.csv", "cost", 3) == micro


@pytest.mark.parametrize("value", [None, "NaN", True, "1e9", "twelve"])
def test_to_micro_refuses_what_is_no_amount(value: object) -> None:
    with pytest.raises(BillError, match=r"a\.csv, column cost, row 3") as raised:
        to_micro(value, "a.csv", "cost", 3)
    assert raised.value.column == "cost" and raised.value.row == 3
    assert isinstance(raised.value, BudgetInputError)  # bad input: the CLI exits 2


def test_lines_alike_but_where_they_were_read_are_one_line() -> None:
    again = replace(LINE, where="copy.csv, row 9", currency="usd")
    assert again.content == LINE.content
    assert replace(LINE, billed_micro=1).content != LINE.content


def test_usage_lines_against_account_lines() -> None:
    assert LINE.usage and replace(LINE, line_type="regular").usage
    assert not replace(LINE, line_type="Tax").usage
    assert not replace(LINE, line_type="Credit").usage
    assert SOURCES == ("aws-cur2", "gcp-billing")

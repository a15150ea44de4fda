"""Calendar periods (admission/rules/periods.py): their bounds in a time zone, and money shared
between the periods a span touches, exactly, a negative amount (a credit) included."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.units import BudgetInputError


def _utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


def test_bounds_follow_the_calendar_and_the_time_zone():
    t = _utc(2026, 11, 30, 23, 30)
    assert periods.bounds("month", "UTC", t) == (_utc(2026, 11, 1), _utc(2026, 12, 1))
    assert periods.bounds("day", "UTC", t) == (_utc(2026, 11, 30), _utc(2026, 12, 1))
    assert periods.bounds("week", "UTC", t)[0] == _utc(2026, 11, 30)  # a Monday
    tokyo = periods.bounds("month", "Asia/Tokyo", t)  # 08:30 on 1 December there
    assert tokyo == (_utc(2026, 11, 30, 15), _utc(2026, 12, 31, 15))


def test_a_span_over_midnight_is_shared_by_the_time_in_each_day():
    midnight = _utc(2026, 12, 3)
    shares = periods.split(9_000_000, midnight - 3600, midnight + 7200, "day", "UTC")
    assert shares == ((midnight - 86400, 3_000_000), (midnight, 6_000_000))


@given(
    amount=st.integers(min_value=-(10**12), max_value=10**12),
    start=st.floats(min_value=1.7e9, max_value=1.8e9),
    hours=st.floats(min_value=0, max_value=24 * 90),
)
def test_shares_always_sum_to_the_amount(amount: int, start: float, hours: float):
    shares = periods.split(amount, start, start + hours * 3600, "day", "UTC")
    assert sum(share for _, share in shares) == amount
    assert [p for p, _ in shares] == sorted(p for p, _ in shares)


def test_an_unknown_period_or_zone_is_a_one_line_error():
    with pytest.raises(BudgetInputError, match="period"):
        periods.bounds("fortnight", "UTC", 0.0)
    with pytest.raises(BudgetInputError, match="unknown time zone"):
        periods.bounds("day", "Mars/Olympus", 0.0)

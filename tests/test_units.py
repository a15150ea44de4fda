from __future__ import annotations

import random
from decimal import Decimal

import pytest

from prefect_gpu_budget.units import (
    BudgetInputError,
    cost_micro,
    org_of,
    parse_duration,
    rate_cents,
    scope_path,
    to_decimal_usd,
    usd_to_micro,
    validate_scope,
)


def test_money_is_exact_over_a_million_settlements():
    rng = random.Random(7)
    rates = [usd_to_micro(Decimal(p)) for p in ("21.958", "1.006", "0.8048", "63.296")]
    total_micro, total_decimal = 0, Decimal(0)
    for _ in range(1_000_000):
        rate, seconds = rng.choice(rates), rng.randint(1, 7200)
        total_micro += cost_micro(rate, seconds, round_up=False)
        total_decimal += (Decimal(rate) * seconds / 3600).quantize(
            Decimal(1), rounding="ROUND_HALF_UP"
        )
    assert total_micro == total_decimal


def test_rates_round_up_to_a_whole_cent_and_at_least_one():
    assert rate_cents(usd_to_micro(Decimal("21.958"))) == 2196
    assert rate_cents(1) == 1
    assert cost_micro(3_600_000, 1, round_up=True) == 1000


def test_durations():
    assert parse_duration("1h30m", "d") == 5400
    assert parse_duration("2d", "d") == 172800
    assert parse_duration(90, "d") == 90
    assert parse_duration("0", "w", allow_zero=True) == 0
    # Slurm's forms, as in `--time`: M:S, H:M:S, D-H, D-H:M, D-H:M:S
    for slurm, seconds in (
        ("90:00", 5400),
        ("02:00:00", 7200),
        ("1-00", 86400),
        ("1-12:30", 131400),
        ("2-00:00:01", 172801),
    ):
        assert parse_duration(slurm, "d") == seconds, slurm
    for bad in ("", "1y", "-5", "1h-", "nan", "inf", "31d", float("nan"), True, None) + (
        "1:2:3:4",
        "1-2-3",
        ":30",
        "31-00:00:00",
    ):
        with pytest.raises(BudgetInputError):
            parse_duration(bad, "d")


def test_scopes():
    assert scope_path("a/b/c") == ("a", "a/b", "a/b/c")
    assert [org_of(s) for s in ("acme", "acme/vision", "acme/vision/agent-7")] == ["acme"] * 3
    assert validate_scope("acme/vision/agent-7") == "acme/vision/agent-7"
    for bad in ("", "a/b/c/d", "A", "a//b", "../etc", "a/b/", "аcme", "a:b", "x" * 49, "a;drop"):
        with pytest.raises(BudgetInputError):
            validate_scope(bad)


def test_amounts():
    assert to_decimal_usd("$12.50", "x") == Decimal("12.50")
    for bad in ("nan", "inf", "-1", "1e10", "abc", True, None):
        with pytest.raises(BudgetInputError):
            to_decimal_usd(bad, "x")


def test_priority_classes_are_named_and_configurable(monkeypatch):
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.priorities import PRIORITY_CLASSES_ENV

    job = {"instance_type": "aws:g5.xlarge", "max_runtime": "1h"}
    assert GpuJob(**job, priority="low").priority == -100
    monkeypatch.setenv(PRIORITY_CLASSES_ENV, "urgent=500, scavenger=-500")
    assert GpuJob(**job, priority="urgent").priority == 500
    assert GpuJob(**job, priority="scavenger").priority < GpuJob(**job, priority="low").priority
    with pytest.raises(ValueError, match="urgent, high, normal, low, scavenger"):
        GpuJob(**job, priority="Whenever!")
    assert GpuJob(**job, priority="whenever").priority == "whenever"  # an org's own, maybe
    monkeypatch.setenv(PRIORITY_CLASSES_ENV, "urgent=5000")
    with pytest.raises(ValueError, match="-1000..1000"):
        GpuJob(**job, priority="urgent")


@pytest.mark.parametrize(
    ("micro", "shown_as"),
    [
        (0, "$0.00"),
        (1, "$0.000001"),
        (8_500, "$0.0085"),
        (123_456, "$0.1235"),
        (500_000, "$0.50"),
        (1_000_000, "$1.00"),
        (12_345_678, "$12.35"),
        (123_456_789_000, "$123,456.79"),
        (-2_150, "-$0.00215"),  # a credit, a drift below the settlement: the sign first
        (-5_000_000, "-$5.00"),
        (-1_234_567_890, "-$1,234.57"),
    ],
)
def test_dollars_show_cents_from_a_dollar_up_and_four_significant_digits_below(micro, shown_as):
    from prefect_gpu_budget.units import fmt_usd

    assert fmt_usd(micro) == shown_as

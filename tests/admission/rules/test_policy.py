"""The policy's terms (admission/rules/policy.py): what a hold counts in a period, what estimate
mode learns, and a job's max wait."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timezone

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import (
    BudgetRule,
    Hold,
    held_in,
    max_wait_of,
    overrun_factor,
    overrun_factors,
    wait_deadline,
)

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()


def test_a_hold_counts_in_the_periods_it_spans_and_whole_until_it_starts():
    late = datetime(2026, 11, 30, 23, 30, tzinfo=timezone.utc).timestamp()
    rule = BudgetRule("o", period_budget_micro=10**9, period="day")
    today, tomorrow = periods.bounds(rule.period, rule.timezone, late)
    hold = Hold("o", 100, 1_000_001, late, late + 3600)
    assert (held_in(hold, late, rule, today), held_in(hold, late, rule, tomorrow)) == (
        500_000,
        500_001,
    )
    unstarted = replace(hold, started=False)  # a late start may spend it all in either day
    assert held_in(unstarted, late, rule, tomorrow) == 1_000_001


def test_overrun_factor_is_a_high_quantile_of_settled_jobs_never_below_one():
    assert overrun_factor([2.0] * 19) is None  # too few jobs to learn from
    assert overrun_factor([float(i) for i in range(100, 0, -1)]) == 90.0  # nearest rank
    assert overrun_factor([0.5] * 50) == 1.0  # never less than the user's own estimate
    recent = [("o/a/s", 3.0)] * 30 + [("o/b/s", 1.5)] * 300  # most recent first
    factors = overrun_factors(recent, window=200)
    # o learns from its last 200 jobs, 30 of which (over 10%) ran three times their estimate
    assert factors == {"o/a/s": 3.0, "o/a": 3.0, "o/b/s": 1.5, "o/b": 1.5, "o": 3.0}
    assert overrun_factors(recent[:10] + recent[30:], window=200)["o"] == 1.5


def test_a_job_waits_its_own_max_wait_else_its_deepest_budgets():
    rules = [BudgetRule("o", max_wait_s=60.0), BudgetRule("o/t", max_wait_s=30.0)]
    assert max_wait_of(None, rules) == 30.0 and max_wait_of(5.0, rules) == 5.0
    assert max_wait_of(None, []) == 0.0  # no budget: it waits for ever
    assert wait_deadline(NOW, 30.0) == NOW + 30.0 and wait_deadline(NOW, 0.0) == math.inf

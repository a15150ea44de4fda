"""The money rules: what a job costs and where its money lands (admission/rules/accounting.py).

Table tests of the cost rule and of period booking, then the ledger, the audit and the simulator
counting one small scenario the same way, to the micro-dollar.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission import audit
from prefect_gpu_budget.admission.ledger import period_spend
from prefect_gpu_budget.admission.rules.accounting import (
    book,
    incurred_span,
    period_shares,
    row_spend,
    settled_cost,
    settled_in_period,
)
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.sweeps.simulator import SimJob, simulate
from tests.support.jobs import new_job


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=timezone.utc).timestamp()


FEB = utc(2027, 2, 1)
"""A month boundary in UTC (Monday 2027-02-01 00:00)."""
RATE = 3_600_000
"""$3.60 an hour: a thousand micro-dollars a second."""


# -- the cost rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "started", "ended", "billed", "actual", "want"),
    [
        (RATE, None, 100.0, None, None, (0.0, 0)),  # never started: nothing spent
        (RATE, None, 100.0, 30.0, 999, (0.0, 0)),  # never started: whatever was reported
        (RATE, 10.0, 100.0, None, None, (90.0, 90_000)),  # billed: end - start
        (RATE, 10.0, 100.0, 30.0, None, (30.0, 30_000)),  # billed seconds given
        (RATE, 10.0, 100.0, None, 5, (90.0, 5)),  # the cloud's amount given
        (RATE, 10.0, 100.0, 30.0, 5, (30.0, 5)),  # both given
        (RATE, 100.0, 90.0, None, None, (0.0, 0)),  # an end before the start bills nothing
        (1, 0.0, 1800.0, None, None, (1800.0, 1)),  # half a micro-dollar rounds up
        (1, 0.0, 1799.9, None, None, (1799.9, 0)),  # under half rounds down
        (1_006_000, 0.0, 1.0, None, None, (1.0, 279)),  # 279.44 micro-dollars
    ],
)
def test_what_a_job_costs(rate, started, ended, billed, actual, want) -> None:
    assert settled_cost(rate, started, ended, billed, actual) == want


@pytest.mark.parametrize(
    ("started", "ended", "want"),
    [
        (None, 50.0, (50.0, 50.0)),  # never started: at the instant it ended
        (10.0, 50.0, (10.0, 50.0)),
        (60.0, 50.0, (60.0, 60.0)),  # never backwards
    ],
)
def test_where_a_cost_is_incurred(started, ended, want) -> None:
    assert incurred_span(started, ended) == want


def test_a_row_books_as_its_settlement_did() -> None:
    settled = {"actual_micro": 7, "started_at": 10.0, "ended_at": 50.0, "settled_at": 51.0}
    assert row_spend(settled) == (7, 10.0, 50.0)
    unrun = {"actual_micro": None, "started_at": None, "ended_at": None, "settled_at": 51.0}
    assert row_spend(unrun) == (0, 51.0, 51.0)  # ended without running: no end of its own


# -- period booking ----------------------------------------------------------------------------


MONTH = BudgetRule("org", period_budget_micro=10**9, period="month", timezone="UTC")
DAY_NY = BudgetRule(
    "org/team", period_budget_micro=10**9, period="day", timezone="America/New_York"
)
CAP_ONLY = BudgetRule("org/team/s1", hourly_cap_cents=1000)
SIBLING = BudgetRule("org/other", period_budget_micro=10**9)
ELSEWHERE = BudgetRule("acme", period_budget_micro=10**9)
RULES = [MONTH, DAY_NY, CAP_ONLY, SIBLING, ELSEWHERE]
JAN = utc(2027, 1, 1)
JAN31_NY = utc(2027, 1, 31, 5)  # midnight in New York
FEB1_NY = utc(2027, 2, 1, 5)


@pytest.mark.parametrize(
    ("amount", "start", "end", "rule", "want"),
    [
        (100, FEB - 7200, FEB - 3600, MONTH, ((JAN, 100),)),  # inside one period
        (100, FEB - 3600, FEB - 3600, MONTH, ((JAN, 100),)),  # no time: where it started
        (100, FEB - 3600, FEB - 7200, MONTH, ((JAN, 100),)),  # backwards: where it started
        (2_000_001, FEB - 3600, FEB + 3600, MONTH, ((JAN, 1_000_000), (FEB, 1_000_001))),
        (3, FEB - 3600, FEB + 7200, MONTH, ((JAN, 1), (FEB, 2))),  # shares sum exactly
        (100, FEB, FEB + 60, MONTH, ((FEB, 100),)),  # the boundary belongs to the next period
        # one New York day ends at 05:00 UTC: the same job, other boundaries
        (900, FEB - 3600, FEB + 3600, DAY_NY, ((JAN31_NY, 900),)),
        (900, FEB1_NY - 1800, FEB1_NY + 3600, DAY_NY, ((JAN31_NY, 300), (FEB1_NY, 600))),
    ],
)
def test_how_a_budget_s_periods_share_a_cost(amount, start, end, rule, want) -> None:
    assert period_shares(amount, start, end, rule) == want


def test_every_period_budget_on_the_path_counts_the_whole_cost() -> None:
    start, end = FEB - 3600, FEB1_NY + 3600  # 7 hours across a month's and a day's boundary
    booked = book("org/team/s1", 7_000_000, start, end, RULES)
    assert booked == {
        ("org", JAN): 1_000_000,  # 23:00 to 00:00 UTC
        ("org", FEB): 6_000_000,
        ("org/team", JAN31_NY): 6_000_000,  # 18:00 to 24:00 in New York
        ("org/team", FEB1_NY): 1_000_000,
    }  # the capped session without a period budget, its sibling and another org: nothing
    assert book("org/team/s1", 7_000_000, start, end, {r.scope: r for r in RULES}) == booked
    assert book("org/team", 7_000_000, start, end, RULES) == booked  # the team's own job
    assert book("org", 5, start, start, RULES) == {("org", JAN): 5}
    assert book("acme/x", 5, start, end, [MONTH, DAY_NY]) == {}  # no budget on its path
    assert book("organic", 5, start, end, RULES) == {}  # a prefix is not a parent


def test_a_period_s_total_is_what_booking_put_there() -> None:
    spends = [(7_000_000, FEB - 3600, FEB1_NY + 3600), (10, FEB + 60, FEB + 120), (0, FEB, FEB)]
    for rule in (MONTH, DAY_NY):
        booked: dict[float, int] = {}
        for spend in spends:
            for (_, p_start), share in book(rule.scope, *spend, [rule]).items():
                booked[p_start] = booked.get(p_start, 0) + share
        for p_start, total in booked.items():
            assert settled_in_period(spends, rule, p_start) == total
    assert settled_in_period(spends, MONTH, FEB) == 6_000_010
    assert settled_in_period(spends, DAY_NY, JAN31_NY) == 6_000_010  # 19:01 in New York
    assert settled_in_period(spends, MONTH, utc(2027, 3, 1)) == 0


# -- the ledger, the audit and the simulator agree --------------------------------------------


def test_ledger_audit_and_simulator_book_the_same_money(ledger) -> None:
    """Jobs across a month and a New York day boundary, run once in the simulator and once
    through the ledger (request, start, settle at the same times): the same spend per period."""
    rules = [
        BudgetRule("org", hourly_cap_cents=10**6, period_budget_micro=10**12, period="month"),
        BudgetRule(
            "org/team",
            hourly_cap_cents=10**6,
            period_budget_micro=10**12,
            period="day",
            timezone="America/New_York",
        ),
        BudgetRule("org/team/s1", hourly_cap_cents=10**6),
    ]
    jobs = [
        SimJob(f"j{i}", scope, arrival, rate, run, run, run)
        for i, (scope, arrival, rate, run) in enumerate(
            [
                ("org/team/s1", FEB1_NY - 7200.25, 1_006_000, 3 * 3600.5),
                ("org/team", FEB - 600, 27_447_001, 1200.0),
                ("org", JAN + 3600, 3_600_000, 60.0),
                ("org/team/s2", FEB1_NY + 10, 5_672_000, 0.001),
            ]
        )
    ]
    sim = simulate(jobs, rules, "guaranteed")
    assert all(r.admitted_at == r.job.arrival for r in sim.records)  # as the ledger will run them
    for rule in rules:
        ledger.config.set_budget(rule, now=JAN - 86400)
    for job in jobs:
        job_id, decision = ledger.queue.request(
            new_job(job.scope, rate_micro_per_hour=job.rate_micro_per_hour, max_runtime_s=1e5),
            now=job.arrival,
        )
        assert decision.verdict == "admit"
        ledger.settlements.mark_started(job_id, job.arrival)
        ended = job.arrival + job.true_s
        ledger.settlements.settle(
            job_id, ended_at=ended, outcome="completed", scope=job.scope, now=ended
        )

    expected = sim.spend_by_period()
    assert len(expected) == 4 and sum(expected.values()) == 2 * sum(
        r.actual_micro for r in sim.records if r.job.scope.startswith("org/team")
    ) + sum(r.actual_micro for r in sim.records if r.job.scope == "org")
    rows = ledger.views.jobs("org")
    assert sorted(r["actual_micro"] for r in rows) == sorted(r.actual_micro for r in sim.records)
    with ledger.db.engine.connect() as conn:
        held = {
            (scope, p_start): micro
            for scope, p_start, micro in conn.execute(
                sa.select(
                    period_spend.c.scope, period_spend.c.period_start, period_spend.c.settled_micro
                ).where(period_spend.c.settled_micro != 0)
            )
        }
    assert held == {key: micro for key, micro in expected.items() if micro}
    assert audit.charge_errors(ledger, rows, ledger.config.budgets()) == (0, 0, [])

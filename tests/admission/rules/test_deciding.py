"""The pure decision (admission/rules/deciding.py): order, holding, reasons, never-fits,
time-outs, period splits."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.deciding import decide, decide_behind, plan
from prefect_gpu_budget.admission.rules.policy import (
    BudgetRule,
    Hold,
    LedgerState,
    committed,
)
from prefect_gpu_budget.admission.rules.requests import Request

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()


def req(
    job_id: str, scope: str, cents: int = 100, priority: int = 0, at: float = 0.0, **kw
) -> Request:
    return Request(
        job_id=job_id,
        scope=scope,
        rate_micro_per_hour=cents * 10_000,
        rate_cents=cents,
        max_runtime_s=3600,
        expected_runtime_s=kw.pop("expected", None),
        priority=priority,
        requested_at=NOW - 100 + at,
        **kw,
    )


def state(*rules: BudgetRule, holds=(), settled=None) -> LedgerState:
    return LedgerState(NOW, {r.scope: r for r in rules}, list(holds), settled or {})


def test_admits_when_every_budget_on_the_path_fits():
    s = state(BudgetRule("o", hourly_cap_cents=300), BudgetRule("o/t", hourly_cap_cents=200))
    d = decide(s, [req("a", "o/t/s", 200)], "a")
    assert d.verdict == "admit"
    assert d.reserved_micro == 2_000_000 and d.reserve_seconds == 3600


def test_inner_cap_blocks_with_reason():
    s = state(
        BudgetRule("o", hourly_cap_cents=1000),
        BudgetRule("o/t", hourly_cap_cents=250),
        holds=[Hold("o/t/x", 200, 0, NOW - 10, NOW + 10)],
    )
    d = decide(s, [req("a", "o/t/s", 100)], "a")
    assert d.verdict == "wait" and d.limit == "hourly_cap" and d.scope == "o/t"
    assert "running $2.00/h + this job $1.00/h > cap $2.50/h" in d.reason


def test_period_budget_blocks_and_says_when_it_resets():
    s = state(
        BudgetRule("o", period_budget_micro=5_000_000, period="day"),
        settled={("o", periods.bounds("day", "UTC", NOW)[0]): 4_000_000},
    )
    d = decide(s, [req("a", "o", 200)], "a")
    assert d.verdict == "wait" and d.limit == "period_budget"
    assert "resets 2026-12-01 00:00 UTC" in d.reason
    assert d.resumes_at == datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()


def test_estimate_mode_reserves_the_expected_runtime():
    s = state(BudgetRule("o", period_budget_micro=10**9, reservation_mode="estimate"))
    d = decide(s, [req("a", "o", 100, expected=600)], "a")
    assert d.reserved_micro == 166_667 and d.reserve_seconds == 600  # $1/h for 10 min, rounded up
    strict = state(
        BudgetRule("o", period_budget_micro=10**9, reservation_mode="estimate"),
        BudgetRule("o/t", period_budget_micro=10**9, reservation_mode="guaranteed"),
    )
    assert decide(strict, [req("a", "o/t", 100, expected=600)], "a").reserve_seconds == 3600


def test_priority_then_arrival_and_no_backfill_past_a_blocked_head():
    s = state(BudgetRule("o", hourly_cap_cents=300), holds=[Hold("o", 100, 0, NOW, NOW + 1)])
    queue = [
        req("big", "o", 250, at=1),
        req("small", "o", 50, at=2),
        req("urgent", "o", 100, priority=100, at=3),
    ]
    out = plan(s, queue)
    assert out["urgent"].verdict == "admit"  # priority first: 100 + 100 <= 300
    assert out["big"].verdict == "wait" and out["big"].limit == "hourly_cap"
    assert "small" not in out  # the walk stops once the org is held
    small = decide(s, queue, "small")
    assert small.verdict == "wait" and small.limit == "queue"
    assert "waiting behind job big" in small.reason


def test_a_blocked_job_holds_only_the_scope_that_blocks_it():
    s = state(
        BudgetRule("o", hourly_cap_cents=1000),
        BudgetRule("o/a", hourly_cap_cents=100),
        holds=[Hold("o/a", 100, 0, NOW, NOW + 1)],
    )
    out = plan(s, [req("a1", "o/a", 100, at=1), req("b1", "o/b", 100, at=2)])
    assert out["a1"].verdict == "wait"
    assert out["b1"].verdict == "admit"


def test_never_fits_is_rejected_at_once():
    s = state(BudgetRule("o", hourly_cap_cents=100))
    d = decide(s, [req("a", "o", 101)], "a")
    assert d.verdict == "reject" and "alone exceeds the hourly cap" in d.reason
    s = state(BudgetRule("o", period_budget_micro=999_999, period="month"))
    assert decide(s, [req("a", "o", 100)], "a").verdict == "reject"


def test_no_budget_on_the_path_is_refused():
    d = decide(state(BudgetRule("other", hourly_cap_cents=1)), [req("a", "o/t")], "a")
    assert d.verdict == "reject" and d.limit == "no_budget"


def test_on_limit_reject_and_max_wait():
    held = [Hold("o", 100, 0, NOW, NOW + 1)]
    s = state(BudgetRule("o", hourly_cap_cents=100, on_limit="reject"), holds=held)
    assert decide(s, [req("a", "o", 100)], "a").verdict == "reject"
    s = state(BudgetRule("o", hourly_cap_cents=100, max_wait_s=50), holds=held)
    assert decide(s, [req("a", "o", 100)], "a").verdict == "timeout"  # waited 100 s
    assert decide(s, [req("a", "o", 100, max_wait_s=0)], "a").verdict == "wait"  # 0 = forever
    assert decide(s, [req("a", "o", 100, on_limit="reject")], "a").verdict == "reject"


def test_reservation_spanning_midnight_counts_in_both_days():
    late = datetime(2026, 11, 30, 23, 30, tzinfo=timezone.utc).timestamp()
    rule = BudgetRule("o", period_budget_micro=10**9, period="day")
    shares = periods.split(1_000_001, late, late + 3600, rule.period, rule.timezone)
    assert [s for _, s in shares] == [500_000, 500_001]
    assert sum(s for _, s in shares) == 1_000_001


def test_periods_in_a_time_zone_and_weeks_from_monday():
    t = datetime(2026, 11, 30, 3, 0, tzinfo=timezone.utc).timestamp()  # a Monday
    start, end = periods.bounds("day", "America/New_York", t)
    assert datetime.fromtimestamp(start, timezone.utc).hour == 5  # 00:00 EST, the 29th
    start, _ = periods.bounds("week", "UTC", t)
    assert datetime.fromtimestamp(start, timezone.utc).weekday() == 0
    start, end = periods.bounds("month", "UTC", t)
    assert datetime.fromtimestamp(end, timezone.utc).month == 12


def test_metering_counts_a_job_running_past_its_estimate():
    rule = BudgetRule("o", period_budget_micro=2_500_000, period="day", reservation_mode="estimate")
    # admitted 2 h ago with a 1 h estimate at $1/h: it has really spent $2 by now
    late = Hold("o", 100, 1_000_000, NOW - 7200, NOW - 3600, rate_micro_per_hour=1_000_000)
    assert committed(late, NOW) == (2_000_000, NOW - 7200, NOW)
    # with a max runtime of 3 h, it now commits its worst case
    capped = Hold("o", 100, 1_000_000, NOW - 7200, NOW - 3600, 1_000_000, max_end=NOW + 3600)
    assert committed(capped, NOW) == (3_000_000, NOW - 7200, NOW + 3600)
    metered = state(rule, holds=[late])
    assert decide(metered, [req("a", "o", 100, expected=3600)], "a").verdict == "wait"
    blind = LedgerState(NOW, {"o": rule}, [late], {}, metering=False)
    assert decide(blind, [req("a", "o", 100, expected=3600)], "a").verdict == "admit"


def test_plan_stops_once_every_org_is_held():
    s = state(BudgetRule("o", hourly_cap_cents=100), holds=[Hold("o", 100, 0, NOW, NOW + 1)])
    queue = [req(f"j{i}", "o/t", 100, at=i) for i in range(1000)]
    out = plan(s, queue)
    assert list(out) == ["j0"] and out["j0"].verdict == "wait"
    assert decide(s, queue, "j999").limit == "queue"


def test_estimate_mode_stretches_the_estimate_by_the_deepest_scope_that_learned():
    rule = BudgetRule("o", period_budget_micro=10**9, reservation_mode="estimate")
    s = LedgerState(NOW, {"o": rule}, [], {}, overrun={"o": 1.5, "o/t": 2.0})
    d = decide(s, [req("a", "o/t/s", 100, expected=600)], "a")
    assert d.reserve_seconds == 1200 and "estimate x2.00, as in o/t" in d.reason
    assert decide(s, [req("a", "o/u", 100, expected=600)], "a").reserve_seconds == 900
    s = replace(s, overrun={"o": 10.0})
    assert decide(s, [req("a", "o", 100, expected=600)], "a").reserve_seconds == 3600  # max


def test_estimate_mode_admits_only_where_the_worst_case_fits():
    day = periods.bounds("day", "UTC", NOW)[0]
    rule = BudgetRule("o", period_budget_micro=2_500_000, period="day", reservation_mode="estimate")
    s = state(rule, settled={("o", day): 1_800_000})
    d = decide(s, [req("a", "o", 100, expected=600)], "a")  # holds $0.17, $1.00 at worst
    assert d.verdict == "wait" and "this job at worst $1.00" in d.reason
    blind = replace(s, fit_worst_case=False)  # estimate-only admission
    assert decide(blind, [req("a", "o", 100, expected=600)], "a").verdict == "admit"
    s = state(replace(rule, period_budget_micro=900_000))
    d = decide(s, [req("a", "o", 100, expected=600)], "a")
    assert d.verdict == "reject" and "worst case $1.00 alone exceeds" in d.reason


def test_a_job_behind_a_blocked_waiter_is_decided_as_the_whole_queue_decides_it():
    """`decide_behind` (how the ledger decides a request that joins a deep queue) says what
    `decide` over the whole queue says, whatever the newcomer's on-limit or max wait."""
    rules = (
        BudgetRule("o", hourly_cap_cents=1000),
        BudgetRule("o/t", hourly_cap_cents=200, max_wait_s=3600),
    )
    full = state(*rules, holds=[Hold("o/t/x", 200, 0, NOW - 10, NOW + 10)])
    head = req("head", "o/t/a", 100, at=1)
    behind = [req(f"b{i}", "o/t/b", 100, at=2 + i) for i in range(5)]
    for new in (
        req("new", "o/t/c", 100, at=50),
        req("new", "o/t/c", 100, at=50, on_limit="reject"),
        req("new", "o/t/c", 100, at=50, max_wait_s=30),  # asked 50 s ago: its wait ran out
        req("new", "o/t/c", 5_000, at=50),  # over the cap itself: can never fit
    ):
        whole = decide(full, [head, *behind, new], "new")
        assert decide(full, [head], "head").blocks == ("o/t",)  # the head holds o/t
        alone = decide_behind(state(*rules), new, head, "o/t", "hourly_cap")
        assert alone == whole, (new, whole, alone)
    behind_head = decide_behind(state(*rules), behind[0], head, "o/t", "hourly_cap")
    assert behind_head.verdict == "wait"
    assert behind_head.reason.endswith("for the hourly cap of o/t ($2.00/h)")


def _pooled(*quotas, placed=(), nodes: int = 2, backfill: bool = False) -> LedgerState:
    from prefect_gpu_budget.admission.rules.quota import Pool

    pool = Pool("o", "lab", nodes, (8, 192, 2048), gpu_model="H100", backfill=backfill)
    return LedgerState(
        NOW,
        {"o": BudgetRule("o", period_budget_micro=10**12)},
        [],
        {},
        pools={"lab": pool},
        quotas={(q.pool, q.team): q for q in quotas},
        placed=list(placed),
    )


def _gpus(job_id: str, team: str, gpus: int = 8, nodes: int = 1, **kw) -> Request:
    from prefect_gpu_budget.admission.rules.quota import Shape

    shape = Shape("lab", team, (gpus, gpus * 24, gpus * 256), nodes)
    return req(job_id, f"{team}/s", shape=shape, **kw)


def test_jobs_within_nominal_quota_are_weighed_before_higher_priority_borrowers():
    from prefect_gpu_budget.admission.rules.quota import Placed, Shape, TeamQuota

    quotas = (
        TeamQuota("lab", "o/a", (8, 192, 2048)),
        TeamQuota("lab", "o/b", (8, 192, 2048), borrow_pct=100),
    )
    b_own = Placed("b-own", Shape("lab", "o/b", (8, 192, 2048), 1), (0,), 100, NOW - 50)
    s = _pooled(*quotas, placed=[b_own])
    queue = [_gpus("borrower", "o/b", priority=100, at=1), _gpus("lender", "o/a", at=2)]
    out = plan(s, queue)
    assert out["lender"].verdict == "admit"  # within A's quota: first, whatever the priority
    assert out["borrower"].verdict == "wait" and not out["borrower"].preempt
    assert "other teams lend 0 H100 idle now" in out["borrower"].reason


def test_a_waiting_job_holds_its_team_only_if_strict_and_borrowers_always():
    from prefect_gpu_budget.admission.rules.quota import Placed, Shape, TeamQuota

    a = TeamQuota("lab", "o/a", (16, 384, 4096))
    c = TeamQuota("lab", "o/c", (16, 384, 4096), borrow_pct=50)
    placed = [  # three machines partly used by C: one is free
        Placed(f"c{i}", Shape("lab", "o/c", (g, g * 24, g * 256), 1), (i,), 0, NOW - 60)
        for i, g in enumerate((5, 4, 5))
    ]
    queue = [
        _gpus("gang", "o/a", nodes=2, at=1),
        _gpus("a-small", "o/a", gpus=2, at=2),
        _gpus("c-own", "o/c", gpus=2, at=3),
        _gpus("c-borrow", "o/c", gpus=4, at=4),
    ]
    for strict, backfill in ((False, False), (True, False), (False, True)):
        team_a = replace(a, queueing="strict_fifo" if strict else "best_effort_fifo")
        out = plan(_pooled(team_a, c, placed=placed, nodes=4, backfill=backfill), queue)
        assert out["gang"].verdict == "wait"
        assert out["gang"].reason == "waiting for 2 x 8 H100 in pool lab: 1 node free"
        assert out["c-own"].verdict == "admit"  # another team within its quota: never held
        assert out["c-borrow"].verdict == ("admit" if backfill else "wait")
        assert out["a-small"].verdict == ("wait" if strict else "admit")
        if strict:
            small = decide(_pooled(team_a, c, placed=placed, nodes=4), queue, "a-small")
            assert "for the queue of team o/a in pool lab (strict FIFO)" in small.reason


def test_a_job_behind_another_names_the_limit_it_waits_for_with_its_amount():
    """The head waits for the org's month budget and its team's hourly cap; a later job of
    its team waits behind it, naming the limit it waits for with its amount (the org's budget,
    not the org's cap, which does not bind); another team's job that fits is not held."""
    s = state(
        BudgetRule("o", hourly_cap_cents=1000, period_budget_micro=1_500_000),
        BudgetRule("o/t", hourly_cap_cents=150),
        holds=[Hold("o/t/x", 100, 800_000, NOW - 10, NOW + 10)],
    )
    queue = [req("head", "o/t/a", 100, at=1), req("next", "o/t/b", 10, at=2)]
    out = plan(s, [*queue, req("other", "o/u", 1, at=3)])
    assert out["head"].limit == "period_budget"
    assert out["head"].blocks == ("o", "o/t")
    assert out["head"].block_limits == ("period_budget", "hourly_cap")
    behind = decide(s, queue, "next")
    assert behind.reason.startswith("waiting behind job head (priority 0, queued ")
    assert behind.reason.endswith(" ago) for the month budget of o ($1.50)")
    assert out["other"].verdict == "admit"  # $0.01 fits the org's budget: not held

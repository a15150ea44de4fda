"""A waiting job's log line says one thing: the first limit that blocks it, by how much, and
when a period that blocks it resets; the whole reason stays on its run's state and event."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules.policy import Decision
from prefect_gpu_budget.tasks.events import short_why

SCOPE = "demo-lab/sweeps/agent-1"
CAP = (
    f"blocked by hourly cap of {SCOPE}: running $24.00/h + this job $12.00/h > cap $30.00/h "
    "(over by $6.00/h); resumes when jobs there end"
)
DAY = (
    f"blocked by day budget of {SCOPE}: settled $0.07874 + reserved $0.00 + this job $0.03667 "
    "> budget $0.11 (short by $0.005406); resets 2026-12-07 00:00 UTC"
)


def test_two_limits_are_said_as_the_first_and_a_count() -> None:
    said = short_why(Decision("wait", f"{CAP}; {DAY}", limit="hourly_cap", scope=SCOPE))
    assert said == f"hourly cap of {SCOPE} (over by $6.00/h) (and 1 more limit)"


def test_a_period_budget_says_when_it_resets() -> None:
    decision = Decision("wait", DAY, limit="period_budget", scope=SCOPE, resumes_at=1796601600)
    assert short_why(decision) == (
        f"day budget of {SCOPE} (short by $0.005406), resets 2026-12-07 00:00 UTC"
    )


def test_a_job_behind_another_names_it_and_the_limit() -> None:
    reason = (
        f"waiting behind job b61f11ef (priority 0, queued 0s ago) for the hourly cap of {SCOPE} "
        "($30.00/h)"
    )
    said = short_why(Decision("wait", reason, limit="queue", scope=SCOPE))
    assert said == f"waiting behind job b61f11ef for the hourly cap of {SCOPE} ($30.00/h)"

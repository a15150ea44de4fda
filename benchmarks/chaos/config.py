"""The campaign's settings: the phases and step marks a kill aims at, the workers' timings, the
faults that are not kills, the figures that must stay zero, and each run's nested budget."""

from __future__ import annotations

from benchmarks.harness.report import logger
from prefect_gpu_budget.admission.rules.policy import BudgetRule

PHASES = ("before_reserve", "after_reserve", "running", "settling")
PHASE_END = {
    "before_reserve": "requested",
    "after_reserve": "admitted",
    "running": "settling",
    "settling": "done",
}
"""The word a worker says when each phase is over."""
STEPS = {
    "ask": "before_reserve",
    "ensure": "after_reserve",
    "acquire": "after_reserve",
    "record_lease": "after_reserve",
    "release": "settling",
    "settle": "settling",
}
"""The product calls a worker marks (`>call` as it starts, `<call` once it returned), by phase,
in the order the gate makes them."""
WORKERS = 3
PAUSE_S = 0.02
"""A worker's pause before each step of a phase."""
VICTIM_JOB_S = 0.6
OTHER_JOB_S = (0.1, 0.3)
MAX_WAIT = "8s"
"""A worker gives up after waiting this long for room in its budgets."""
STALE_S = 30.0
REACH_S = 30.0
"""How long the victim may take to reach its phase."""
FINISH_S = 20.0
"""How long the other workers may take to finish once the victim is dead (a few seconds
normally; a worker still waiting then is stuck and counted)."""
END_MARGIN_S = 30.0
"""Past the latest expiry of a lease nobody recorded, how long the end waits for Prefect's slots
to match the ledger before it measures anyway."""
POLL_S = 1.0
END_FIGURES = (
    "orphans_left",
    "double_charges",
    "missing_charges",
    "slot_mismatch_cents",
    "invariant_violations",
    "awaiting_lease_expiry_left",
)
"""The end state, over the whole ledger, once every lease has expired: all must be zero."""
RUN_FIGURES = (
    "orphans_left",
    "double_charges",
    "missing_charges",
    "slot_mismatch_cents",
    "invariant_violations",
)
"""After each run's reconcile (`after_each_run`): all must be zero."""
FAULTS = ("stall", "escape")
"""Faults that are not kills: a ledger locked when a job starts; children escaping the job."""
FAULT_MAX_RUNTIME_S = 2.0
FAULT_GRACE_S = 1.0
STALL_EXTRA_S = 3.0
"""The stall lasts max_runtime plus grace plus this: past any moment the job may still run."""
FAULT_MARK_ENV = "CHAOS_TREE"
ESCAPE_SCRIPT = (
    "nohup sleep 30 >/dev/null 2>&1 &"
    " setsid sleep 30 >/dev/null 2>&1 &"
    " setsid sh -c 'trap \"\" TERM; sleep 30' >/dev/null 2>&1 &"
    " exit 0"
)
"""Children in the job's group, in a new session, and one ignoring SIGTERM; the command exits."""
ESCAPED_WATCH_S = 40.0
"""How long processes that outlive their job are watched (their whole life: `sleep 30`)."""
WATCH_SLACK_S = 0.25
"""What watching a process tree every 50 ms may add to its life as seen from outside."""
OTHER_FIGURES = (
    "overshoot_micro",
    "unmetered_micro",
    "slots_held_past_deadline_cents",
    "second_settles_charged",
    "jobs_outlived_holder",
    "worker_errors",
    "stuck_workers",
)
"""Counted over the runs and the end: all must be zero. `overshoot_micro` (the money bound
of guaranteed mode) and `unmetered_micro`: over the fault runs. `slots_held_past_deadline_cents`:
Prefect still held slots for a row awaiting lease expiry when reconcile settled it, once its
lease could no longer be alive (reconcile's UNRECORDED_LEASE_S too short for this server)."""


log = logger("chaos")


def budgets(org: str) -> list[BudgetRule]:
    """Two jobs at $3.60/h fit the team at once, one per session; the team's day budget holds
    two reservations, so waits come from caps and from the period budget."""
    return [
        BudgetRule(org, hourly_cap_cents=1080, period_budget_micro=100_000, period="month"),
        BudgetRule(f"{org}/t", hourly_cap_cents=720, period_budget_micro=25_000, period="day"),
        BudgetRule(f"{org}/t/s1", hourly_cap_cents=360),
        BudgetRule(f"{org}/t/s2", hourly_cap_cents=360, period_budget_micro=30_000, period="day"),
    ]

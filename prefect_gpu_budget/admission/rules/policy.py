"""The policy's terms, pure: a budget as the decision sees it (`BudgetRule`), what an admitted
job holds (`Hold`, `committed`, `held_in`), what estimate mode learns (`overrun_factors`), the
ledger's state as the policy reads it (`LedgerState`), its answer (`Decision`), and a job's max
wait. The walk that decides is `deciding`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.quota import Placed, Pool, TeamQuota
from prefect_gpu_budget.units import (
    MICRO_PER_CENT,
    cost_micro,
    fmt_usd,
    scope_path,
)

Verdict = Literal["admit", "wait", "reject", "timeout"]


@dataclass(frozen=True)
class BudgetRule:
    """A budget as the decision sees it (money in micro-dollars, rate in cents per hour)."""

    scope: str
    hourly_cap_cents: int | None = None
    period_budget_micro: int | None = None
    period: str = "month"
    timezone: str = "UTC"
    on_limit: str = "queue"
    max_wait_s: float = 86400.0
    reservation_mode: str = "guaranteed"
    notify_block: str | None = None


@dataclass(frozen=True)
class Hold:
    """Rate and money held by an admitted, not yet settled job over [start, end]."""

    scope: str
    rate_cents: int
    reserved_micro: int
    start: float
    end: float
    rate_micro_per_hour: int = 0
    """For metering: what the job costs per hour while it runs."""
    max_end: float | None = None
    """When the launcher stops it at the latest (start + max_runtime)."""
    started: bool = True
    """False while an admitted job has not started (a cloud job waiting for capacity): it may
    still start in any later period and spend all of its reservation there (`held_in`)."""


def committed(hold: Hold, now: float, metering: bool = True) -> tuple[int, float, float]:
    """What a running job commits, over which interval: (amount, start, end).

    Its reservation spread over [start, end]. With metering, a job still running past `end` (an
    estimate that was too short) commits its worst case from then on: rate x (max_end - start),
    or rate x elapsed if it is past even that. Spread in proportion to time, the part already
    incurred lands in the periods that have passed.
    """
    if metering and hold.rate_micro_per_hour and now > hold.end:
        until = max(now, hold.max_end or now)
        worst = cost_micro(hold.rate_micro_per_hour, until - hold.start, round_up=True)
        return max(hold.reserved_micro, worst), hold.start, until
    return hold.reserved_micro, hold.start, hold.end


def held_in(
    hold: Hold, now: float, rule: BudgetRule, period_start: float, metering: bool = True
) -> int:
    """What an admitted job holds in one period of `rule`'s (the current one or a later one:
    every caller asks of the periods a hold from now on touches): once started, its commitment
    (`committed`) spread over its interval; until then all of it, since a late start (a cloud
    job waiting for capacity hours after its admission) can put all of its spend in any of
    them. (Spread from `now` instead, as a hold sliding with the clock, a job admitted before
    midnight and started after it spent in the new day what no decision had counted there.)"""
    amount, start, end = committed(hold, now, metering)
    return share_in(amount, start, end, rule, period_start) if hold.started else amount


OVERRUN_QUANTILE = 0.9
"""Estimate mode reserves enough for this share of a scope's jobs, judged by its settled jobs."""
OVERRUN_WINDOW = 200
"""How many of a scope's most recently settled jobs it learns from."""
OVERRUN_MIN_JOBS = 20
"""Fewer settled jobs than this in a scope teach nothing: its parent's figure (or none) applies."""


def overrun_factor(ratios: Sequence[float], quantile: float = OVERRUN_QUANTILE) -> float | None:
    """How far to stretch an expected runtime: a high quantile of actual / expected runtime.

    `ratios` are a scope's recently settled jobs (billed seconds / expected runtime). The
    `quantile` (nearest rank) of them, never below 1 (a reservation is never smaller than the
    user's own estimate); None if there are fewer than `OVERRUN_MIN_JOBS`.
    """
    if len(ratios) < OVERRUN_MIN_JOBS:
        return None
    ranked = sorted(ratios)
    return max(1.0, ranked[max(0, math.ceil(quantile * len(ranked)) - 1)])


def overrun_factors(
    recent: Iterable[tuple[str, float]], window: int = OVERRUN_WINDOW
) -> dict[str, float]:
    """Per scope, `overrun_factor` of the last `window` settled jobs in it (or below it).

    `recent` is (job scope, billed seconds / expected runtime) of settled jobs, most recent
    first: jobs that had an expected runtime, ran (billed time > 0) and ended by themselves or at
    max_runtime (completed, failed, timed out; not cancelled or preempted).
    """
    windows: dict[str, list[float]] = defaultdict(list)
    for scope, ratio in recent:
        for path_scope in scope_path(scope):
            if len(windows[path_scope]) < window:
                windows[path_scope].append(ratio)
    found = {scope: overrun_factor(ratios) for scope, ratios in windows.items()}
    return {scope: factor for scope, factor in found.items() if factor is not None}


@dataclass(frozen=True)
class LedgerState:
    now: float
    budgets: Mapping[str, BudgetRule]
    holds: Sequence[Hold]
    settled: Mapping[tuple[str, float], int]
    """Settled spend by (scope, period start) for the periods the decision may look at."""
    metering: bool = True
    """Count rate x elapsed for jobs running past their reservation (off: estimate-only)."""
    pools: Mapping[str, Pool] = field(default_factory=dict)
    quotas: Mapping[tuple[str, str], TeamQuota] = field(default_factory=dict)
    """Team quotas by (pool, team)."""
    placed: Sequence[Placed] = ()
    """Admitted jobs' footprints in the pools."""
    overrun: Mapping[str, float] = field(default_factory=dict)
    """Per scope, from `overrun_factors`: estimate mode reserves expected runtime x the figure of
    the deepest scope on the job's path that has one (at most max_runtime). Empty: as expected."""
    fit_worst_case: bool = True
    """Estimate mode admits a job only where its worst case (rate x max_runtime) fits what is left
    while it holds less, so that no one job can overshoot a budget (off: estimate-only)."""


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""
    limit: str | None = None
    """`hourly_cap`, `period_budget`, `queue`, `no_budget` or `agent` (its grant): what blocks,
    for logs and events."""
    scope: str | None = None
    resumes_at: float | None = None
    reserved_micro: int = 0
    reserve_seconds: float = 0.0
    blocks: tuple[str, ...] = ()
    """Scopes whose limits block this job; later jobs needing them wait behind it."""
    caps: tuple[tuple[str, int], ...] = ()
    """For an admission: (scope, hourly cap in cents) of each capped scope on the path."""
    placement: tuple[int, ...] = ()
    """For an admission in an inventory pool: the machine of each of its nodes."""
    preempt: tuple[str, ...] = ()
    """Jobs asked to stop so that this one fits: other teams' borrowed work it reclaims, or its
    own team's lower-priority work (its team's `reclaim` and `within_team` settings)."""
    pool: str | None = None
    """For an admission: the capacity pool it runs in."""
    block_limits: tuple[str, ...] = ()
    """For a waiting job: the limit each of `blocks` is blocked for (`hourly_cap`, ...), so that a
    job behind it can name the limit and its amount."""


def reservation_mode(rules: Iterable[BudgetRule]) -> str:
    """Guaranteed if any budget on the path asks for it: the strictest wins."""
    modes = {rule.reservation_mode for rule in rules}
    return "guaranteed" if "guaranteed" in modes or not modes else "estimate"


def path_rules(budgets: Mapping[str, BudgetRule], scope: str) -> list[BudgetRule]:
    return [budgets[s] for s in scope_path(scope) if s in budgets]


def usd_per_hour(cents: int) -> str:
    """`$3.60/h`: a rate in cents per hour, as reasons give it."""
    return fmt_usd(cents * MICRO_PER_CENT) + "/h"


def share_in(amount: int, start: float, end: float, rule: BudgetRule, period_start: float) -> int:
    """The part of `amount`, spread over [start, end], that falls in one period of `rule`."""
    for p_start, share in periods.split(amount, start, end, rule.period, rule.timezone):
        if p_start == period_start:
            return share
    return 0


def max_wait_of(own: float | None, rules: Sequence[BudgetRule]) -> float:
    """A job's max wait: its own (`GpuJob.max_wait`), else its deepest budget's; 0 (also with
    no budget on its path): it waits for ever."""
    if own is not None:
        return own
    return rules[-1].max_wait_s if rules else 0.0


def wait_deadline(requested_at: float, max_wait: float) -> float:
    """When a job asked at `requested_at` stops waiting (`inf`: never)."""
    return requested_at + max_wait if max_wait > 0 else math.inf

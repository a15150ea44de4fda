"""The one place that decides: a pure function from the ledger's state and the queue to decisions.

No I/O here. The ledger loads a `LedgerState` and the queue inside its transaction, calls
`decide`, and writes what it says; the simulator and tests call the same function.

Queue order is priority (higher first), then arrival. A waiting job *holds* the scopes whose limit
blocks it for its own team's later jobs: one of them that needs any of those scopes waits behind
it (no backfill), so a big job is never starved by a stream of small ones of its team, while
other teams' jobs and jobs in unrelated scopes go on (`queueing.scope_key`). In capacity pools
each team has its own queue, jobs within their team's nominal quota go before borrowers, which
go by fair share, and a waiting job holds only what `queueing` says; who is preempted is
`preemption`'s rule.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from prefect_gpu_budget.admission.rules import periods, preemption, queueing
from prefect_gpu_budget.admission.rules.quota import Capacity, Placed, Pool, TeamQuota
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.units import (
    MICRO_PER_CENT,
    cost_micro,
    fmt_duration,
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
    hold_limits: tuple[str, ...] = ()
    """For a waiting job: the limit each of `blocks` holds for (`hourly_cap`, ...), so that a
    job behind it can name the limit and its amount."""


def reservation_mode(rules: Iterable[BudgetRule]) -> str:
    """Guaranteed if any budget on the path asks for it: the strictest wins."""
    modes = {rule.reservation_mode for rule in rules}
    return "guaranteed" if "guaranteed" in modes or not modes else "estimate"


def path_rules(budgets: Mapping[str, BudgetRule], scope: str) -> list[BudgetRule]:
    return [budgets[s] for s in scope_path(scope) if s in budgets]


def _usd_per_hour(cents: int) -> str:
    return fmt_usd(cents * MICRO_PER_CENT) + "/h"


@dataclass
class _Usage:
    """Running totals while walking the queue: rate per scope, reservations per period."""

    state: LedgerState
    rate: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reserved: dict[tuple[str, float], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for hold in self.state.holds:
            for scope in scope_path(hold.scope):
                self.rate[scope] += hold.rate_cents

    def reserved_in(self, rule: BudgetRule, period_start: float) -> int:
        key = (rule.scope, period_start)
        if key not in self.reserved:
            total = 0
            prefix = rule.scope + "/"
            for hold in self.state.holds:
                if hold.scope == rule.scope or hold.scope.startswith(prefix):
                    total += held_in(hold, self.state.now, rule, period_start, self.state.metering)
            self.reserved[key] = total
        return self.reserved[key]

    def add(self, hold: Hold, rules: list[BudgetRule]) -> None:
        for scope in scope_path(hold.scope):
            self.rate[scope] += hold.rate_cents
        for rule in rules:
            if rule.period_budget_micro is None:
                continue
            for p_start, share in periods.split(
                hold.reserved_micro, hold.start, hold.end, rule.period, rule.timezone
            ):
                self.reserved[(rule.scope, p_start)] = self.reserved_in(rule, p_start) + share


def share_in(amount: int, start: float, end: float, rule: BudgetRule, period_start: float) -> int:
    """The part of `amount`, spread over [start, end], that falls in one period of `rule`."""
    for p_start, share in periods.split(amount, start, end, rule.period, rule.timezone):
        if p_start == period_start:
            return share
    return 0


def _never_fits(
    req: Request, rules: list[BudgetRule], hold: Hold, what: str = "reservation"
) -> str | None:
    for rule in rules:
        if rule.hourly_cap_cents is not None and req.rate_cents > rule.hourly_cap_cents:
            return (
                f"rate {_usd_per_hour(req.rate_cents)} alone exceeds the hourly cap "
                f"{_usd_per_hour(rule.hourly_cap_cents)} of {rule.scope}"
            )
        if rule.period_budget_micro is not None:
            for _, share in periods.split(
                hold.reserved_micro, hold.start, hold.end, rule.period, rule.timezone
            ):
                if share > rule.period_budget_micro:
                    return (
                        f"{what} {fmt_usd(share)} alone exceeds the {rule.period} budget "
                        f"{fmt_usd(rule.period_budget_micro)} of {rule.scope}"
                    )
    return None


def _blockers(
    req: Request, rules: list[BudgetRule], hold: Hold, usage: _Usage, this_job: str = "this job"
) -> list[Decision]:
    found = []
    for rule in rules:
        if rule.hourly_cap_cents is not None:
            running = usage.rate[rule.scope]
            if running + req.rate_cents > rule.hourly_cap_cents:
                over = running + req.rate_cents - rule.hourly_cap_cents
                found.append(
                    Decision(
                        "wait",
                        f"blocked by hourly cap of {rule.scope}: running "
                        f"{_usd_per_hour(running)} + this job {_usd_per_hour(req.rate_cents)} "
                        f"> cap {_usd_per_hour(rule.hourly_cap_cents)} (over by "
                        f"{_usd_per_hour(over)}); resumes when jobs there end",
                        limit="hourly_cap",
                        scope=rule.scope,
                    )
                )
        if rule.period_budget_micro is not None:
            for p_start, share in periods.split(
                hold.reserved_micro, hold.start, hold.end, rule.period, rule.timezone
            ):
                settled = usage.state.settled.get((rule.scope, p_start), 0)
                reserved = usage.reserved_in(rule, p_start)
                if settled + reserved + share > rule.period_budget_micro:
                    p_end = periods.bounds(rule.period, rule.timezone, p_start)[1]
                    short = settled + reserved + share - rule.period_budget_micro
                    found.append(
                        Decision(
                            "wait",
                            f"blocked by {rule.period} budget of {rule.scope}: settled "
                            f"{fmt_usd(settled)} + reserved {fmt_usd(reserved)} + {this_job} "
                            f"{fmt_usd(share)} > budget {fmt_usd(rule.period_budget_micro)} "
                            f"(short by {fmt_usd(short)}); resets "
                            f"{periods.fmt_instant(p_end, rule.timezone)}",
                            limit="period_budget",
                            scope=rule.scope,
                            resumes_at=p_end,
                        )
                    )
    return found


def queue_order(queue: Iterable[Request]) -> list[Request]:
    return sorted(queue, key=lambda r: (-r.priority, r.requested_at, r.job_id))


NOT_REACHED = Decision("wait", "waiting behind an earlier job", limit="queue")
"""What `plan` says of a job it did not weigh this round (a job ahead holds what it needs): it
waits, and its recorded reason stands."""


def plan(
    state: LedgerState, queue: Iterable[Request], stop_at: str | None = None
) -> dict[str, Decision]:
    """Decide queued jobs in queue order, up to and including `stop_at` if given.

    Without `stop_at` the walk ends early once a blocked job holds its org's budget in every
    team's queue of the walk (nothing after it could be admitted); jobs not reached are absent
    from the result.
    A job ahead of `stop_at` that waits behind a hold is `NOT_REACHED` either way: it admits
    nothing and holds nothing, so weighing it could not change what the jobs after it get
    (so deciding the last of n queued jobs costs n lookups, not n decisions).
    """
    ordered = queue_order(queue)
    queues = {queueing.queue_of(req.scope) for req in ordered}
    usage = _Usage(state)
    capacity = Capacity(state.pools, state.quotas, list(state.placed)) if state.pools else None
    held: dict[str, Request] = {}
    limits: dict[str, str] = {}
    out: dict[str, Decision] = {}
    for req in queueing.walk(ordered, capacity):
        if req.job_id != stop_at and queueing.ahead(req, req.shape, held, capacity) is not None:
            out[req.job_id] = NOT_REACHED  # cannot be admitted this round; details on request
            continue
        out[req.job_id] = decision = _decide_one(state, req, usage, held, capacity, limits)
        for i, key in enumerate(queueing.held_keys(req, decision.blocks)):
            if key not in held:
                held[key] = req
                limits[key] = decision.hold_limits[i] if i < len(decision.hold_limits) else ""
        if req.job_id == stop_at or (stop_at is None and queueing.all_held(queues, held)):
            break
    return out


def _reserve_seconds(state: LedgerState, req: Request, mode: str) -> tuple[float, str]:
    """How long to hold the job's rate for, and why: max_runtime in guaranteed mode; in estimate
    mode its expected runtime, stretched by the `overrun` figure of the deepest scope on its path
    that has one (never past max_runtime)."""
    if mode != "estimate" or not req.expected_runtime_s:
        return req.max_runtime_s, mode
    learned = [(s, state.overrun[s]) for s in scope_path(req.scope) if s in state.overrun]
    if not learned:
        return req.expected_runtime_s, mode
    source, factor = learned[-1]
    stretched = min(req.max_runtime_s, req.expected_runtime_s * factor)
    return max(req.expected_runtime_s, stretched), f"estimate x{factor:.2f}, as in {source}"


def _decide_one(
    state: LedgerState,
    req: Request,
    usage: _Usage,
    held: dict[str, Request],
    capacity: Capacity | None = None,
    limits: Mapping[str, str] | None = None,
) -> Decision:
    rules = path_rules(state.budgets, req.scope)
    if not rules:
        return Decision(
            "reject",
            f"no budget covers scope {req.scope}: set one with "
            f"`prefect-gpu-budget budget set {req.scope.split('/')[0]} ...`",
            limit="no_budget",
            scope=req.scope,
        )
    reserve_s, how = _reserve_seconds(state, req, reservation_mode(rules))
    reserved = cost_micro(req.rate_micro_per_hour, reserve_s, round_up=True)
    hold = Hold(req.scope, req.rate_cents, reserved, state.now, state.now + reserve_s)
    must_fit, this_job, what = hold, "this job", "reservation"
    if state.fit_worst_case and reserve_s < req.max_runtime_s:  # estimate mode: see LedgerState
        worst = cost_micro(req.rate_micro_per_hour, req.max_runtime_s, round_up=True)
        must_fit = Hold(req.scope, req.rate_cents, worst, state.now, state.now + req.max_runtime_s)
        this_job, what = "this job at worst", "worst case"

    shape = (
        req.shape if capacity is not None and req.shape and req.shape.pool in state.pools else None
    )
    never = _never_fits(req, rules, must_fit, what) or (
        capacity.never_fits(shape) if shape else None
    )
    if never:
        return Decision("reject", f"can never fit: {never}", limit="never_fits", scope=req.scope)

    found = queueing.ahead(req, shape, held, capacity)
    if found is not None:
        key, ahead = found
        what = _held_for(state, key, (limits or {}).get(key, ""))
        behind = Decision(
            "wait",
            f"waiting behind job {ahead.job_id[:8]} (priority {ahead.priority}, queued "
            f"{fmt_duration(state.now - ahead.requested_at)} ago) for {what}",
            limit="queue",
            scope=queueing.hold_name(key),
        )
        return _wait_or_end(state, req, rules, behind)

    blockers = _blockers(req, rules, must_fit, usage, this_job)
    fit = preemption.fit(capacity, shape, req.priority) if capacity is not None and shape else None
    if fit is not None and not fit.ok:
        blockers.append(
            Decision(
                "wait",
                fit.unasked,
                limit="capacity",
                scope=f"pool:{shape.pool}" if shape else None,
                blocks=fit.holds,
                # budget limits never stop running work: only capacity alone may preempt
                preempt=() if blockers else fit.victims,
            )
        )
    if blockers:
        ended = _wait_or_end(state, req, rules, _blocked(blockers))
        if ended.preempt and fit is not None:  # the reason names victims only when asked
            return replace(ended, reason=fit.reason)
        return ended

    usage.add(hold, rules)
    placement = ()
    if fit is not None and shape is not None:
        placement = fit.placement
        capacity.add(Placed(req.job_id, shape, placement, req.priority, state.now))
    return Decision(
        "admit",
        f"admitted: {_usd_per_hour(req.rate_cents)}, reserved {fmt_usd(reserved)} "
        f"for {fmt_duration(reserve_s)} ({how})",
        reserved_micro=reserved,
        reserve_seconds=reserve_s,
        caps=tuple((r.scope, r.hourly_cap_cents) for r in rules if r.hourly_cap_cents is not None),
        placement=placement,
        pool=shape.pool if shape else None,
    )


def _held_for(state: LedgerState, key: str, limit: str) -> str:
    """What a job waits behind another for, as its reason names it: the limit with its amount
    (`the hourly cap of acme ($10.00/h)`) where a budget holds it, or the queue's hold."""
    name = queueing.hold_name(key)
    rule = state.budgets.get(name)
    if rule is not None and limit == "hourly_cap" and rule.hourly_cap_cents is not None:
        return f"the hourly cap of {name} ({_usd_per_hour(rule.hourly_cap_cents)})"
    if rule is not None and limit == "period_budget" and rule.period_budget_micro is not None:
        return f"the {rule.period} budget of {name} ({fmt_usd(rule.period_budget_micro)})"
    return queueing.describe(key)


def _blocked(blockers: list[Decision]) -> Decision:
    first = blockers[0]
    reason = "; ".join(b.reason for b in blockers)
    resumes = [b.resumes_at for b in blockers if b.resumes_at is not None]
    holds: dict[str, str] = {}  # what it holds, and for which limit (the first that binds)
    for b in blockers:  # a budget holds its scope; capacity what the pool's backfill says
        for key in b.blocks if b.limit == "capacity" else (b.scope,) if b.scope else ():
            holds.setdefault(key, b.limit or "")
    return Decision(
        "wait",
        reason,
        limit=first.limit,
        scope=first.scope,
        resumes_at=max(resumes) if resumes else None,
        blocks=tuple(holds),
        preempt=tuple(v for b in blockers for v in b.preempt),
        hold_limits=tuple(holds.values()),
    )


def max_wait_of(own: float | None, rules: Sequence[BudgetRule]) -> float:
    """A job's max wait: its own (`GpuJob.max_wait`), else its deepest budget's; 0 (also with
    no budget on its path): it waits for ever."""
    if own is not None:
        return own
    return rules[-1].max_wait_s if rules else 0.0


def wait_deadline(requested_at: float, max_wait: float) -> float:
    """When a job asked at `requested_at` stops waiting (`inf`: never)."""
    return requested_at + max_wait if max_wait > 0 else math.inf


def _wait_or_end(
    state: LedgerState, req: Request, rules: list[BudgetRule], wait: Decision
) -> Decision:
    """Apply the job's (or its deepest budget's) on_limit and max_wait to a blocked job."""
    deepest = rules[-1]
    on_limit = req.on_limit or deepest.on_limit
    max_wait = max_wait_of(req.max_wait_s, rules)
    if on_limit == "reject":
        return replace(
            wait, verdict="reject", reason=f"over budget: {wait.reason}", blocks=(), preempt=()
        )
    if state.now >= wait_deadline(req.requested_at, max_wait):
        return replace(
            wait,
            verdict="timeout",
            reason=f"max wait {fmt_duration(max_wait)} ran out: {wait.reason}",
            blocks=(),
            preempt=(),
        )
    return wait


def decide(state: LedgerState, queue: Iterable[Request], job_id: str) -> Decision:
    """The decision for one queued job, given everything queued ahead of it."""
    return plan(state, queue, stop_at=job_id)[job_id]


HOLDING_LIMITS = ("hourly_cap", "period_budget")
"""The limits that, blocking a waiting job, make it hold their scope (`_blocked`)."""


def decide_behind(
    state: LedgerState, req: Request, ahead: Request, scope: str, limit: str = ""
) -> Decision:
    """What `decide` says of `req` when `ahead`, before it in queue order and outside any
    capacity pool, waits blocked by a limit of `scope` on `req`'s path: `req` waits behind it
    (or ends, by its on-limit and max wait), unless it can never be admitted at all; the rest
    of the queue cannot change that. So a request joining a deep queue is decided without
    weighing the whole queue (`state` needs only the budgets on `req`'s path). `ahead` is of
    `req`'s team (`queueing.queue_of`): a budget holds only its own team's later jobs."""
    key = queueing.scope_key(scope, req.scope)
    return _decide_one(state, req, _Usage(state), {key: ahead}, limits={key: limit})

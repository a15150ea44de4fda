"""The one place that decides: a pure function from the ledger's state and the queue to decisions
(`plan`, `decide`, `decide_behind`), in the policy's terms (`policy`).

No I/O here. The ledger loads a `LedgerState` and the queue inside its transaction, calls
`decide`, and writes what it says; the simulator and tests call the same function.

Queue order is priority (higher first), then arrival. A waiting job *blocks* the scopes whose limit
stops it for its own team's later jobs: one of them that needs any of those scopes waits behind
it (no backfill), so a big job is never starved by a stream of small ones of its team, while
other teams' jobs and jobs in unrelated scopes go on (`queueing.scope_key`). In capacity pools
each team has its own queue, jobs within their team's nominal quota go before borrowers, which
go by fair share, and a waiting job blocks only what `queueing` says; who is preempted is
`preemption`'s rule.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from prefect_gpu_budget.admission.rules import periods, preemption, queueing
from prefect_gpu_budget.admission.rules.capacity import Capacity
from prefect_gpu_budget.admission.rules.policy import (
    BudgetRule,
    Decision,
    Hold,
    LedgerState,
    held_in,
    max_wait_of,
    path_rules,
    reservation_mode,
    usd_per_hour,
    wait_deadline,
)
from prefect_gpu_budget.admission.rules.quota import Fit, Placed, Shape
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.units import cost_micro, fmt_duration, fmt_usd, scope_path


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


def _never_fits(
    req: Request, rules: list[BudgetRule], hold: Hold, what: str = "reservation"
) -> str | None:
    for rule in rules:
        if rule.hourly_cap_cents is not None and req.rate_cents > rule.hourly_cap_cents:
            return (
                f"rate {usd_per_hour(req.rate_cents)} alone exceeds the hourly cap "
                f"{usd_per_hour(rule.hourly_cap_cents)} of {rule.scope}"
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
                        f"{usd_per_hour(running)} + this job {usd_per_hour(req.rate_cents)} "
                        f"> cap {usd_per_hour(rule.hourly_cap_cents)} (over by "
                        f"{usd_per_hour(over)}); resumes when jobs there end",
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
"""What `plan` says of a job it did not weigh this round (a job ahead blocks what it needs): it
waits, and its recorded reason stands."""


def plan(
    state: LedgerState, queue: Iterable[Request], stop_at: str | None = None
) -> dict[str, Decision]:
    """Decide queued jobs in queue order, up to and including `stop_at` if given.

    Without `stop_at` the walk ends early once a waiting job blocks its org's budget in every
    team's queue of the walk (nothing after it could be admitted); jobs not reached are absent
    from the result.
    A job ahead of `stop_at` that waits behind a block is `NOT_REACHED` either way: it admits
    nothing and blocks nothing, so weighing it could not change what the jobs after it get
    (so deciding the last of n queued jobs costs n lookups, not n decisions).
    """
    ordered = queue_order(queue)
    queues = {queueing.queue_of(req.scope) for req in ordered}
    usage = _Usage(state)
    capacity = Capacity(state.pools, state.quotas, list(state.placed)) if state.pools else None
    blocked: dict[str, Request] = {}
    limits: dict[str, str] = {}
    out: dict[str, Decision] = {}
    for req in queueing.walk(ordered, capacity):
        if req.job_id != stop_at and queueing.ahead(req, req.shape, blocked, capacity) is not None:
            out[req.job_id] = NOT_REACHED  # cannot be admitted this round; details on request
            continue
        out[req.job_id] = decision = _decide_one(state, req, usage, blocked, capacity, limits)
        for i, key in enumerate(queueing.blocked_keys(req, decision.blocks)):
            if key not in blocked:
                blocked[key] = req
                limits[key] = decision.block_limits[i] if i < len(decision.block_limits) else ""
        if req.job_id == stop_at or (stop_at is None and queueing.all_blocked(queues, blocked)):
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
    blocked: dict[str, Request],
    capacity: Capacity | None = None,
    limits: Mapping[str, str] | None = None,
) -> Decision:
    """One job's decision in the walk: 1. a budget covers it; 2. what it would reserve; 3. it
    can ever fit; 4. no job ahead blocks what it needs; 5. no limit blocks it now (a pool's
    capacity may ask others to stop); 6. admitted, its hold and placement counted."""
    rules = path_rules(state.budgets, req.scope)
    if not rules:
        return _no_budget(req)
    ask = _reservation(state, req, rules)
    shape = (
        req.shape if capacity is not None and req.shape and req.shape.pool in state.pools else None
    )
    never = _never_fits(req, rules, ask.must_fit, ask.what) or (
        capacity.never_fits(shape) if capacity is not None and shape else None
    )
    if never:
        return Decision("reject", f"can never fit: {never}", limit="never_fits", scope=req.scope)
    found = queueing.ahead(req, shape, blocked, capacity)
    if found is not None:
        return _wait_or_end(state, req, rules, _behind(state, *found, limits or {}))
    fit = preemption.fit(capacity, shape, req.priority) if capacity is not None and shape else None
    blocked = _blocked_now(state, req, rules, usage, ask, shape, fit)
    if blocked is not None:
        return blocked
    return _admit(state, req, rules, usage, ask, capacity, shape, fit)


def _no_budget(req: Request) -> Decision:
    return Decision(
        "reject",
        f"no budget covers scope {req.scope}: set one with "
        f"`prefect-gpu-budget budget set {req.scope.split('/')[0]} ...`",
        limit="no_budget",
        scope=req.scope,
    )


@dataclass(frozen=True)
class _Reservation:
    """What a job would hold if admitted (`hold`, for `seconds`, `how` they were chosen), and
    what must fit for it to be (`must_fit`: its worst case in estimate mode, said `this_job`
    and `what` in reasons)."""

    hold: Hold
    must_fit: Hold
    seconds: float
    how: str
    this_job: str = "this job"
    what: str = "reservation"


def _reservation(state: LedgerState, req: Request, rules: list[BudgetRule]) -> _Reservation:
    reserve_s, how = _reserve_seconds(state, req, reservation_mode(rules))
    reserved = cost_micro(req.rate_micro_per_hour, reserve_s, round_up=True)
    hold = Hold(req.scope, req.rate_cents, reserved, state.now, state.now + reserve_s)
    if state.fit_worst_case and reserve_s < req.max_runtime_s:  # estimate mode: see LedgerState
        worst = cost_micro(req.rate_micro_per_hour, req.max_runtime_s, round_up=True)
        must_fit = Hold(req.scope, req.rate_cents, worst, state.now, state.now + req.max_runtime_s)
        return _Reservation(hold, must_fit, reserve_s, how, "this job at worst", "worst case")
    return _Reservation(hold, hold, reserve_s, how)


def _behind(state: LedgerState, key: str, ahead: Request, limits: Mapping[str, str]) -> Decision:
    """A job waits behind `ahead`, which blocks `key` (for the limit `limits` names)."""
    what = _blocked_for(state, key, limits.get(key, ""))
    return Decision(
        "wait",
        f"waiting behind job {ahead.job_id[:8]} (priority {ahead.priority}, queued "
        f"{fmt_duration(state.now - ahead.requested_at)} ago) for {what}",
        limit="queue",
        scope=queueing.block_name(key),
    )


def _blocked_now(
    state: LedgerState,
    req: Request,
    rules: list[BudgetRule],
    usage: _Usage,
    ask: _Reservation,
    shape: Shape | None,
    fit: Fit | None,
) -> Decision | None:
    """The decision of a job a limit blocks now (a budget on its path, its pool's capacity),
    by its on-limit and max wait; None where nothing does."""
    blockers = _blockers(req, rules, ask.must_fit, usage, ask.this_job)
    if fit is not None and not fit.ok:
        blockers.append(
            Decision(
                "wait",
                fit.unasked,
                limit="capacity",
                scope=f"pool:{shape.pool}" if shape else None,
                blocks=fit.blocks,
                # budget limits never stop running work: only capacity alone may preempt
                preempt=() if blockers else fit.victims,
            )
        )
    if not blockers:
        return None
    ended = _wait_or_end(state, req, rules, _blocked(blockers))
    if ended.preempt and fit is not None:  # the reason names victims only when asked
        return replace(ended, reason=fit.reason)
    return ended


def _admit(
    state: LedgerState,
    req: Request,
    rules: list[BudgetRule],
    usage: _Usage,
    ask: _Reservation,
    capacity: Capacity | None,
    shape: Shape | None,
    fit: Fit | None,
) -> Decision:
    """The admission, its hold (and its nodes' placement) counted for the jobs after it."""
    usage.add(ask.hold, rules)
    placement: tuple[int, ...] = ()
    if capacity is not None and fit is not None and shape is not None:
        placement = fit.placement
        capacity.add(Placed(req.job_id, shape, placement, req.priority, state.now))
    return Decision(
        "admit",
        f"admitted: {usd_per_hour(req.rate_cents)}, reserved {fmt_usd(ask.hold.reserved_micro)} "
        f"for {fmt_duration(ask.seconds)} ({ask.how})",
        reserved_micro=ask.hold.reserved_micro,
        reserve_seconds=ask.seconds,
        caps=tuple((r.scope, r.hourly_cap_cents) for r in rules if r.hourly_cap_cents is not None),
        placement=placement,
        pool=shape.pool if shape else None,
    )


def _blocked_for(state: LedgerState, key: str, limit: str) -> str:
    """What a job waits behind another for, as its reason names it: the limit with its amount
    (`the hourly cap of acme ($10.00/h)`) where a budget makes the block, or the queue's block."""
    name = queueing.block_name(key)
    rule = state.budgets.get(name)
    if rule is not None and limit == "hourly_cap" and rule.hourly_cap_cents is not None:
        return f"the hourly cap of {name} ({usd_per_hour(rule.hourly_cap_cents)})"
    if rule is not None and limit == "period_budget" and rule.period_budget_micro is not None:
        return f"the {rule.period} budget of {name} ({fmt_usd(rule.period_budget_micro)})"
    return queueing.describe(key)


def _blocked(blockers: list[Decision]) -> Decision:
    first = blockers[0]
    reason = "; ".join(b.reason for b in blockers)
    resumes = [b.resumes_at for b in blockers if b.resumes_at is not None]
    blocks: dict[str, str] = {}  # what it blocks, and for which limit (the first that binds)
    for b in blockers:  # a budget blocks its scope; capacity what the pool's backfill says
        for key in b.blocks if b.limit == "capacity" else (b.scope,) if b.scope else ():
            blocks.setdefault(key, b.limit or "")
    return Decision(
        "wait",
        reason,
        limit=first.limit,
        scope=first.scope,
        resumes_at=max(resumes) if resumes else None,
        blocks=tuple(blocks),
        preempt=tuple(v for b in blockers for v in b.preempt),
        block_limits=tuple(blocks.values()),
    )


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


BLOCKING_LIMITS = ("hourly_cap", "period_budget")
"""The limits that, stopping a waiting job, make it block their scope (`_blocked`)."""


def decide_behind(
    state: LedgerState, req: Request, ahead: Request, scope: str, limit: str = ""
) -> Decision:
    """What `decide` says of `req` when `ahead`, before it in queue order and outside any
    capacity pool, waits blocked by a limit of `scope` on `req`'s path: `req` waits behind it
    (or ends, by its on-limit and max wait), unless it can never be admitted at all; the rest
    of the queue cannot change that. So a request joining a deep queue is decided without
    weighing the whole queue (`state` needs only the budgets on `req`'s path). `ahead` is of
    `req`'s team (`queueing.queue_of`): a budget blocks only its own team's later jobs."""
    key = queueing.scope_key(scope, req.scope)
    return _decide_one(state, req, _Usage(state), {key: ahead}, limits={key: limit})

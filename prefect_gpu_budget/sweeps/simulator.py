"""A discrete-event simulator that drives the gate's own decision on a virtual clock.

No copy of the policy: every admission here comes from `admission.policy.plan`, the function the
live ledger calls inside its transaction. Jobs arrive, wait, start, run for their true runtime
(which may differ from the estimate), are stopped at max_runtime where the policy says so, and
settle. Three policies are compared:

- `estimate-only`: reserve rate x expected runtime, never stop a job, no metering (the model of
  tools that admit on estimates, such as anycloud);
- `guaranteed`: reserve rate x max_runtime, stop at max_runtime (our default);
- `estimate-metered` (our estimate mode): reserve rate x expected runtime, stretched by how far
  each scope's settled jobs overran their estimates (`policy.overrun_factors`); admit only where
  the job's worst case fits too; meter jobs that run past their reservation; stop at max_runtime.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.accounting import book, period_shares, settled_cost
from prefect_gpu_budget.admission.rules.policy import (
    OVERRUN_WINDOW,
    BudgetRule,
    Hold,
    LedgerState,
    max_wait_of,
    overrun_factor,
    plan,
    wait_deadline,
)
from prefect_gpu_budget.admission.rules.quota import Placed, Pool, Shape, TeamQuota
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.units import rate_cents, scope_path


@dataclass(frozen=True)
class SimPolicy:
    name: str
    reservation_mode: str
    stop_at_max_runtime: bool
    metering: bool
    learning: bool = True
    """Stretch estimates by how far each scope's settled jobs overran theirs."""
    fit_worst_case: bool = True
    """Admit a job on its estimate only where its worst case fits too."""


POLICIES = {
    p.name: p
    for p in (
        SimPolicy(
            "estimate-only",
            "estimate",
            stop_at_max_runtime=False,
            metering=False,
            learning=False,
            fit_worst_case=False,
        ),
        SimPolicy("guaranteed", "guaranteed", stop_at_max_runtime=True, metering=True),
        SimPolicy("estimate-metered", "estimate", stop_at_max_runtime=True, metering=True),
    )
}


@dataclass(frozen=True)
class SimJob:
    job_id: str
    scope: str
    arrival: float
    rate_micro_per_hour: int
    expected_s: float
    true_s: float
    max_runtime_s: float
    priority: int = 0
    on_limit: str | None = None
    """The job's own `queue`/`reject` (None: its deepest budget's); used with `limits=True`."""
    max_wait_s: float | None = None
    """The job's own max wait (None: its deepest budget's); used with `limits=True`."""
    shape: Shape | None = None
    """What it occupies in a capacity pool (with `simulate`'s `pools`), if it runs in one."""
    start_s: float = 0.0
    """From its admission to its start (a launch: Prefect's slots, the task run, the process or
    the cloud's job): it holds its caps, quota and reservation meanwhile, unbilled, and its
    max_runtime counts from its start."""


@dataclass
class SimRecord:
    job: SimJob
    admitted_at: float | None = None
    ended_at: float | None = None
    actual_micro: int = 0
    reserved_micro: int = 0
    """What the gate held for it against the budgets at admission (guaranteed: its worst case)."""
    finished: bool = False
    """Ran to its natural end (not stopped at max_runtime, not cut off by the horizon)."""

    released_at: float | None = None
    """When it asked for admission: its arrival, or later if it waited for a sweep slot."""
    blocked: tuple[str | None, str | None, float | None] | None = None
    """The last (limit, scope, resumes at) that made it wait, if it ever waited."""
    refused: str | None = None
    """`reject` or `timeout` when the gate would end it unadmitted (with `limits=True`)."""
    refused_at: float | None = None

    @property
    def started_at(self) -> float | None:
        """When it started, and its bill with it: `start_s` after its admission."""
        return None if self.admitted_at is None else self.admitted_at + self.job.start_s

    @property
    def wait_s(self) -> float | None:
        if self.admitted_at is None or self.released_at is None:
            return None
        return self.admitted_at - self.released_at


@dataclass
class SimResult:
    policy: SimPolicy
    budgets: dict[str, BudgetRule]
    records: list[SimRecord]
    horizon: float
    order: list[str] = field(default_factory=list)
    """Job ids in admission order."""

    def spend_by_period(self) -> dict[tuple[str, float], int]:
        """Real spend (incurred, split by time) per budgeted scope and period."""
        out: dict[tuple[str, float], int] = defaultdict(int)
        for rec in self.records:
            if rec.started_at is None or rec.ended_at is None:
                continue
            for key, share in book(
                rec.job.scope, rec.actual_micro, rec.started_at, rec.ended_at, self.budgets
            ).items():
                out[key] += share
        return out

    def overshoot_pct(self) -> float:
        """Worst real spend over any period budget, in percent of that budget (0 if none)."""
        worst = 0.0
        for (scope, _), spent in self.spend_by_period().items():
            budget = self.budgets[scope].period_budget_micro or 0
            if budget:
                worst = max(worst, 100.0 * (spent - budget) / budget)
        return round(worst, 2)

    def utilization_pct(self, scope: str) -> float:
        """Budget of `scope` spent on jobs that finished, over the periods wholly simulated."""
        budget, spent = self._period_spend(scope, finished_only=True)
        return round(100.0 * sum(min(s, budget) for s in spent) / (budget * len(spent)), 2)

    def spent_pct(self, scope: str) -> float:
        """Budget of `scope` spent on any job (finished, stopped at max_runtime or still running
        at the horizon), over the same periods: above 100 where real spend overshot it."""
        budget, spent = self._period_spend(scope, finished_only=False)
        return round(100.0 * sum(spent) / (budget * len(spent)), 2)

    def _period_spend(self, scope: str, finished_only: bool) -> tuple[int, list[int]]:
        """The period budget of `scope` and real spend in each period wholly simulated (the first
        period if none is whole)."""
        rule = self.budgets[scope]
        assert rule.period_budget_micro is not None
        spent: dict[float, int] = defaultdict(int)
        for rec in self.records:
            if rec.started_at is None or rec.ended_at is None:
                continue
            if (finished_only and not rec.finished) or scope not in scope_path(rec.job.scope):
                continue
            for p_start, share in period_shares(
                rec.actual_micro, rec.started_at, rec.ended_at, rule
            ):
                spent[p_start] += share
        first = min(r.job.arrival for r in self.records)
        spans = periods.overlapping(rule.period, rule.timezone, first, self.horizon)
        whole = [start for start, end in spans if start >= first - 1e-6 and end <= self.horizon]
        return rule.period_budget_micro, [spent[p] for p in whole or [spans[0][0]]]

    def waits(self) -> list[float]:
        return sorted(r.wait_s for r in self.records if r.wait_s is not None)

    def completed(self) -> int:
        return sum(1 for r in self.records if r.finished)


def simulate(
    jobs: Sequence[SimJob],
    budgets: Iterable[BudgetRule],
    policy: str | SimPolicy = "guaranteed",
    *,
    until: float | None = None,
    settled: dict[tuple[str, float], int] | None = None,
    holds: Sequence[Hold] = (),
    in_flight: int | None = None,
    history: Iterable[tuple[str, float]] = (),
    limits: bool = False,
    pools: Sequence[Pool] = (),
    quotas: Sequence[TeamQuota] = (),
    placed: Sequence[Placed | None] = (),
) -> SimResult:
    """Run `jobs` against `budgets` from the first arrival until all end (or `until`).

    `settled`, `holds` and `history` start the simulation from a ledger's current state (a
    forecast); `history` is (scope, actual / expected runtime) of settled jobs, most recent first,
    as `policy.overrun_factors` takes it. `in_flight` releases at most that many jobs at once, as
    a sweep's parallelism bound does. `limits` keeps each budget's (and job's) `on_limit` and
    `max_wait`, so that jobs end rejected or timed out as the gate would end them (a forecast);
    without it every job waits as long as it takes (the fidelity experiments). `pools` and
    `quotas` are the capacity pools and team quotas jobs with a `shape` run in; `placed` the
    footprint of each of `holds` in them (None: none), in the same order. A job that would
    preempt others to fit waits for them to end instead.
    """
    pol = POLICIES[policy] if isinstance(policy, str) else policy
    rules = {
        r.scope: replace(r, reservation_mode=pol.reservation_mode)
        if limits
        else replace(r, reservation_mode=pol.reservation_mode, max_wait_s=0.0, on_limit="queue")
        for r in budgets
    }
    records = {job.job_id: SimRecord(job) for job in jobs}
    arrivals = sorted(jobs, key=lambda j: (j.arrival, j.job_id))
    spent: dict[tuple[str, float], int] = defaultdict(int, settled or {})
    active: dict[str, Hold] = {f"existing-{i}": hold for i, hold in enumerate(holds)}
    footprints = {f"existing-{i}": where for i, where in enumerate(placed) if where is not None}
    queue: dict[str, Request] = {}
    events: list[tuple[float, int, str]] = []  # (time, kind 0=end 1=wake, job id)
    order: list[str] = []
    ends: dict[str, float] = {}
    for key, hold in active.items():  # jobs running at the start end when their reservation does
        heapq.heappush(events, (hold.end, 0, key))
    learned = OverrunWindows(history) if pol.learning else None
    horizon = until if until is not None else math.inf
    next_arrival = 0
    now = arrivals[0].arrival if arrivals else 0.0

    limit = in_flight or len(arrivals) or 1
    released = 0  # asked for admission and not yet ended
    while next_arrival < len(arrivals) or events:
        can_release = next_arrival < len(arrivals) and released < limit
        t_arrival = arrivals[next_arrival].arrival if can_release else math.inf
        t_event = events[0][0] if events else math.inf
        # a job held back by `in_flight` is released when a slot frees, never back in time
        now = max(now, min(t_arrival, t_event))
        if now > horizon or now == math.inf:
            break
        while events and events[0][0] <= now:
            _, kind, job_id = heapq.heappop(events)
            if kind == 0 and job_id not in records:  # a job already running at the start
                hold = active.pop(job_id)
                footprints.pop(job_id, None)
                _charge(hold.scope, hold.rate_micro_per_hour, hold.start, hold.end, rules, spent)
            elif kind == 0:
                active.pop(job_id)
                footprints.pop(job_id, None)
                released -= 1
                _settle(records[job_id], ends.pop(job_id), rules, spent)
                if learned is not None:
                    learned.add(records[job_id])
        while (
            next_arrival < len(arrivals)
            and released < limit
            and arrivals[next_arrival].arrival <= now
        ):
            job = arrivals[next_arrival]
            next_arrival += 1
            released += 1
            records[job.job_id].released_at = now
            queue[job.job_id] = Request(
                job_id=job.job_id,
                scope=job.scope,
                rate_micro_per_hour=job.rate_micro_per_hour,
                rate_cents=rate_cents(job.rate_micro_per_hour),
                max_runtime_s=job.max_runtime_s,
                expected_runtime_s=job.expected_s,
                priority=job.priority,
                requested_at=now,
                on_limit=job.on_limit if limits else None,
                max_wait_s=job.max_wait_s if limits else None,
                shape=job.shape,
            )
        if not queue:
            continue
        state = LedgerState(
            now,
            rules,
            list(active.values()),
            spent,
            metering=pol.metering,
            overrun=learned.factors if learned is not None else {},
            fit_worst_case=pol.fit_worst_case,
            pools={pool.name: pool for pool in pools},
            quotas={(quota.pool, quota.team): quota for quota in quotas},
            placed=list(footprints.values()),
        )
        wake = math.inf
        for job_id, decision in plan(state, queue.values()).items():
            if decision.verdict == "admit":
                job = records[job_id].job
                del queue[job_id]
                order.append(job_id)
                active[job_id] = Hold(
                    job.scope,
                    rate_cents(job.rate_micro_per_hour),
                    decision.reserved_micro,
                    now,
                    now + decision.reserve_seconds,
                    job.rate_micro_per_hour,
                    now + job.start_s + job.max_runtime_s,
                )
                records[job_id].admitted_at = now
                records[job_id].reserved_micro = decision.reserved_micro
                if job.shape is not None and pools:
                    footprints[job_id] = Placed(
                        job_id, job.shape, decision.placement, job.priority, now
                    )
                run = job.true_s
                if pol.stop_at_max_runtime:
                    run = min(run, job.max_runtime_s)
                ends[job_id] = now + job.start_s + run
                heapq.heappush(events, (ends[job_id], 0, job_id))
            elif decision.verdict in ("reject", "timeout"):
                del queue[job_id]
                released -= 1
                records[job_id].refused, records[job_id].refused_at = decision.verdict, now
                records[job_id].blocked = (decision.limit, decision.scope, decision.resumes_at)
            else:
                records[job_id].blocked = (decision.limit, decision.scope, decision.resumes_at)
                if decision.resumes_at is not None:
                    wake = min(wake, decision.resumes_at)
                if limits:  # re-decide when its max wait runs out
                    wake = min(wake, _wait_ends(queue[job_id], rules))
        if wake < math.inf and not any(e[1] == 1 and e[0] == wake for e in events):
            heapq.heappush(events, (wake, 1, ""))

    end = horizon if until is not None else now
    for job_id, finish in ends.items():  # still running at the horizon: what they spent so far
        _settle(records[job_id], min(finish, end), rules, spent)
    return SimResult(pol, rules, list(records.values()), horizon=end, order=order)


def _wait_ends(req: Request, rules: dict[str, BudgetRule]) -> float:
    """When a waiting request's max wait runs out (its own, else its deepest budget's)."""
    path = [rules[s] for s in scope_path(req.scope) if s in rules]
    return wait_deadline(req.requested_at, max_wait_of(req.max_wait_s, path))


class OverrunWindows:
    """Each scope's last `OVERRUN_WINDOW` settled jobs' actual / expected runtime, and the
    `overrun_factor` of each: what the ledger supplies from its settled jobs."""

    def __init__(self, history: Iterable[tuple[str, float]]) -> None:
        self.windows: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=OVERRUN_WINDOW))
        self.factors: dict[str, float] = {}
        for scope, ratio in reversed(list(history)):  # oldest first
            self._append(scope, ratio)

    def add(self, rec: SimRecord) -> None:
        assert rec.started_at is not None and rec.ended_at is not None
        ran = rec.ended_at - rec.started_at
        if ran > 0 and rec.job.expected_s > 0:
            self._append(rec.job.scope, ran / rec.job.expected_s)

    def _append(self, scope: str, ratio: float) -> None:
        for path_scope in scope_path(scope):
            window = self.windows[path_scope]
            window.append(ratio)
            factor = overrun_factor(window)
            if factor is not None:
                self.factors[path_scope] = factor


def _settle(
    rec: SimRecord,
    end: float,
    rules: dict[str, BudgetRule],
    spent: dict[tuple[str, float], int],
) -> None:
    """End a job at `end`: charge rate x time run (from its start, not its admission), in the
    periods in which it ran."""
    job = rec.job
    assert rec.started_at is not None
    rec.ended_at = end
    began = min(rec.started_at, end)  # cut off by the horizon while it was starting: nothing
    rec.actual_micro = settled_cost(job.rate_micro_per_hour, began, end)[1]
    rec.finished = end >= rec.started_at + job.true_s - 1e-9
    _charge(job.scope, job.rate_micro_per_hour, began, end, rules, spent, rec.actual_micro)


def _charge(
    scope: str,
    rate: int,
    start: float,
    end: float,
    rules: dict[str, BudgetRule],
    spent: dict[tuple[str, float], int],
    amount: int | None = None,
) -> None:
    """Add what a job spent over [start, end] (by default rate x the time) to the periods of
    every budget on its path, as the ledger books a settlement."""
    amount = settled_cost(rate, start, end)[1] if amount is None else amount
    for key, share in book(scope, amount, start, end, rules).items():
        spent[key] += share


TRACE_KINDS = ("lognormal", "heavy-tail", "overrun-tail")


def _bounded_pareto(rng: random.Random, alpha: float, low: float, high: float) -> float:
    """A draw from the Pareto law of index `alpha` truncated to [low, high] (inverse CDF)."""
    tail = 1.0 - (low / high) ** alpha
    return low / (1.0 - rng.random() * tail) ** (1.0 / alpha)


def synthetic_trace(
    jobs: int = 10_000,
    seed: int = 0,
    kind: str = "lognormal",
    *,
    start: float = 1_798_761_600.0,  # 2027-01-01 00:00 UTC, a Friday
    days: float = 30.0,
    teams: int = 4,
    max_factor: float = 3.0,
) -> list[SimJob]:
    """A month of GPU jobs whose runtimes miss their estimates.

    `lognormal`: estimates are log-uniform from 10 min to 4 h; true / expected is log-normal
    with median 1 (sigma 0.25), and 10% of jobs run 1-3x their estimate. `heavy-tail`: the same
    errors, on job sizes that are heavy-tailed: estimates follow a Pareto law (alpha 1.1)
    bounded to 15 min - 24 h, so the largest 1% of jobs hold about 15% of the GPU hours (3% in
    the first trace).
    `overrun-tail`: the first trace's sizes, with errors that are heavy-tailed: true / expected
    is Pareto (alpha 1.5) scaled to a median of 1, so about 9.6% of jobs need more than 3x
    their estimate and a policy that stops jobs at max_runtime never finishes them (they take
    about 22% of what it spends). max_runtime is `max_factor` times the estimate; prices are
    catalog-like.
    """
    rng = random.Random(seed)
    rates = [1_006_000, 4_601_600, 5_672_000, 21_958_000, 27_447_000]
    out = []
    for i in range(jobs):
        arrival = start + rng.uniform(0, days * 86400)
        if kind == "heavy-tail":
            expected = _bounded_pareto(rng, 1.1, 900.0, 86400.0)
        else:
            expected = math.exp(rng.uniform(math.log(600), math.log(4 * 3600)))
        if kind in ("lognormal", "heavy-tail"):
            ratio = rng.lognormvariate(0, 0.25)
            if rng.random() < 0.10:
                ratio = rng.uniform(1.0, 3.0)
        elif kind == "overrun-tail":
            ratio = rng.paretovariate(1.5) / 2 ** (1 / 1.5)
        else:
            raise ValueError(f"kind must be one of {', '.join(TRACE_KINDS)}; got {kind!r}")
        team = rng.randrange(teams)
        out.append(
            SimJob(
                job_id=f"j{i:06d}",
                scope=f"org/team{team}/agent{rng.randrange(8)}",
                arrival=arrival,
                rate_micro_per_hour=rng.choice(rates) * (1 if rng.random() < 0.8 else 2),
                expected_s=expected,
                true_s=expected * ratio,
                max_runtime_s=max_factor * expected,
                priority=rng.choice((0, 0, 0, 100)),
            )
        )
    return out

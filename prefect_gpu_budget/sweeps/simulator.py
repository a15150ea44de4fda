"""A discrete-event simulator that drives the gate's own decision on a virtual clock.

No copy of the policy: every admission here comes from `rules.deciding.plan`, the function the
live ledger calls inside its transaction. Jobs arrive, wait, start, run for their true runtime
(which may differ from the estimate), are stopped at max_runtime where the policy says so, and
settle. Three policies are compared (`sim_model.POLICIES`, with the jobs, records and results;
`traces` draws synthetic months of jobs):

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
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

from prefect_gpu_budget.admission.rules.accounting import book, settled_cost
from prefect_gpu_budget.admission.rules.deciding import plan
from prefect_gpu_budget.admission.rules.policy import (
    OVERRUN_WINDOW,
    BudgetRule,
    Decision,
    Hold,
    LedgerState,
    max_wait_of,
    overrun_factor,
    wait_deadline,
)
from prefect_gpu_budget.admission.rules.quota import Placed, Pool, TeamQuota
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.sweeps.sim_model import POLICIES, SimJob, SimPolicy, SimRecord, SimResult
from prefect_gpu_budget.units import rate_cents, scope_path

__all__ = [
    "POLICIES",
    "OverrunWindows",
    "SimJob",
    "SimPolicy",
    "SimRecord",
    "SimResult",
    "simulate",
]

END, WAKE = 0, 1
"""The kinds of event on the virtual clock: a job's end, a queue's wake-up."""


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
    run = Simulation(jobs, budgets, pol, limits=limits, pools=pools, quotas=quotas)
    run.start_from(settled or {}, holds, placed, history, in_flight)
    return run.run(until)


class Simulation:
    """One run of `simulate`: the virtual clock and what stands at each instant. Each turn of
    `run` takes five steps: 1. `advance` the clock to the next arrival or event; 2. `ends`:
    settle the jobs that ended; 3. `arrivals`: release the jobs that arrived (within
    `in_flight`) into the queue; 4. `decide` the queue with the gate's own `plan`; 5. `wake`:
    come back when a waiting job may be admitted."""

    def __init__(
        self,
        jobs: Sequence[SimJob],
        budgets: Iterable[BudgetRule],
        pol: SimPolicy,
        *,
        limits: bool,
        pools: Sequence[Pool],
        quotas: Sequence[TeamQuota],
    ) -> None:
        self.pol, self.limits = pol, limits
        self.pools = {pool.name: pool for pool in pools}
        self.quotas = {(quota.pool, quota.team): quota for quota in quotas}
        self.rules = {
            r.scope: replace(r, reservation_mode=pol.reservation_mode)
            if limits
            else replace(r, reservation_mode=pol.reservation_mode, max_wait_s=0.0, on_limit="queue")
            for r in budgets
        }
        self.records = {job.job_id: SimRecord(job) for job in jobs}
        self.arrivals = sorted(jobs, key=lambda j: (j.arrival, j.job_id))
        self.queue: dict[str, Request] = {}
        self.events: list[tuple[float, int, str]] = []  # (time, END or WAKE, job id)
        self.order: list[str] = []
        self.ends_at: dict[str, float] = {}
        self.next_arrival = 0
        self.released = 0  # asked for admission and not yet ended
        self.now = self.arrivals[0].arrival if self.arrivals else 0.0

    def start_from(
        self,
        settled: dict[tuple[str, float], int],
        holds: Sequence[Hold],
        placed: Sequence[Placed | None],
        history: Iterable[tuple[str, float]],
        in_flight: int | None,
    ) -> None:
        """The ledger's state the run starts from: its period spend, the jobs running (which end
        when their reservation does), what they hold in the pools, the overrun history."""
        self.spent: dict[tuple[str, float], int] = defaultdict(int, settled)
        self.active: dict[str, Hold] = {f"existing-{i}": hold for i, hold in enumerate(holds)}
        self.footprints = {
            f"existing-{i}": where for i, where in enumerate(placed) if where is not None
        }
        for key, hold in self.active.items():
            heapq.heappush(self.events, (hold.end, END, key))
        self.learned = OverrunWindows(history) if self.pol.learning else None
        self.limit = in_flight or len(self.arrivals) or 1

    def run(self, until: float | None) -> SimResult:
        horizon = until if until is not None else math.inf
        while self.next_arrival < len(self.arrivals) or self.events:
            if not self.advance(horizon):  # 1.
                break
            self.ends()  # 2.
            self.arrivals_due()  # 3.
            if self.queue:
                self.wake(self.decide())  # 4. and 5.
        end = horizon if until is not None else self.now
        for job_id, finish in self.ends_at.items():  # running at the horizon: spent so far
            _settle(self.records[job_id], min(finish, end), self.rules, self.spent)
        return SimResult(
            self.pol, self.rules, list(self.records.values()), horizon=end, order=self.order
        )

    def advance(self, horizon: float) -> bool:
        """1. The clock to the next arrival that may be released or the next event; False past
        the horizon (or with nothing left that can happen)."""
        can_release = self.next_arrival < len(self.arrivals) and self.released < self.limit
        t_arrival = self.arrivals[self.next_arrival].arrival if can_release else math.inf
        t_event = self.events[0][0] if self.events else math.inf
        # a job held back by `in_flight` is released when a slot frees, never back in time
        self.now = max(self.now, min(t_arrival, t_event))
        return not (self.now > horizon or self.now == math.inf)

    def ends(self) -> None:
        """2. Settle each job that ended by now (wake-ups due are dropped: the decision runs)."""
        while self.events and self.events[0][0] <= self.now:
            _, kind, job_id = heapq.heappop(self.events)
            if kind != END:
                continue
            hold = self.active.pop(job_id)
            self.footprints.pop(job_id, None)
            if job_id not in self.records:  # a job already running at the start
                _charge(
                    hold.scope,
                    hold.rate_micro_per_hour,
                    hold.start,
                    hold.end,
                    self.rules,
                    self.spent,
                )
                continue
            self.released -= 1
            _settle(self.records[job_id], self.ends_at.pop(job_id), self.rules, self.spent)
            if self.learned is not None:
                self.learned.add(self.records[job_id])

    def arrivals_due(self) -> None:
        """3. Release into the queue each job that arrived by now, while `in_flight` allows."""
        while (
            self.next_arrival < len(self.arrivals)
            and self.released < self.limit
            and self.arrivals[self.next_arrival].arrival <= self.now
        ):
            job = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            self.released += 1
            self.records[job.job_id].released_at = self.now
            self.queue[job.job_id] = Request(
                job_id=job.job_id,
                scope=job.scope,
                rate_micro_per_hour=job.rate_micro_per_hour,
                rate_cents=rate_cents(job.rate_micro_per_hour),
                max_runtime_s=job.max_runtime_s,
                expected_runtime_s=job.expected_s,
                priority=job.priority,
                requested_at=self.now,
                on_limit=job.on_limit if self.limits else None,
                max_wait_s=job.max_wait_s if self.limits else None,
                shape=job.shape,
            )

    def decide(self) -> float:
        """4. The gate's decision on the queue: admit, refuse or leave waiting each job; when the
        first of those waiting may be admitted (inf: not known)."""
        state = LedgerState(
            self.now,
            self.rules,
            list(self.active.values()),
            self.spent,
            metering=self.pol.metering,
            overrun=self.learned.factors if self.learned is not None else {},
            fit_worst_case=self.pol.fit_worst_case,
            pools=dict(self.pools),
            quotas=dict(self.quotas),
            placed=list(self.footprints.values()),
        )
        wake = math.inf
        for job_id, decision in plan(state, self.queue.values()).items():
            if decision.verdict == "admit":
                self.admit(job_id, decision)
                continue
            record = self.records[job_id]
            record.blocked = (decision.limit, decision.scope, decision.resumes_at)
            if decision.verdict in ("reject", "timeout"):
                del self.queue[job_id]
                self.released -= 1
                record.refused, record.refused_at = decision.verdict, self.now
                continue
            if decision.resumes_at is not None:
                wake = min(wake, decision.resumes_at)
            if self.limits:  # re-decide when its max wait runs out
                wake = min(wake, _wait_ends(self.queue[job_id], self.rules))
        return wake

    def admit(self, job_id: str, decision: Decision) -> None:
        """A job admitted now: it holds its reservation (and its place in a pool) and ends at its
        true runtime after its start, or at max_runtime where the policy stops it."""
        now, record = self.now, self.records[job_id]
        job = record.job
        del self.queue[job_id]
        self.order.append(job_id)
        self.active[job_id] = Hold(
            job.scope,
            rate_cents(job.rate_micro_per_hour),
            decision.reserved_micro,
            now,
            now + decision.reserve_seconds,
            job.rate_micro_per_hour,
            now + job.start_s + job.max_runtime_s,
        )
        record.admitted_at = now
        record.reserved_micro = decision.reserved_micro
        if job.shape is not None and self.pools:
            self.footprints[job_id] = Placed(
                job_id, job.shape, decision.placement, job.priority, now
            )
        run = job.true_s
        if self.pol.stop_at_max_runtime:
            run = min(run, job.max_runtime_s)
        self.ends_at[job_id] = now + job.start_s + run
        heapq.heappush(self.events, (self.ends_at[job_id], END, job_id))

    def wake(self, at: float) -> None:
        """5. Come back at `at` (once) to decide again."""
        if at < math.inf and not any(e[1] == WAKE and e[0] == at for e in self.events):
            heapq.heappush(self.events, (at, WAKE, ""))


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

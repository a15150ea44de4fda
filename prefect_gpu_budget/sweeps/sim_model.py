"""The simulator's model: its policies (`POLICIES`), the jobs it runs (`SimJob`), what became
of each (`SimRecord`) and a run's result (`SimResult`), with the spend and waits read from it.
The run itself is `simulator.simulate`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.accounting import book, period_shares
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Shape
from prefect_gpu_budget.units import scope_path


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

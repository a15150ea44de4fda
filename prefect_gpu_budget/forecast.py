"""What a sweep will do before it spends anything: the simulator run from the ledger's state.

Each trial is taken to run for its expected runtime (or its max runtime if no estimate is
given); at most `parallelism` trials ask for admission at once, as in the sweep itself; a trial
that would wait past its `max_wait`, or meet a limit with `on_limit: reject`, ends unadmitted
as the gate would end it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from prefect_gpu_budget.admission import periods
from prefect_gpu_budget.admission.ledger import ACTIVE, Ledger, hold_of
from prefect_gpu_budget.admission.policy import BudgetRule, Hold, max_wait_of
from prefect_gpu_budget.pricing.catalog import price_job
from prefect_gpu_budget.priorities import resolve
from prefect_gpu_budget.simulate import SimJob, SimResult, simulate
from prefect_gpu_budget.sweep_spec import SweepSpec
from prefect_gpu_budget.units import (
    BudgetInputError,
    fmt_duration,
    fmt_usd,
    micro_to_usd,
    org_of,
    scope_path,
)

HORIZON_S = 7 * 86400


@dataclass(frozen=True)
class Forecast:
    trials: int
    admitted: int
    spend_micro: int
    makespan_s: float
    waiting: int
    mean_wait_s: float
    stopped_by: str | None
    """The period budget that leaves trials unadmitted within the horizon, and when it resets."""
    result: SimResult
    timed_out: int = 0
    rejected: int = 0
    max_wait_s: float = 0.0
    """The max wait that times trials out (0: they wait as long as it takes)."""
    warnings: tuple[str, ...] = ()
    """The price warnings of the trials' quotes (stale, unverified, an upper bound)."""

    def as_dict(self) -> dict[str, object]:
        """The figures as `forecast --json` and the agent gateway give them."""
        return {
            "trials": self.trials,
            "admitted": self.admitted,
            "timed_out": self.timed_out,
            "rejected": self.rejected,
            "spend_usd": micro_to_usd(self.spend_micro),
            "makespan_s": round(self.makespan_s, 1),
            "waiting": self.waiting,
            "mean_wait_s": round(self.mean_wait_s, 1),
            "max_wait_s": self.max_wait_s,
            "stopped_by": self.stopped_by,
            "warnings": list(self.warnings),
            "summary": self.describe(),
        }

    def describe(self) -> str:
        lines = [
            f"{self.admitted} of {self.trials} trials admitted within {fmt_duration(HORIZON_S)}; "
            f"spend {fmt_usd(self.spend_micro)}; makespan {fmt_duration(self.makespan_s)}",
            f"{self.waiting} trials wait (mean {fmt_duration(self.mean_wait_s)})",
        ]
        if self.timed_out:
            lines.append(
                f"{self.timed_out} trials will time out after {fmt_duration(self.max_wait_s)} "
                "(max_wait)"
            )
        if self.rejected:
            lines.append(f"{self.rejected} trials will be rejected (on_limit: reject)")
        if self.stopped_by:
            lines.append(f"stopped by {self.stopped_by}")
        lines += [f"price warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def _rules(ledger: Ledger, scope: str) -> dict[str, BudgetRule]:
    rules = {r.scope: r for r in ledger.config.budgets(org_of(scope))}
    team = scope.rsplit("/", 1)[0]
    if scope.count("/") == 2 and scope not in rules:
        template = {t.scope: t for t in ledger.config.session_templates()}.get(team)
        if template is not None:
            rules[scope] = replace(template, scope=scope)
    return rules


def forecast(spec: SweepSpec, ledger: Ledger, now: float | None = None) -> Forecast:
    """The sweep as the gate would run it: each trial priced as the gate prices it
    (`price_job`: a part of a machine pays its part), in a scope the gate would accept (a
    `BudgetInputError` naming the level nobody created, as the gate refuses it)."""
    now = time.time() if now is None else now
    unknown = ledger.views.unknown_scope(spec.scope)
    if unknown is not None:
        raise BudgetInputError("scope", unknown)
    trials = spec.trials()
    classes = ledger.config.priority_values(spec.scope)
    jobs, warnings = [], {}
    for index, params in enumerate(trials):
        job = spec.job_for(params, f"{spec.name}/{index:04d}")
        quote = price_job(job)[0]
        warnings.update(dict.fromkeys(quote.warnings))
        runtime = job.expected_runtime or job.max_runtime
        jobs.append(
            SimJob(
                job_id=f"{index:04d}",
                scope=spec.scope,
                arrival=now + index * 1e-6,
                rate_micro_per_hour=quote.rate_micro_per_hour,
                expected_s=runtime,
                true_s=runtime,
                max_runtime_s=job.reserve_runtime_s,
                priority=job.priority
                if isinstance(job.priority, int)
                else resolve(job.priority, classes, org_of(spec.scope)),
                on_limit=job.on_limit,
                max_wait_s=job.max_wait,
            )
        )
    rules = _rules(ledger, spec.scope)
    mode = (
        "guaranteed"
        if any(
            rules[s].reservation_mode == "guaranteed" for s in scope_path(spec.scope) if s in rules
        )
        else "estimate-metered"
    )
    holds, settled = _ledger_state(ledger, rules, org_of(spec.scope), now)
    result = simulate(
        jobs,
        rules.values(),
        mode,
        until=now + HORIZON_S,
        settled=settled,
        holds=holds,
        in_flight=spec.parallelism,
        limits=True,
    )
    admitted = [r for r in result.records if r.admitted_at is not None]
    waits = [r.wait_s for r in admitted if r.wait_s and r.wait_s > 1e-3]  # not ties of the clock
    ends = [r.ended_at for r in admitted if r.ended_at is not None]
    stopped_by = None
    by_budget = [r for r in result.records if r.blocked and r.blocked[0] == "period_budget"]
    if by_budget:
        _, scope, resumes = by_budget[0].blocked
        rule = rules[scope]
        late = [
            r
            for r in result.records
            if r.admitted_at is None or (resumes and r.admitted_at >= resumes)
        ]
        stopped_by = (
            f"the {rule.period} budget of {scope} ({fmt_usd(rule.period_budget_micro or 0)}): "
            f"{len(late)} trials wait until it resets "
            f"{periods.fmt_instant(resumes, rule.timezone) if resumes else 'later'}"
        )
    path = [rules[s] for s in scope_path(spec.scope) if s in rules]
    own_wait = spec.job_for(trials[0], spec.name).max_wait if trials else None
    max_wait = max_wait_of(own_wait, path)
    return Forecast(
        trials=len(trials),
        admitted=len(admitted),
        spend_micro=sum(r.actual_micro for r in admitted),
        makespan_s=(max(ends) - now) if ends else 0.0,
        waiting=len(waits),
        mean_wait_s=sum(waits) / len(waits) if waits else 0.0,
        stopped_by=stopped_by,
        result=result,
        timed_out=sum(r.refused == "timeout" for r in result.records),
        rejected=sum(r.refused == "reject" for r in result.records),
        max_wait_s=max_wait,
        warnings=tuple(warnings),
    )


def _ledger_state(
    ledger: Ledger, rules: dict[str, BudgetRule], org: str, now: float
) -> tuple[list[Hold], dict[tuple[str, float], int]]:
    holds = [hold_of(row, now=now) for row in ledger.views.jobs(org, states=ACTIVE)]
    settled = {}
    for rule in rules.values():
        if rule.period_budget_micro is not None:
            p_start, _ = periods.bounds(rule.period, rule.timezone, now)
            settled[(rule.scope, p_start)] = ledger.views.period_settled(rule.scope, p_start)
    return holds, settled


def plot(result: Forecast, path: Path, budget: BudgetRule | None) -> Path | None:
    """Predicted spend over time against the period budget (the same picture as a sweep's): the
    line is each trial's expected cost, the band above it what the gate holds for the running
    trials (in guaranteed mode their worst case, rate x (max_runtime + kill grace)): the top of
    the band meets the budget where trials wait."""
    from prefect_gpu_budget.plots import spend_over_time

    rows = plot_rows(result)
    resets = []
    if budget is not None and rows:
        first, last = rows[0]["admitted_at"], max(r["ended_at"] or 0 for r in rows)
        at = periods.bounds(budget.period, budget.timezone, first)[1]
        while at <= last and len(resets) < 100:
            resets.append(at)
            at = periods.bounds(budget.period, budget.timezone, at)[1]
    return spend_over_time(
        rows,
        path,
        resets=resets,
        budget_micro=budget.period_budget_micro if budget else None,
        cap_micro_per_hour=budget.hourly_cap_cents * 10_000
        if budget and budget.hourly_cap_cents
        else None,
        title="forecast: spend of the sweep in each period",
        forecast=True,
    )


def plot_rows(result: Forecast) -> list[dict[str, float | int | None]]:
    """The admitted trials as the spend plot takes them: reserved what the gate would hold for
    each (what binds), settled at its expected cost."""
    return [
        {
            "admitted_at": r.admitted_at,
            "started_at": r.admitted_at,
            "ended_at": r.ended_at,
            "settled_at": r.ended_at,
            "reserved_micro": r.reserved_micro,
            "actual_micro": r.actual_micro,
            "rate_micro_per_hour": r.job.rate_micro_per_hour,
        }
        for r in result.result.records
        if r.admitted_at is not None
    ]

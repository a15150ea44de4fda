"""What a sweep will do before it spends anything: the simulator run from the ledger's state.

Two runs of the one simulation, told apart (a figure says what it is):

- the likely outcome: each trial runs as long as it ran when it last finished (a forecast made
  mid-sweep, or after an earlier run of it), a trial that has not as long as this sweep's
  finished trials have run (the mean of its latest ones in the ledger), else its
  `expected_runtime`, else its `max_runtime`;
- the bound: each trial runs to its `max_runtime` and kill grace, the most it can cost and what
  the gate holds for it in guaranteed mode.

In both, a trial takes as long to start after its admission as this sweep's finished trials
took, or, before any has finished, as the latest jobs on its launcher took, or, before any has,
as a local process typically takes (`LOCAL_START_S`; none known on another launcher): a launch
holds the trial's cap and its place in the pool, unbilled.

Two spans are given, each saying what it covers: the makespan, from the first request to the
last admitted trial's end, and the sweep's end, which also counts the trials that wait their
max wait out (a trial that times out ends only then).

Both reserve what the gate would reserve and take the room it would give them in a capacity
pool (their team's quota); at most `parallelism` trials ask for admission at once, as in the
sweep itself; a trial that would wait past its `max_wait`, or meet a limit with `on_limit:
reject`, ends unadmitted as the gate would end it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from prefect_gpu_budget.admission.ledger import ACTIVE, LEARNED_OUTCOMES, Ledger, hold_of
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Hold, max_wait_of
from prefect_gpu_budget.admission.rules.quota import Placed, Shape, job_share, pool_for, team_of
from prefect_gpu_budget.job import GpuJob
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
HISTORY_TRIALS = 20
"""How many of a sweep's latest finished trials its likely runtime is the mean of."""
HISTORY_ROWS = 2000
"""How many of the scope's latest settled jobs are searched for them."""
LOCAL_START_S = 0.2
"""How long a trial on the local launcher typically takes from its admission to its start
(Prefect's slots, the task run, the process), before any trial of its sweep has finished: the
mean of 36 trials of `benchmarks/forecast_fidelity.py`'s first runs on two cores (0.10-0.64 s
each, 2026-12-06; more on a busy machine). Without it a first forecast's rounds came out short
by about that much each."""


@dataclass(frozen=True)
class Outcome:
    """The sweep's figures in one run of the simulation, each trial running `runtime_s`."""

    runtime_s: float
    admitted: int
    timed_out: int
    rejected: int
    spend_micro: int
    makespan_s: float
    """From the first request to the last admitted trial's end (0: none is admitted)."""
    end_s: float | None
    """From the first request to the sweep's end: its last trial's end or time-out (a trial
    that times out waits its max wait first); None where a trial still waits at the horizon."""
    waiting: int
    mean_wait_s: float
    stopped_by: str | None
    """The period budget that leaves trials unadmitted within the horizon, and when it resets."""
    result: SimResult

    def as_dict(self) -> dict[str, object]:
        return {
            "runtime_s": round(self.runtime_s, 1),
            "admitted": self.admitted,
            "timed_out": self.timed_out,
            "rejected": self.rejected,
            "spend_usd": micro_to_usd(self.spend_micro),
            "makespan_s": round(self.makespan_s, 1),
            "end_s": None if self.end_s is None else round(self.end_s, 1),
            "waiting": self.waiting,
            "mean_wait_s": round(self.mean_wait_s, 1),
            "stopped_by": self.stopped_by,
        }

    def headline(self, trials: int, max_wait_s: float) -> str:
        """`9 of 12 trials admitted within 7d, 3 time out after 30s (max_wait); spend ...;
        makespan 16s to the last end, 30s with time-outs`."""
        ended = [f"{self.admitted} of {trials} trials admitted within {fmt_duration(HORIZON_S)}"]
        if self.timed_out:
            ended.append(f"{self.timed_out} time out after {fmt_duration(max_wait_s)} (max_wait)")
        if self.rejected:
            ended.append(f"{self.rejected} rejected (on_limit: reject)")
        return f"{', '.join(ended)}; spend {fmt_usd(self.spend_micro)}; {self.spans()}"

    def spans(self) -> str:
        """How long the sweep takes, each span saying what it covers: `makespan 16s to the last
        end` (of an admitted trial) and, where the sweep is over later, `30s with time-outs`
        (a trial that times out waits its max wait first)."""
        said = []
        if self.admitted:
            said.append(f"makespan {fmt_duration(self.makespan_s)} to the last end")
        refused = "time-outs" if self.timed_out else "refusals"
        if self.end_s is None:
            said.append(f"not over within {fmt_duration(HORIZON_S)}")
        elif not self.admitted:
            said.append(f"over after {fmt_duration(self.end_s)} ({refused})")
        elif self.end_s > self.makespan_s + 0.5:
            said.append(f"{fmt_duration(self.end_s)} with {refused}")
        return ", ".join(said)


@dataclass(frozen=True)
class Forecast:
    """The likely outcome and the bound of a sweep; its bare figures (`admitted`, `spend_micro`
    ...) are the likely ones."""

    trials: int
    likely: Outcome
    bound: Outcome
    runtime_from: str
    """What the likely runtime is taken from: the sweep's finished trials, its expected_runtime,
    or its max_runtime when it has neither."""
    start_s: float = 0.0
    """How long each trial takes to start after its admission, in both runs: as the sweep's
    finished trials took, else the latest jobs on its launcher, else the local launcher's typical
    start (`start_from` says which)."""
    start_from: str = "none known"
    """What `start_s` is taken from."""
    reserve_s: float = 0.0
    """What the gate reserves each trial for in guaranteed mode: max_runtime + kill grace."""
    max_wait_s: float = 0.0
    """The max wait that times trials out (0: they wait as long as it takes)."""
    warnings: tuple[str, ...] = ()
    """The price warnings of the trials' quotes (stale, unverified, an upper bound)."""

    @property
    def admitted(self) -> int:
        return self.likely.admitted

    @property
    def timed_out(self) -> int:
        return self.likely.timed_out

    @property
    def rejected(self) -> int:
        return self.likely.rejected

    @property
    def spend_micro(self) -> int:
        return self.likely.spend_micro

    @property
    def makespan_s(self) -> float:
        return self.likely.makespan_s

    @property
    def end_s(self) -> float | None:
        return self.likely.end_s

    @property
    def waiting(self) -> int:
        return self.likely.waiting

    @property
    def mean_wait_s(self) -> float:
        return self.likely.mean_wait_s

    @property
    def stopped_by(self) -> str | None:
        return self.likely.stopped_by

    @property
    def result(self) -> SimResult:
        return self.likely.result

    def as_dict(self) -> dict[str, object]:
        """The figures as `forecast --json` and the agent gateway give them: `likely` and
        `bound` each with the same fields; the top-level `admitted`, `timed_out`, `rejected`,
        `spend_usd`, `makespan_s`, `end_s`, `waiting`, `mean_wait_s` and `stopped_by` are the
        likely ones, as `likely` gives them (kept at the top for clients that read them
        there)."""
        likely = self.likely.as_dict()
        return {
            "trials": self.trials,
            **{k: v for k, v in likely.items() if k != "runtime_s"},
            "likely": likely,
            "bound": self.bound.as_dict(),
            "runtime_from": self.runtime_from,
            "start_s": round(self.start_s, 2),
            "start_from": self.start_from,
            "reserve_s": round(self.reserve_s, 1),
            "max_wait_s": self.max_wait_s,
            "warnings": list(self.warnings),
            "summary": self.describe(),
        }

    def describe(self) -> str:
        likely, bound = self.likely, self.bound
        lines = [
            f"likely, each trial {_runtime(likely.runtime_s)} ({self.runtime_from}): "
            + likely.headline(self.trials, self.max_wait_s),
            f"each trial starts {_runtime(self.start_s)} after its admission ({self.start_from}); "
            "the makespan runs from the first request to the last admitted trial's end, and "
            "the sweep is over when its last trial ends or times out",
        ]
        if likely.waiting:
            lines.append(f"{likely.waiting} trials wait (mean {fmt_duration(likely.mean_wait_s)})")
        if likely.stopped_by:
            lines.append(f"stopped by {likely.stopped_by}")
        lines.append(
            f"bound, if every trial ran to its max_runtime ({_runtime(self.reserve_s)} with "
            "kill grace, what the gate reserves for it): "
            + bound.headline(self.trials, self.max_wait_s)
        )
        lines += [f"price warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def _runtime(seconds: float) -> str:
    """A trial's runtime as the summary gives it: `2.5s` (to 3 figures) under a minute."""
    return f"{seconds:.3g}s" if seconds < 59.5 else fmt_duration(seconds)


def _rules(ledger: Ledger, scope: str) -> dict[str, BudgetRule]:
    rules = {r.scope: r for r in ledger.config.budgets(org_of(scope))}
    team = scope.rsplit("/", 1)[0]
    if scope.count("/") == 2 and scope not in rules:
        template = {t.scope: t for t in ledger.config.session_templates()}.get(team)
        if template is not None:
            rules[scope] = replace(template, scope=scope)
    return rules


def finished_trials(
    spec: SweepSpec, ledger: Ledger, latest: int | None = HISTORY_TRIALS
) -> list[dict]:
    """The sweep's latest finished trials in the ledger, oldest first (at most `latest`; None:
    all of those among the scope's latest `HISTORY_ROWS` settled jobs): its jobs named
    `<name>/<index>` in its scope that started and ran their course (`LEARNED_OUTCOMES`)."""
    named = re.compile(re.escape(spec.name) + r"/\d{4,}")
    found = [
        row
        for row in ledger.views.jobs(spec.scope, states=("settled",), limit=HISTORY_ROWS)
        if row["scope"] == spec.scope
        and named.fullmatch(row["name"] or "")
        and row["outcome"] in LEARNED_OUTCOMES
        and (row["billed_seconds"] or 0) > 0
        and row["started_at"] is not None
        and row["admitted_at"] is not None
    ]
    return found if latest is None else found[-latest:]


def likely_runtime(job: GpuJob, finished: list[dict]) -> tuple[float, str]:
    """How long a trial likely runs, and what says so: the mean billed runtime of the sweep's
    `finished` trials, else the job's expected_runtime, else its max_runtime."""
    if finished:
        shown = [row["billed_seconds"] for row in finished]
        return sum(shown) / len(shown), f"as its {_trials(len(shown))} ran"
    if job.expected_runtime:
        return job.expected_runtime, "its expected_runtime"
    return job.max_runtime, "its max_runtime: no expected_runtime and no finished trial"


def trial_runtimes(finished: list[dict]) -> dict[int, float]:
    """How long each of the sweep's trials ran when it last finished, by its index: trials of
    one sweep differ (their parameters), and two at a time the longest ones set the makespan."""
    return {int(row["name"].rsplit("/", 1)[1]): row["billed_seconds"] for row in finished}


def launcher_jobs(spec: SweepSpec, ledger: Ledger) -> list[dict]:
    """The latest settled jobs of the sweep's org on its launcher (at most `HISTORY_TRIALS`),
    oldest first: those that started and ran their course, whatever their sweep."""
    ref = spec.launcher or "local"
    return [
        row
        for row in ledger.views.jobs(org_of(spec.scope), states=("settled",), limit=HISTORY_ROWS)
        if row["launcher"] == ref
        and row["outcome"] in LEARNED_OUTCOMES
        and row["started_at"] is not None
        and row["admitted_at"] is not None
    ][-HISTORY_TRIALS:]


def likely_start(
    finished: list[dict], local: bool = True, others: list[dict] | None = None
) -> tuple[float, str]:
    """How long a trial likely takes to start after its admission, and what says so: the mean
    of the sweep's `finished` trials, else of the latest jobs on its launcher (`others`), else
    `LOCAL_START_S` on the local launcher (`local`), else none known (0)."""
    for rows, took in ((finished, "its {}"), (others or [], "its launcher's latest {}")):
        waits = [max(0.0, row["started_at"] - row["admitted_at"]) for row in rows]
        if waits:
            jobs = _trials(len(waits)) if rows is finished else _jobs(len(waits))
            return sum(waits) / len(waits), f"as {took.format(jobs)} took"
    if local:
        return LOCAL_START_S, "a local process's typical start: nothing finished on it yet"
    return 0.0, "none known on this launcher: nothing finished on it yet"


def _trials(count: int) -> str:
    return f"{count} finished trials" if count != 1 else "1 finished trial"


def _jobs(count: int) -> str:
    return f"{count} jobs" if count != 1 else "job"


def forecast(spec: SweepSpec, ledger: Ledger, now: float | None = None) -> Forecast:
    """The sweep as the gate would run it, likely and at worst: each trial priced as the gate
    prices it (`price_job`: a part of a machine pays its part), in a scope the gate would accept
    (a `BudgetInputError` naming the level nobody created, as the gate refuses it)."""
    now = time.time() if now is None else now
    unknown = ledger.views.unknown_scope(spec.scope)
    if unknown is not None:
        raise BudgetInputError("scope", unknown)
    trials = spec.trials()
    org = org_of(spec.scope)
    classes = ledger.config.priority_values(spec.scope)
    pools, quotas = ledger.config.capacity(org)
    jobs, warnings = [], {}
    for index, params in enumerate(trials):
        job = spec.job_for(params, f"{spec.name}/{index:04d}")
        quote, share = price_job(job)
        warnings.update(dict.fromkeys(quote.warnings))
        pool = pool_for(pools, job.instance_type, job.pool)
        jobs.append(
            SimJob(
                job_id=f"{index:04d}",
                scope=spec.scope,
                arrival=now + index * 1e-6,
                rate_micro_per_hour=quote.rate_micro_per_hour,
                expected_s=job.expected_runtime or job.reserve_runtime_s,  # as the gate asks
                true_s=job.reserve_runtime_s,  # each run below says how long trials take
                max_runtime_s=job.reserve_runtime_s,
                priority=job.priority
                if isinstance(job.priority, int)
                else resolve(job.priority, classes, org),
                on_limit=job.on_limit,
                max_wait_s=job.max_wait,
                shape=None
                if pool is None
                else Shape(  # what the gate places it as (`job_share`)
                    pool.name,
                    team_of(spec.scope),
                    job_share(pool, share.gpus, share.vcpu or None, share.memory_gib or None),
                    job.nodes,
                ),
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
    holds, placed, settled = _ledger_state(ledger, rules, org, now)

    finished = finished_trials(spec, ledger)
    start_s, start_from = likely_start(
        finished, spec.launcher is None, [] if finished else launcher_jobs(spec, ledger)
    )
    ran = trial_runtimes(finished_trials(spec, ledger, latest=None))

    def run(runtime_s: float, each: dict[int, float] | None = None) -> Outcome:
        """Every trial `runtime_s`, or as long as `each` says it ran last where it says."""
        each = each or {}
        result = simulate(
            [
                replace(job, true_s=each.get(index, runtime_s), start_s=start_s)
                for index, job in enumerate(jobs)
            ],
            rules.values(),
            mode,
            until=now + HORIZON_S,
            settled=settled,
            holds=holds,
            in_flight=spec.parallelism,
            limits=True,
            pools=pools,
            quotas=quotas,
            placed=placed,
        )
        return _outcome(result, runtime_s, rules, now)

    first = spec.job_for(trials[0] if trials else {}, spec.name)
    runtime, runtime_from = likely_runtime(first, finished)
    own = sum(index in ran for index in range(len(trials)))
    if own == len(trials) and own:
        runtime_from = f"as each last ran, the mean of its {_trials(own)}"
        runtime = sum(ran[index] for index in range(own)) / own
    elif own:
        runtime_from = f"{own} as each last ran, the rest {runtime_from}"
    path = [rules[s] for s in scope_path(spec.scope) if s in rules]
    return Forecast(
        trials=len(trials),
        likely=run(runtime, ran),
        bound=run(first.reserve_runtime_s),
        runtime_from=runtime_from,
        start_s=start_s,
        start_from=start_from,
        reserve_s=first.reserve_runtime_s,
        max_wait_s=max_wait_of(first.max_wait, path),
        warnings=tuple(warnings),
    )


def _outcome(
    result: SimResult, runtime_s: float, rules: dict[str, BudgetRule], now: float
) -> Outcome:
    """The figures of one run of the simulation, from `now`."""
    admitted = [r for r in result.records if r.admitted_at is not None]
    waits = [r.wait_s for r in admitted if r.wait_s and r.wait_s > 1e-3]  # not ties of the clock
    ends = [r.ended_at for r in admitted if r.ended_at is not None]
    refused = [r.refused_at for r in result.records if r.refused_at is not None]
    over = all(r.ended_at is not None or r.refused_at is not None for r in result.records)
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
        ended = sum(r.refused is not None for r in late)  # their max wait runs out first
        held = [
            f"{ended} trials end unrun first (their max wait runs out)" if ended else "",
            f"{len(late) - ended} trials wait until it resets "
            f"{periods.fmt_instant(resumes, rule.timezone) if resumes else 'later'}"
            if len(late) > ended
            else "",
        ]
        stopped_by = (
            f"the {rule.period} budget of {scope} ({fmt_usd(rule.period_budget_micro or 0)}): "
            + "; ".join(part for part in held if part)
        )
    return Outcome(
        runtime_s=runtime_s,
        admitted=len(admitted),
        timed_out=sum(r.refused == "timeout" for r in result.records),
        rejected=sum(r.refused == "reject" for r in result.records),
        spend_micro=sum(r.actual_micro for r in admitted),
        makespan_s=(max(ends) - now) if ends else 0.0,
        end_s=max([*ends, *refused, now]) - now if over else None,
        waiting=len(waits),
        mean_wait_s=sum(waits) / len(waits) if waits else 0.0,
        stopped_by=stopped_by,
        result=result,
    )


def _ledger_state(
    ledger: Ledger, rules: dict[str, BudgetRule], org: str, now: float
) -> tuple[list[Hold], list[Placed | None], dict[tuple[str, float], int]]:
    """The org's admitted and running jobs (what each holds, and where it sits in a capacity
    pool) and the settled spend of the budgets' current periods."""
    rows = ledger.views.jobs(org, states=ACTIVE)
    settled = {}
    for rule in rules.values():
        if rule.period_budget_micro is not None:
            p_start, _ = periods.bounds(rule.period, rule.timezone, now)
            settled[(rule.scope, p_start)] = ledger.views.period_settled(rule.scope, p_start)
    return [hold_of(row, now=now) for row in rows], [_footprint(row) for row in rows], settled


def _footprint(row: dict) -> Placed | None:
    """An admitted job's place in its capacity pool, from its row (None: in no pool)."""
    if row["pool"] is None:
        return None
    return Placed(
        row["id"],
        Shape(
            row["pool"],
            row["team"],
            (row["node_gpus"], row["node_vcpu"], row["node_memory_gib"]),
            row["nodes"],
        ),
        tuple(int(i) for i in (row["placement"] or "").split(",") if i),
        row["priority"],
        row["admitted_at"],
        row["preempt_at"] is not None,
    )


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

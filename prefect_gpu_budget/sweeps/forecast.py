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
reject`, ends unadmitted as the gate would end it. The figures are `outcome`'s.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

from prefect_gpu_budget.admission.ledger import ACTIVE, LEARNED_OUTCOMES, Ledger, hold_of
from prefect_gpu_budget.admission.prices import price_job
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Hold, max_wait_of
from prefect_gpu_budget.admission.rules.quota import (
    Placed,
    Pool,
    Shape,
    TeamQuota,
    job_share,
    pool_for,
    team_of,
)
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.priorities import resolve
from prefect_gpu_budget.sweeps.outcome import HORIZON_S, Forecast, Outcome, outcome_of
from prefect_gpu_budget.sweeps.simulator import SimJob, simulate
from prefect_gpu_budget.sweeps.spec import Scalar, SweepSpec
from prefect_gpu_budget.units import (
    BudgetInputError,
    org_of,
    scope_path,
)

HISTORY_TRIALS = 20
"""How many of a sweep's latest finished trials its likely runtime is the mean of."""
HISTORY_ROWS = 2000
"""How many of the latest settled jobs are searched: the sweep's own (`finished_trials`), the
org's on its launcher (`launcher_jobs`)."""
LOCAL_START_S = 0.2
"""How long a trial on the local launcher typically takes from its admission to its start
(Prefect's slots, the task run, the process), before any trial of its sweep has finished: the
mean of 36 trials of `benchmarks/forecast_fidelity.py`'s first runs on two cores (0.10-0.64 s
each, 2026-12-06; more on a busy machine). Without it a first forecast's rounds came out short
by about that much each."""


def _rules(ledger: Ledger, scope: str) -> dict[str, BudgetRule]:
    """The budgets on the sweep's path (its session's from its team's template, if it has none
    yet): the only ones its trials must fit. The org's other budgets hold only jobs admitted
    already, which the forecast starts from; reading them all would cost a read per budget."""
    rules = {r.scope: r for r in ledger.config.path_budgets(scope)}
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
    all of those among its latest `HISTORY_ROWS` settled jobs): its jobs named
    `<name>/<index>` in its scope that started and ran their course (`LEARNED_OUTCOMES`). The
    name is matched in SQL too, so a session's other work is not read."""
    named = re.compile(re.escape(spec.name) + r"/\d{4,}")
    settled = ledger.views.jobs(
        spec.scope, states=("settled",), limit=HISTORY_ROWS, named=f"{spec.name}/"
    )
    found = [
        row
        for row in settled
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
    pools, quotas = ledger.config.capacity(org_of(spec.scope))
    spec = placed_spec(spec, ledger, now)  # 0. trials asking for accelerators, placed
    jobs, warnings = trial_jobs(spec, ledger, trials, pools, now)  # 1. the trials as jobs
    runs = ForecastRuns(spec, ledger, jobs, now, pools, quotas)  # 2. the ledger's state
    finished = finished_trials(spec, ledger)  # 3. how long its trials take to start, and run
    runs.start_s, start_from = likely_start(
        finished, spec.launcher is None, [] if finished else launcher_jobs(spec, ledger)
    )
    ran = trial_runtimes(finished_trials(spec, ledger, latest=None))
    first = spec.job_for(trials[0] if trials else {}, spec.name)
    runtime, runtime_from = sweep_runtime(first, finished, ran, len(trials))
    path = [runs.rules[s] for s in scope_path(spec.scope) if s in runs.rules]
    return Forecast(  # 4. the likely run and the bound
        trials=len(trials),
        likely=runs.run(runtime, ran),
        bound=runs.run(first.reserve_runtime_s),
        runtime_from=runtime_from,
        start_s=runs.start_s,
        start_from=start_from,
        reserve_s=first.reserve_runtime_s,
        max_wait_s=max_wait_of(first.max_wait, path),
        warnings=tuple(warnings),
    )


def placed_spec(spec: SweepSpec, ledger: Ledger, now: float) -> SweepSpec:
    """The spec as the gate would place its first trial now, for trials that ask for
    accelerators (each trial is placed when it starts; the forecast takes the first one's place
    for all); the spec as it is otherwise."""
    first = spec.job_for(spec.trials()[0] if spec.trials() else {}, spec.name)
    if first.placed:
        return spec
    from prefect_gpu_budget.placement.placing import place_job

    job = place_job(first, spec.scope, ledger, now=now).job
    where = {"instance_type": job.instance_type, "provisioning": job.provisioning}
    return spec.model_copy(update={"job": spec.job.model_copy(update=where)})


def trial_jobs(
    spec: SweepSpec,
    ledger: Ledger,
    trials: list[dict[str, Scalar]],
    pools: list[Pool],
    now: float,
) -> tuple[list[SimJob], dict[str, None]]:
    """Each trial as the simulator takes it, priced and placed as the gate would (its runtime
    is set by each run), and the price warnings of their quotes, in order."""
    org = org_of(spec.scope)
    classes = ledger.config.priority_values(spec.scope)
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
    return jobs, warnings


def sweep_runtime(
    first: GpuJob, finished: list[dict], ran: dict[int, float], trials: int
) -> tuple[float, str]:
    """The likely runtime of the sweep's trials, and what says so: as each last ran where all
    did, else `likely_runtime` (the trials that ran keep their own in `ForecastRuns.run`)."""
    runtime, runtime_from = likely_runtime(first, finished)
    own = sum(index in ran for index in range(trials))
    if own == trials and own:
        return sum(ran[index] for index in range(own)) / own, (
            f"as each last ran, the mean of its {_trials(own)}"
        )
    if own:
        return runtime, f"{own} as each last ran, the rest {runtime_from}"
    return runtime, runtime_from


class ForecastRuns:
    """The simulation of one sweep from the ledger's state now: its budgets and the mode they
    reserve in, the org's running jobs and the periods' settled spend; `run` runs it."""

    def __init__(
        self,
        spec: SweepSpec,
        ledger: Ledger,
        jobs: list[SimJob],
        now: float,
        pools: list[Pool],
        quotas: list[TeamQuota],
    ) -> None:
        self.jobs, self.now, self.pools, self.quotas = jobs, now, pools, quotas
        self.in_flight = spec.parallelism
        self.rules = _rules(ledger, spec.scope)
        guaranteed = any(
            self.rules[s].reservation_mode == "guaranteed"
            for s in scope_path(spec.scope)
            if s in self.rules
        )
        self.mode = "guaranteed" if guaranteed else "estimate-metered"
        self.holds, self.placed, self.settled = _ledger_state(
            ledger, self.rules, org_of(spec.scope), now
        )
        self.start_s = 0.0

    def run(self, runtime_s: float, each: dict[int, float] | None = None) -> Outcome:
        """Every trial `runtime_s`, or as long as `each` says it ran last where it says."""
        each = each or {}
        result = simulate(
            [
                replace(job, true_s=each.get(index, runtime_s), start_s=self.start_s)
                for index, job in enumerate(self.jobs)
            ],
            self.rules.values(),
            self.mode,
            until=self.now + HORIZON_S,
            settled=self.settled,
            holds=self.holds,
            in_flight=self.in_flight,
            limits=True,
            pools=self.pools,
            quotas=self.quotas,
            placed=self.placed,
        )
        return outcome_of(result, runtime_s, self.rules, self.now)


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
    from prefect_gpu_budget.sweeps.plots import spend_over_time

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

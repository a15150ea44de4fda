"""A forecast's figures (`forecast.forecast` makes them): the sweep in one run of the simulation
(`Outcome`, read from its `SimResult` by `outcome_of`), and the likely outcome and the bound
together (`Forecast`), as the CLI, the sweep flow and the agent gateway give them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.sweeps.sim_model import SimResult
from prefect_gpu_budget.units import fmt_duration, fmt_usd, micro_to_usd

HORIZON_S = 7 * 86400
"""How far ahead a forecast runs the simulation."""


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
            f"likely, each trial {runtime_text(likely.runtime_s)} ({self.runtime_from}): "
            + likely.headline(self.trials, self.max_wait_s),
            f"each trial starts {runtime_text(self.start_s)} after its admission ({self.start_from}); "
            "the makespan runs from the first request to the last admitted trial's end, and "
            "the sweep is over when its last trial ends or times out",
        ]
        if likely.waiting:
            lines.append(f"{likely.waiting} trials wait (mean {fmt_duration(likely.mean_wait_s)})")
        if likely.stopped_by:
            lines.append(f"stopped by {likely.stopped_by}")
        lines.append(
            f"bound, if every trial ran to its max_runtime ({runtime_text(self.reserve_s)} with "
            "kill grace, what the gate reserves for it): "
            + bound.headline(self.trials, self.max_wait_s)
        )
        lines += [f"price warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def runtime_text(seconds: float) -> str:
    """A trial's runtime as the summary gives it: `2.5s` (to 3 figures) under a minute."""
    return f"{seconds:.3g}s" if seconds < 59.5 else fmt_duration(seconds)


def outcome_of(
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

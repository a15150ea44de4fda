"""The choice: the offering with the lowest expected cost that fits every budget on the job's
path, can start within its max wait and ends before its deadline.

Expected figures come from each offering's own history (how long admitted jobs waited to start,
how often spot jobs were interrupted, what the bill charged against what was reserved) and the
admin's defaults until there is enough of it. The reservation stays the worst case, the rate
times the job's max runtime, as the money bound requires: the expected cost only orders the
offerings. Pure: no clock, no I/O; the budgets are asked through `fits`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from prefect_gpu_budget.placement.offerings import Offering
from prefect_gpu_budget.units import BudgetInputError, cost_micro, fmt_duration, fmt_usd

HOUR_S = 3600.0


@dataclass(frozen=True)
class History:
    """What the ledger saw of one offering (its key, provisioning and region)."""

    waits_s: tuple[float, ...] = ()
    """Admission to start, of each job it started."""
    run_hours: float = 0.0
    interruptions: int = 0
    """Times the cloud (or a team's reclaim) took the machine back."""
    billed_over_reserved: float | None = None
    """What the bill charged, over the rate the gate reserved at (a flex-start bound: < 1)."""


@dataclass(frozen=True)
class Defaults:
    """The admin's figures for an offering with too little history."""

    wait_s: Mapping[str, float] = field(
        default_factory=lambda: {"on-demand": 0.0, "spot": 300.0, "flex-start": 3600.0}
    )
    interruptions_per_hour: Mapping[str, float] = field(default_factory=lambda: {"spot": 0.05})
    resume_cost_s: float = 600.0
    """Lost to each interruption of a job that resumes from its checkpoint."""
    min_jobs: int = 3
    """Below this many started jobs, the defaults stand."""


@dataclass(frozen=True)
class Need:
    """What the job asks: how long it runs, how long it may wait, when it must end."""

    nodes: int
    runtime_s: float
    """Expected run (its `expected_runtime`, else its max)."""
    max_runtime_s: float
    max_wait_s: float | None = None
    deadline_s: float | None = None
    """The latest acceptable end, in seconds from now."""
    resumable: bool = False


@dataclass(frozen=True)
class Expected:
    wait_s: float
    """The median wait: what the expected cost and end are figured on."""
    hours: float
    """Machine-hours per node, interruptions' lost work included."""
    interruptions: float
    cost_micro: int
    end_s: float
    late_wait_s: float
    """The wait that nine starts in ten beat: what the max wait and the deadline are held to."""
    late_end_s: float


@dataclass(frozen=True)
class Considered:
    offering: Offering
    nodes: int
    expected: Expected
    reservation_micro: int
    """The worst case the gate reserves: the rate times the max runtime."""
    passed_over: str | None
    """Why it was not chosen; None for the chosen one."""

    def line(self) -> str:
        """One row of `quote`'s table of choices, SkyPilot-like, with CHOSEN on the pick."""
        o, e = self.offering, self.expected
        mark = "CHOSEN" if self.passed_over is None else f"passed over: {self.passed_over}"
        return (
            f"{o.describe()}: {fmt_usd(o.rate_micro_per_hour)}/h x{self.nodes}, "
            f"expected {fmt_usd(e.cost_micro)}, wait {fmt_duration(e.wait_s)}, "
            f"ends in {fmt_duration(e.end_s)}; {mark}"
        )

    def as_dict(self) -> dict[str, object]:
        """The row as `quote --json` and the agents' door give it."""
        o, e = self.offering, self.expected
        return {
            "offering": o.describe(),
            "instance_type": o.key,
            "provisioning": o.provisioning,
            "region": o.region,
            "launcher": o.launcher,
            "pool": o.pool,
            "usd_per_hour_per_node": o.rate_micro_per_hour / 1e6,
            "expected_usd": e.cost_micro / 1e6,
            "expected_wait_s": e.wait_s,
            "expected_end_s": e.end_s,
            "late_end_s": e.late_end_s,
            "reserved_usd": self.reservation_micro / 1e6,
            "chosen": self.passed_over is None,
            "passed_over": self.passed_over,
        }


@dataclass(frozen=True)
class Placement:
    chosen: Considered
    considered: tuple[Considered, ...]
    """Every offering, cheapest expected first."""

    def lines(self) -> list[str]:
        return [c.line() for c in self.considered]


class Unplaceable(BudgetInputError):
    """No offering fits: one line naming the closest."""

    def __init__(self, rule: str) -> None:
        super().__init__("accelerators", rule)


Fits = Callable[[Offering, int], "str | None"]
"""The budgets' answer for an offering and its reservation: None if it fits, else why not."""


def expect(offering: Offering, need: Need, history: History, defaults: Defaults) -> Expected:
    """Expected wait, machine-hours, interruptions, cost and end of `need` on `offering`."""
    enough = len(history.waits_s) >= defaults.min_jobs
    wait = late = defaults.wait_s.get(offering.provisioning, 0.0)
    if enough:
        waits = sorted(history.waits_s)
        wait = waits[len(waits) // 2]  # the median
        late = waits[min(len(waits) - 1, math.ceil(0.9 * len(waits)) - 1)]
    per_hour = defaults.interruptions_per_hour.get(offering.provisioning, 0.0)
    if enough and history.run_hours > 0:
        per_hour = history.interruptions / history.run_hours
    run_h = need.runtime_s / HOUR_S
    interruptions = per_hour * run_h
    lost_s = defaults.resume_cost_s if need.resumable else need.runtime_s / 2
    hours = run_h + interruptions * lost_s / HOUR_S
    ratio = history.billed_over_reserved if enough and history.billed_over_reserved else 1.0
    rate = offering.rate_micro_per_hour * need.nodes
    cost = math.ceil(cost_micro(rate, hours * HOUR_S, round_up=True) * ratio)

    def end(w: float) -> float:
        return w + hours * HOUR_S + interruptions * w

    return Expected(wait, hours, interruptions, cost, end(wait), late, end(late))


def _passed_over(
    offering: Offering, need: Need, expected: Expected, reservation: int, fits: Fits
) -> str | None:
    """Why `offering` cannot take the job, the first reason of: the cloud's limit, the max wait,
    the deadline, the budgets."""
    limit = offering.runtime_limit_s
    if limit is not None and need.max_runtime_s > limit:
        return f"{offering.provisioning} on {offering.cloud} runs at most {fmt_duration(limit)}"
    if need.max_wait_s is not None and expected.late_wait_s > need.max_wait_s:
        return f"one start in ten waits over {fmt_duration(expected.late_wait_s)}, over max wait"
    if need.deadline_s is not None and expected.late_end_s > need.deadline_s:
        return f"may end in {fmt_duration(expected.late_end_s)}, after the deadline"
    return fits(offering, reservation)


def place(
    candidates: Iterable[Offering],
    need: Need,
    histories: Mapping[tuple[str, str, str], History],
    fits: Fits,
    defaults: Defaults | None = None,
) -> Placement:
    """Every offering considered, cheapest expected first; the chosen one is the cheapest that
    fits (ties: the earlier end). `histories` by `(key, provisioning, region)`, region `""` for
    a machine's history in every region. Raises
    `Unplaceable`, naming the closest offering, when none fits; nothing is reserved then."""
    defaults = defaults or Defaults()
    rows = []
    for offering in candidates:
        history = histories.get(
            (offering.key, offering.provisioning, offering.region)
        ) or histories.get((offering.key, offering.provisioning, ""), History())
        expected = expect(offering, need, history, defaults)
        rate = offering.rate_micro_per_hour * need.nodes
        reservation = cost_micro(rate, need.max_runtime_s, round_up=True)
        why = _passed_over(offering, need, expected, reservation, fits)
        rows.append(Considered(offering, need.nodes, expected, reservation, why))
    if not rows:
        raise Unplaceable("no saved launcher or pool offers this machine")
    rows.sort(key=lambda c: (c.expected.cost_micro, c.expected.end_s, c.offering.describe()))
    fitting = [c for c in rows if c.passed_over is None]
    if not fitting:
        raise Unplaceable(_closest(rows, need))
    chosen = fitting[0]
    costlier = f"costlier than {chosen.offering.describe()}"
    considered = tuple(
        c if c is chosen else replace(c, passed_over=c.passed_over or costlier) for c in rows
    )
    return Placement(chosen, considered)


def _closest(rows: list[Considered], need: Need) -> str:
    """The one line for no fit: the deadline and the offering that would end soonest, or else
    the cheapest offering and why it cannot take the job."""
    if need.deadline_s is not None and all(c.expected.late_end_s > need.deadline_s for c in rows):
        soonest = min(rows, key=lambda c: c.expected.late_end_s)
        return (
            f"no offering ends before the deadline ({fmt_duration(need.deadline_s)}); closest: "
            f"{soonest.offering.describe()}, which may end in "
            f"{fmt_duration(soonest.expected.late_end_s)}"
        )
    cheapest = rows[0]
    return f"no offering fits; cheapest: {cheapest.offering.describe()}: {cheapest.passed_over}"

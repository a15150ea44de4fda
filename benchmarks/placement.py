"""Placement: a week of a research group's sweeps, placed four ways, side by side in one run.

Each trial asks for accelerators (`L4:1`, `A100:1`, `H100:8` or `H200:8`), with a run, a max
wait, a deadline and whether it resumes from a checkpoint. The strategies: always on-demand,
always spot, always flex-start (where offered; else on-demand), and the gate's choice
(`prefect_gpu_budget.placement.choice.place`, the real decision code, learning each offering's
waits, interruptions and billed-over-reserved from what it saw earlier in the week).

The capacity model, stated (no cloud is reachable from here; these are assumptions, not figures
of a cloud):
- on-demand: starts at once, except that an 8-GPU machine is out of stock with probability
  `STOCKOUT` (then it waits an exponential time of mean `STOCKOUT_WAIT_S`);
- spot: waits an exponential time of mean `SPOT_WAIT_S`, interrupted as a Poisson process of rate
  `SPOT_RATE_PER_H[gpus]`; a resumable trial loses `RESUME_S` per interruption, another starts
  over; each restart waits again;
- flex-start: waits an exponential time of mean `FLEX_WAIT_S[gpus]` (DWS: the wait is unbilled),
  never interrupted, billed at `FLEX_BILLED` of the rate the gate reserved at (the catalog has no
  flex-start figure for these machines, so that rate is the on-demand bound);
- a trial that cannot start within its max wait is counted as missing its deadline.
Prices come from the shipped catalog (`Catalog.load()`), Vertex AI in us-central1 and SageMaker
in us-east-1. Budgets are left out: every offering fits them.

Usage: python -m benchmarks.placement [--days 7] [--seed 1] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/placement.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import random
from collections import defaultdict
from dataclasses import dataclass

from benchmarks.harness import report
from prefect_gpu_budget.placement.accelerators import matching, parse_accelerators
from prefect_gpu_budget.placement.choice import History, Need, Unplaceable, place
from prefect_gpu_budget.placement.offerings import Offering, Route, offerings
from prefect_gpu_budget.placement.prices import catalog_rates
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import MICRO_PER_USD, cost_micro

HOUR = 3600.0
STOCKOUT = 0.25
STOCKOUT_WAIT_S = 6 * HOUR
SPOT_WAIT_S = 10 * 60.0
SPOT_RATE_PER_H = {1: 0.05, 8: 0.3}
FLEX_WAIT_S = {1: 20 * 60.0, 8: 3 * HOUR}
FLEX_BILLED = 0.55
RESUME_S = 10 * 60.0
ROUTES = (
    Route("vertex", "gcp", ("us-central1",), ("on-demand", "spot", "flex-start")),
    Route("sagemaker", "sagemaker", ("us-east-1",), ("on-demand", "spot")),
)
ASKS = (("L4:1", 0.35), ("A100:1", 0.35), ("H100:8", 0.15), ("H200:8", 0.15))
STRATEGIES = ("on-demand", "spot", "flex-start", "gate")


@dataclass(frozen=True)
class Trial:
    ask: str
    run_s: float
    max_wait_s: float
    deadline_s: float
    resumable: bool


def week(days: int, rng: random.Random) -> list[Trial]:
    """About 40 trials a day, in sweeps of 4 to 12 of one shape: runs log-normal around 2 h,
    deadlines from 1.3x to 4x the run, two in three resumable."""
    trials = []
    for _ in range(days * 5):
        ask = rng.choices([a for a, _ in ASKS], [w for _, w in ASKS])[0]
        run = min(max(rng.lognormvariate(0.7, 0.6), 0.25), 20) * HOUR
        slack = rng.choice((1.3, 2.0, 4.0))
        resumable = rng.random() < 2 / 3
        for _ in range(rng.randint(4, 12)):
            own = run * rng.uniform(0.8, 1.2)
            trials.append(Trial(ask, own, (slack - 1) * own, slack * own, resumable))
    return trials


class Capacity:
    """Draws waits and interruptions for an offering, per the stated model."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def wait(self, o: Offering) -> float:
        if o.provisioning == "spot":
            return self.rng.expovariate(1 / SPOT_WAIT_S)
        if o.provisioning == "flex-start":
            return self.rng.expovariate(1 / FLEX_WAIT_S[min(o.gpus, 8)])
        out = o.gpus >= 8 and self.rng.random() < STOCKOUT
        return self.rng.expovariate(1 / STOCKOUT_WAIT_S) if out else 0.0

    def interruption_after(self, o: Offering) -> float:
        rate = SPOT_RATE_PER_H.get(min(o.gpus, 8), 0.0) if o.provisioning == "spot" else 0.0
        return self.rng.expovariate(rate / HOUR) if rate else float("inf")


@dataclass
class Outcome:
    billed_micro: int = 0
    met: bool = True
    end_s: float = 0.0


def run_trial(trial: Trial, pick, capacity: Capacity, seen: dict) -> Outcome:
    """One trial to its end: placed by `pick`, waiting, running, interrupted and placed again;
    what it saw goes into `seen` (waits, run hours, interruptions, billed over reserved)."""
    out, left, clock = Outcome(), trial.run_s, 0.0
    while left > 0:
        o = pick(trial, left, clock)
        if o is None:
            return Outcome(out.billed_micro, False, clock)
        wait = capacity.wait(o)
        if wait > trial.max_wait_s:
            return Outcome(out.billed_micro, False, clock + trial.max_wait_s)
        clock += wait
        ran = min(left, capacity.interruption_after(o))
        billed = FLEX_BILLED if o.provisioning == "flex-start" else 1.0
        out.billed_micro += round(cost_micro(o.rate_micro_per_hour, ran, round_up=True) * billed)
        clock += ran
        k = (o.key, o.provisioning, o.region)
        seen[k]["waits"].append(wait)
        seen[k]["hours"] += ran / HOUR
        seen[k]["billed"] = billed
        if ran < left:  # interrupted
            seen[k]["interruptions"] += 1
            left = left - ran + RESUME_S if trial.resumable else trial.run_s
        else:
            left = 0
    out.end_s = clock
    out.met = clock <= trial.deadline_s
    return out


def strategy(name: str, offers: dict[str, list[Offering]], seen: dict):
    def fixed(trial: Trial, left: float, clock: float) -> Offering | None:
        cands = offers[trial.ask]
        want = [o for o in cands if o.provisioning == name] or [
            o for o in cands if o.provisioning == "on-demand"
        ]
        return min(want, key=lambda o: o.rate_micro_per_hour)

    def gate(trial: Trial, left: float, clock: float) -> Offering | None:
        histories = {
            k: History(tuple(v["waits"]), v["hours"], v["interruptions"], v["billed"])
            for k, v in seen.items()
        }
        need = Need(
            nodes=1,
            runtime_s=left,
            max_runtime_s=left * 1.25,
            max_wait_s=trial.max_wait_s,
            deadline_s=max(trial.deadline_s - clock, 1.0),
            resumable=trial.resumable,
        )
        try:
            return place(offers[trial.ask], need, histories, lambda o, r: None).chosen.offering
        except Unplaceable:  # no offering is expected to make it: the fastest one, anyway
            return min(
                offers[trial.ask],
                key=lambda o: (o.provisioning != "on-demand", o.rate_micro_per_hour),
            )

    return gate if name == "gate" else fixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    catalog = Catalog.load()
    offers = {}
    for ask, _ in ASKS:
        shapes = matching(parse_accelerators(ask), catalog.rows())
        offers[ask] = offerings(shapes, catalog_rates(catalog, shapes)[0], ROUTES)
    trials = week(args.days, random.Random(args.seed))
    rows = []
    for name in STRATEGIES:
        seen: dict = defaultdict(
            lambda: {"waits": [], "hours": 0.0, "interruptions": 0, "billed": None}
        )
        capacity = Capacity(random.Random(args.seed + 1))  # the same draws for every strategy
        results = [run_trial(t, strategy(name, offers, seen), capacity, seen) for t in trials]
        rows.append(
            {
                "strategy": name,
                "trials": len(results),
                "bill_usd": round(sum(r.billed_micro for r in results) / MICRO_PER_USD, 2),
                "deadlines_met_pct": round(100 * sum(r.met for r in results) / len(results), 1),
            }
        )
    verdict = compare(rows)
    if args.json:
        print(json.dumps({"strategies": rows, "verdict": verdict}))
        return
    print(
        report.table(
            ["strategy", "trials", "bill", "deadlines met"],
            [
                [
                    r["strategy"],
                    str(r["trials"]),
                    f"${r['bill_usd']:,.2f}",
                    f"{r['deadlines_met_pct']}%",
                ]
                for r in rows
            ],
        )
    )
    print(f"\n{verdict}")


def compare(rows: list[dict]) -> str:
    """The gate's bill against the cheapest single offering that met at least as many
    deadlines, or against the one that met the most."""
    gate = next(r for r in rows if r["strategy"] == "gate")
    singles = [r for r in rows if r["strategy"] != "gate"]
    as_good = [r for r in singles if r["deadlines_met_pct"] >= gate["deadlines_met_pct"]]
    best = min(as_good, key=lambda r: r["bill_usd"]) if as_good else None
    if best is None:
        most = max(singles, key=lambda r: (r["deadlines_met_pct"], -r["bill_usd"]))
        change = 100 * (gate["bill_usd"] / most["bill_usd"] - 1)
        return (
            f"no single offering met the gate's {gate['deadlines_met_pct']}% of deadlines; "
            f"against the one that met the most, always {most['strategy']} "
            f"({most['deadlines_met_pct']}%), the gate's choice billed {change:+.1f}%"
        )
    change = 100 * (gate["bill_usd"] / best["bill_usd"] - 1)
    return (
        f"the cheapest single offering that met at least the gate's "
        f"{gate['deadlines_met_pct']}% of deadlines is always {best['strategy']}; "
        f"against it the gate's choice billed {change:+.1f}%"
    )


if __name__ == "__main__":
    main()

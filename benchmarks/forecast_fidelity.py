"""Forecast fidelity: a sweep's forecast, its likely outcome and its bound, against the same sweep
run for real.

Each shape is a small sweep of sleeping trials (`sleep` for a few seconds, spread +-25% around
their expected_runtime) on the local launcher, with a SQLite ledger of its own, on one Prefect
server. The forecast is made from the ledger just before the sweep starts (what the sweep
publishes first); then the sweep runs and its ledger says what happened. For each figure
(trials admitted, timed out, spend, makespan from the first request to the last admitted
trial's end, and end: from the first request until the sweep is over, its time-outs counted)
the table gives the likely figure, the bound (every trial running to max_runtime + kill grace,
what the gate reserves), the actual one, and how far the likely one is from it. With `--before
DIR` (a checkout of an earlier tree, e.g. a `git worktree`), that tree's forecast is made from
the same ledger at the same instant, in a process of its own, and set beside this one's against
the one run (an earlier tree without an end figure shows `-`).

Shapes: `cap` (an hourly cap runs two at a time), `budget` (a day budget stops the tail, which
times out), `quota` (a team's quota of two machines in a capacity pool), `max-wait` (one at a
time, and a max wait that times the tail out), `history` (no expected_runtime: a first run
forecast at max_runtime, then a second forecast from the first run's finished trials). Every
shape but `budget` (its day's budget is spent) runs twice on its ledger: the second forecast
learns from the first run's trials how long one runs and how long it takes to start.

Usage: python -m benchmarks.forecast_fidelity [--shapes cap,budget,...] [--before DIR] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/forecast_fidelity.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import report
from prefect_gpu_budget.testing.servers import prefect_server, quiet_prefect

log = report.logger("forecast")
RATE_USD_PER_HOUR = "36"
"""local:bench: one cent a second."""


@dataclass(frozen=True)
class Shape:
    """A sweep and the limits that bind it; `org` is its own, so that no two shapes share a
    Prefect concurrency limit on the one server."""

    name: str
    org: str
    trials: int
    mean_s: float
    job: dict[str, Any]
    team: dict[str, Any] = field(default_factory=dict)
    """The team's `GpuBudget` fields."""
    pool_gpus: int = 0
    """Give the team a quota of this many one-GPU machines of four (0: no capacity pool)."""
    parallelism: int = 12
    runs: int = 1
    """Run it this many times on one ledger, forecasting each run from the ledger before it."""


SHAPES = {
    s.name: s
    for s in (
        Shape(
            "cap",
            "ff-cap",
            8,
            2.0,
            {"max_runtime": "10s", "expected_runtime": "2s"},
            {"hourly_cap_usd": 72},
            runs=2,
        ),
        Shape(
            "budget",
            "ff-budget",
            12,
            1.5,
            {"max_runtime": "6s", "expected_runtime": "1.5s"},
            {"period_budget_usd": "0.2", "period": "day", "max_wait": "20s"},
        ),
        Shape(
            "quota",
            "ff-quota",
            8,
            2.0,
            {"max_runtime": "10s", "expected_runtime": "2s"},
            {},
            2,
            runs=2,
        ),
        Shape(
            "max-wait",
            "ff-wait",
            6,
            2.0,
            {"max_runtime": "10s", "expected_runtime": "2s"},
            {"hourly_cap_usd": 36, "max_wait": "7s"},
            runs=2,
        ),
        Shape(
            "history", "ff-history", 8, 2.0, {"max_runtime": "10s"}, {"hourly_cap_usd": 72}, runs=2
        ),
    )
}


def runtimes(n: int, mean: float, spread: float = 0.25) -> list[float]:
    """`n` distinct runtimes spread evenly over mean x (1 +- spread), interleaved (long and short
    trials alternate); their mean is `mean`."""
    even = [round(mean * (1 + spread * (2 * i / max(1, n - 1) - 1)), 3) for i in range(n)]
    return [even[i // 2] if i % 2 == 0 else even[n - 1 - i // 2] for i in range(n)]


def spec_of(shape: Shape, results: Path) -> Any:
    from prefect_gpu_budget.sweeps.spec import SweepSpec

    return SweepSpec(
        name=shape.name,
        scope=f"{shape.org}/team/agent",
        job={"instance_type": "local:bench", "kill_grace": "1s", **shape.job},
        command=["sleep", "{s}"],
        grid={"s": runtimes(shape.trials, shape.mean_s)},
        parallelism=shape.parallelism,
        results_dir=str(results),
    )


def prepare(shape: Shape, url: str) -> None:
    """The shape's budgets (and capacity pool) in a fresh ledger."""
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.blocks import GpuBudget
    from prefect_gpu_budget.blocks.capacity import CapacityPool, TeamShare

    ledger = Ledger(url)
    GpuBudget(scope=shape.org).apply(ledger)
    GpuBudget(scope=f"{shape.org}/team", **shape.team).apply(ledger)
    if shape.pool_gpus:
        CapacityPool(
            org=shape.org,
            name="lab",
            nodes=4,
            gpus_per_node=1,
            instance_types=["local:bench"],
            teams=[TeamShare(team=f"{shape.org}/team", gpus=shape.pool_gpus, borrow_pct=0)],
        ).apply(ledger)
    ledger.db.dispose()


def actual(url: str, scope: str, since: float) -> dict[str, float]:
    """What the ledger says the run did: its jobs requested from `since` on."""
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(url)
    jobs = [j for j in ledger.views.jobs(scope) if j["requested_at"] >= since]
    ledger.db.dispose()
    ran = [j for j in jobs if j["admitted_at"] is not None]
    ends = [j["ended_at"] for j in ran if j["ended_at"] is not None]
    first = min((j["requested_at"] for j in jobs), default=0.0)
    over = [j["ended_at"] for j in jobs if j["ended_at"] is not None]  # time-outs too
    return {
        "admitted": len(ran),
        "timed_out": sum(j["state"] == "timed_out" for j in jobs),
        "spend_usd": sum(j["actual_micro"] or 0 for j in jobs) / 1e6,
        "makespan_s": max(ends) - first if ends else 0.0,
        "end_s": max(over) - first if over else 0.0,
    }


BEFORE = """
import json, sys
tree, url, spec, now = json.loads(sys.stdin.read())
sys.path.insert(0, tree)  # before anything imports the package
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.sweeps.forecast import forecast
from prefect_gpu_budget.sweeps.spec import SweepSpec
said = forecast(SweepSpec.model_validate_json(spec), Ledger(url), now=now)
print(json.dumps({"likely": said.likely.as_dict(), "start_s": getattr(said, "start_s", 0.0)}))
"""


def forecast_before(tree: str, url: str, spec: Any, now: float) -> dict[str, Any]:
    """The forecast of the tree in `tree` from the ledger at `url` at `now`: its likely figures
    and the start it used."""
    done = subprocess.run(
        [sys.executable, "-c", BEFORE],
        input=json.dumps([tree, url, spec.model_dump_json(), now]),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(done.stdout.splitlines()[-1])


def measure(shape: Shape, tmp: Path, before: str | None = None) -> list[dict[str, Any]]:
    """Forecast and run the shape (`runs` times on one ledger): one row per run; with `before`,
    that tree's forecast beside this one's."""
    from prefect_gpu_budget.blocks import SpendLedger
    from prefect_gpu_budget.sweeps.flow import gpu_sweep
    from prefect_gpu_budget.sweeps.forecast import forecast

    url = f"sqlite:///{tmp / (shape.name + '.db')}"
    prepare(shape, url)
    spec = spec_of(shape, tmp / "results")
    rows = []
    for run in range(1, shape.runs + 1):
        ledger = SpendLedger(database_url=url).ledger()
        since = time.time()
        said = forecast(spec, ledger, now=since)
        ledger.db.dispose()
        earlier = forecast_before(before, url, spec, since) if before else None
        gpu_sweep(spec, ledger=SpendLedger(database_url=url))
        got = actual(url, spec.scope, since)
        rows.append(
            {
                "shape": shape.name + (f" (run {run})" if shape.runs > 1 else ""),
                "runtime_from": said.runtime_from,
                "start_s": getattr(said, "start_s", 0.0),  # a tree before start_s: none
                "likely": said.likely.as_dict(),
                "bound": said.bound.as_dict(),
                "actual": got,
                **({"before": earlier} if earlier else {}),
            }
        )
        log(f"{rows[-1]['shape']}: likely {said.likely.admitted}, actual {got['admitted']}")
    return rows


FIGURES: dict[str, tuple[str, Callable[[float], str]]] = {
    "admitted": ("admitted", lambda v: f"{v:.0f}"),
    "timed_out": ("timed out", lambda v: f"{v:.0f}"),
    "spend_usd": ("spend", lambda v: f"${v:.3f}"),
    "makespan_s": ("makespan", lambda v: f"{v:.1f} s"),
    "end_s": ("end", lambda v: f"{v:.1f} s"),
}


def off(likely: float | None, real: float, figure: str) -> str:
    """How far the likely figure is from the actual one: trials as a count, the rest in %."""
    if likely is None:
        return "-"
    if figure in ("admitted", "timed_out"):
        return f"{likely - real:+.0f}"
    return "-" if not real else f"{100 * (likely - real) / real:+.0f}%"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per figure of each run; with an earlier tree's forecast, its likely figure and
    how far it is from the run beside this tree's."""
    before = any("before" in row for row in rows)
    header = ["shape", "figure", *(["before"] if before else []), "likely", "bound", "actual"]
    header += [*(["before - actual"] if before else []), "likely - actual"]
    cells = []
    for row in rows:
        for i, (key, (label, shown)) in enumerate(FIGURES.items()):
            likely, bound, real = row["likely"][key], row["bound"].get(key), row["actual"][key]
            earlier = row.get("before", {}).get("likely", {}).get(key)

            def show(v: float | None, shown: Callable[[float], str] = shown) -> str:
                return "-" if v is None else shown(v)

            cells.append(
                [
                    row["shape"] if i == 0 else "",
                    label,
                    *([show(earlier)] if before else []),
                    show(likely),
                    show(bound),
                    shown(real),
                    *([off(earlier, real, key)] if before else []),
                    off(likely, real, key),
                ]
            )
    return report.table(header, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="Comma-separated shapes.")
    parser.add_argument(
        "--before", help="an earlier tree (a git worktree) whose forecast is set beside this one's"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chosen = [SHAPES[name] for name in args.shapes.split(",")]
    before = str(Path(args.before).resolve()) if args.before else None
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")  # the trials' queue warnings
    quiet_prefect()
    started, load = time.monotonic(), os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="forecast-bench-") as tmp, prefect_server() as api:
        from prefect_gpu_budget.admission.prices import default_catalog
        from prefect_gpu_budget.pricing.catalog import set_local_price

        prices = set_local_price("bench", RATE_USD_PER_HOUR, gpus=1, path=Path(tmp) / "p.csv")
        os.environ["PREFECT_GPU_BUDGET_PRICES"] = str(prices)
        default_catalog.cache_clear()
        log(f"Prefect server at {api}; load {load:.2f}")
        for shape in chosen:
            rows += measure(shape, Path(tmp), before)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{time.strftime('%Y-%m-%d')}: {len(rows)} sweeps in {time.monotonic() - started:.0f} s, "
        f"1-minute load {load:.2f} at start\n"
    )
    print(table(rows))
    print()
    for row in rows:
        print(
            f"- {row['shape']}: likely runtime {row['likely']['runtime_s']} s after "
            f"{row['start_s']:.2f} s to start, {row['runtime_from']}"
            + (f" (before: {row['before']['start_s']:.2f} s to start)" if "before" in row else "")
        )


if __name__ == "__main__":
    main()

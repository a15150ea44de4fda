"""Benchmark: a year of ledger against a fresh one (issue 51, item 4).

Two ledgers of the same org (`--teams` teams of `--sessions` agent sessions each, every scope
with a budget: the org's month, each team's week, each session's day), side by side:

- filled: `--jobs` jobs over the 365 days before now, settled, with their period totals and
  bill lines for `--bill-share` of them (`benchmarks/year_fill.py` writes them in bulk, as the
  product writes them);
- fresh: the same org and the same rate of jobs over its last 31 days only (one billing
  period: a ledger younger than that has no month's bill to drift from).

Both then get the same open jobs through the ledger's API, at the same moment once both are
filled (`OPEN` running, and `QUEUED` waiting behind one session's hourly cap: a waiter's age
changes what a decision does), and are checked with the product's own reads: the
period totals `status` shows equal the sum of the settled rows in the period, for the org,
two teams and two sessions.

Then each read is timed on each ledger (`benchmarks/year_reads.py`), in a child process of
its own (killed past `--cap-s`), in two rounds, the ledgers in turn: the admission decision
(`Ledger.queue.request`, as benchmarks/gate_latency.py's decision case), and the commands
in-process through the CLI's own
app (`status --json`, `ledger --json` first page, a deep page `--before` a job half the history
back, a team's page, `forecast --json` of a 4-trial sweep, `bill drift --json`, `spend --json`)
and the spend report flow of one team (`flows.spend_report`, its last 24 h, on a Prefect server
of the run's own). Printed: the median of `--runs` runs of each, the ratio filled/fresh, and the
ledger's size on disk per million jobs (PostgreSQL: `pg_total_relation_size` of its tables;
SQLite: the file).

Usage: python -m benchmarks.year [--jobs 1000000] [--teams 1000] [--sessions 5]
       [--ledger postgres|sqlite] [--runs 5] [--cap-s 120] [--reads status,ledger,...] [--json]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from benchmarks.harness.report import logger, table
from benchmarks.year_fill import Shape, fill, set_budgets
from benchmarks.year_reads import LOCAL, Target, new_job, time_read
from prefect_gpu_budget.testing.postgres import SERVER, postgres_database

log = logger("year")
FRESH_DAYS = 31
OPEN, QUEUED = 100, 10
READS = ("decision", "status", "ledger", "ledger_deep", "ledger_team", "forecast", "bill_drift")
READS += ("spend", "spend_report")
SKIP_LOG = ("deep_id", "active")


def open_jobs(ledger: Any, shape: Shape) -> None:
    """`OPEN` running jobs over the org's sessions, and `QUEUED` waiting behind the cap of its
    last session (which admits one at a time), through the ledger's API."""
    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    rate = 2_500_000
    held = shape.session(shape.teams * shape.sessions - 1)
    ledger.config.set_budget(BudgetRule(held, hourly_cap_cents=300, period="day"))
    now = time.time()
    for i in range(OPEN):
        scope = shape.session((i * 7919) % (shape.teams * shape.sessions))
        job_id, decision = ledger.queue.request(new_job(scope, rate))
        assert decision.verdict == "admit", decision.reason
        ledger.settlements.mark_started(job_id, now)
    for _ in range(QUEUED + 1):
        ledger.queue.request(new_job(held, rate))


def check(ledger: Any, shape: Shape) -> list[str]:
    """Where `status`'s settled spend differs from the settled rows' sum in its period."""
    from prefect_gpu_budget.admission.ledger.queries import subtree
    from prefect_gpu_budget.admission.ledger.tables import jobs

    wrong = []
    last = shape.teams * shape.sessions - 2
    scopes = [shape.org, shape.team(1), shape.team(shape.teams // 2), shape.session(7)]
    scopes.append(shape.session(last))
    rows = {r["scope"]: r for r in ledger.views.status(shape.org)}
    with ledger.db.read() as conn:
        for scope in scopes:
            r = rows[scope]
            summed = conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(jobs.c.actual_micro), 0)).where(
                    subtree(jobs.c.scope, scope),
                    jobs.c.state == "settled",
                    jobs.c.started_at >= r["period_start"],
                    jobs.c.started_at < r["period_end"],
                )
            ).scalar_one()
            if int(summed) != r["settled_micro"]:
                wrong.append(f"{scope}: status {r['settled_micro']} != rows {summed}")
    return wrong


def size_bytes(url: str) -> int:
    if url.startswith("sqlite"):
        return Path(sa.make_url(url).database or "").stat().st_size
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c JOIN "
                    "pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                    "AND n.nspname = 'public' AND c.relname LIKE 'gpu_%'"
                )
            ).scalar_one()
        )


# -- the run -----------------------------------------------------------------------------------


@contextlib.contextmanager
def ledger_urls(kind: str, tmp: Path, server: str) -> Iterator[dict[str, str]]:
    if kind == "sqlite":
        yield {n: f"sqlite:///{tmp / (n + '.db')}" for n in ("fresh", "filled")}
        return
    with (
        postgres_database("year_fresh", server) as fresh,
        postgres_database("year_filled", server) as filled,
    ):
        yield {"fresh": fresh, "filled": filled}


def build(url: str, shape: Shape) -> dict[str, Any]:
    """The ledger's budgets and its history (`finish` then adds what is open now)."""
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(url)
    began = time.perf_counter()
    set_budgets(ledger, shape)
    budgets_s = time.perf_counter() - began
    fill(ledger, shape, log)
    fill_s = time.perf_counter() - began - budgets_s
    ledger.db.dispose()
    return {"budgets_s": budgets_s, "fill_s": fill_s, "jobs": shape.jobs}


def finish(url: str, shape: Shape) -> dict[str, Any]:
    """The open jobs (the same moment for both ledgers: a waiter's age changes what a decision
    does), the check against the product's reads, the deep page's job, the size on disk."""
    from prefect_gpu_budget.admission.ledger import Ledger

    ledger = Ledger(url, create=False)
    open_jobs(ledger, shape)
    wrong = check(ledger, shape)
    deep = _deep_id(ledger)
    active = _active_scopes(ledger, shape)
    ledger.db.dispose()
    return {"wrong": wrong, "deep_id": deep, "bytes": size_bytes(url), "active": active}


def _active_scopes(ledger: Any, shape: Shape) -> dict[str, int]:
    """Per team, how many of its scopes have jobs in the spend report's window (the last 24 h,
    open jobs included): the report draws a plot for each, so the two ledgers' reports are
    timed on a team with as many (`report_team`)."""
    from prefect_gpu_budget.admission.ledger.tables import jobs

    since = shape.now - 24 * 3600
    with ledger.db.read() as conn:
        return dict(
            conn.execute(
                sa.select(jobs.c.team, sa.func.count(sa.distinct(jobs.c.scope)))
                .where(sa.or_(jobs.c.ended_at.is_(None), jobs.c.ended_at >= since))
                .group_by(jobs.c.team)
            ).all()
        )


def report_team(shape: Shape, fresh: dict[str, int], filled: dict[str, int]) -> str:
    """The first team with the same number of scopes, two or more, in the spend report's window
    of both ledgers: the two reports then draw as many plots, and time the reads, not the draw
    of random fills (team 1 where no team matches)."""
    for i in range(shape.teams):
        team = shape.team(i)
        if fresh.get(team, 0) == filled.get(team, 0) >= 2:
            return team
    return shape.team(1)


def _deep_id(ledger: Any) -> str:
    """A job requested half the ledger's history back: where the deep page starts."""
    from prefect_gpu_budget.admission.ledger.tables import jobs

    with ledger.db.read() as conn:
        lo, hi = conn.execute(
            sa.select(sa.func.min(jobs.c.requested_at), sa.func.max(jobs.c.requested_at))
        ).one()
        return conn.execute(
            sa.select(jobs.c.id)
            .where(jobs.c.requested_at >= (lo + hi) / 2)
            .order_by(jobs.c.requested_at)
            .limit(1)
        ).scalar_one()


def write_spec(tmp: Path, shape: Shape) -> None:
    (tmp / "sweep.yaml").write_text(
        json.dumps(
            {
                "name": "year-forecast",
                "scope": shape.session(12),
                "job": {
                    "instance_type": f"local:{LOCAL}",
                    "max_runtime": "10m",
                    "expected_runtime": "2m",
                },
                "command": [sys.executable, "-c", "pass", "{i}"],
                "grid": {"i": [0, 1, 2, 3]},
                "parallelism": 2,
                "metric": "loss",
                "results_dir": str(tmp / "results"),
            }
        )
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import prefect_gpu_budget.cli
    import prefect_gpu_budget.flows.spend_report
    import prefect_gpu_budget.sweeps.forecast  # noqa: F401 - the children fork with all imported
    from prefect_gpu_budget.pricing.catalog import set_local_price
    from prefect_gpu_budget.testing.servers import prefect_server

    with tempfile.TemporaryDirectory(prefix="year-") as raw:
        tmp = Path(raw)
        os.environ["PREFECT_GPU_BUDGET_PRICES"] = str(
            set_local_price(LOCAL, "2.50", gpus=1, path=tmp / "prices.csv")
        )
        os.environ["PREFECT_HOME"] = str(tmp / "client-home")
        write_spec(tmp, Shape(0, 1, args.teams, args.sessions))
        now = time.time()
        shapes = {
            "fresh": Shape(
                args.jobs * FRESH_DAYS // 365,
                FRESH_DAYS,
                args.teams,
                args.sessions,
                bill_share=args.bill_share,
                seed=1,
                now=now,
            ),
            "filled": Shape(
                args.jobs,
                365,
                args.teams,
                args.sessions,
                bill_share=args.bill_share,
                seed=2,
                now=now,
            ),
        }
        reads = args.reads.split(",") if args.reads else list(READS)
        with ledger_urls(args.ledger, tmp, args.pg_server) as urls:
            built = {}
            for name in ("fresh", "filled"):
                log(f"{args.ledger} {name}: {shapes[name].jobs:,} jobs")
                built[name] = build(urls[name], shapes[name])
            for name in ("fresh", "filled"):
                built[name].update(finish(urls[name], shapes[name]))
                log(json.dumps({k: v for k, v in built[name].items() if k not in SKIP_LOG}))
            reported = report_team(
                shapes["filled"], built["fresh"].pop("active"), built["filled"].pop("active")
            )
            log(f"the spend report is timed on {reported}")
            server = prefect_server() if "spend_report" in reads else contextlib.nullcontext()
            with server:
                times = {}
                for read in reads:
                    targets = {
                        n: Target(urls[n], shapes[n], built[n]["deep_id"], reported)
                        for n in ("fresh", "filled")
                    }
                    times[read] = time_read(read, targets, tmp, args.runs, args.cap_s)
                    log(f"{read}: {json.dumps(times[read])}")
    return {
        "ledger": args.ledger,
        "jobs": args.jobs,
        "teams": args.teams,
        "sessions": args.sessions,
        "built": built,
        "report_team": reported,
        "times": times,
        "load_avg_1m": os.getloadavg()[0],
    }


def _fig(t: dict[str, Any]) -> str:
    if "median_s" in t:
        return f"{t['median_s'] * 1000:.1f}"
    return f"> {t['over_s'] * 1000:.0f}" if "over_s" in t else "error"


def render(result: dict[str, Any]) -> str:
    rows = []
    for read, t in result["times"].items():
        fresh, filled = t["fresh"], t["filled"]
        ratio = "-"
        if "median_s" in fresh and "median_s" in filled:
            ratio = f"{filled['median_s'] / fresh['median_s']:.2f}"
        met = "-" if ratio == "-" else ("ok" if float(ratio) <= 1.5 else "OVER")
        rows.append([read, _fig(fresh), _fig(filled), ratio, met])
    out = [table(["read", "fresh ms", "filled ms", "filled/fresh", "<= 1.5"], rows), ""]
    out.append(f"spend report of {result['report_team']} (as many scopes in its window in both)")
    for name, b in result["built"].items():
        per_m = b["bytes"] / max(1, b["jobs"]) * 1e6 / 2**20
        out.append(
            f"{name}: {b['jobs']:,} jobs, {b['bytes'] / 2**20:,.0f} MiB on disk "
            f"({per_m:,.0f} MiB per million jobs), filled in {b['fill_s']:.0f} s, budgets set "
            f"in {b['budgets_s']:.0f} s, status vs rows: "
            + ("consistent" if not b["wrong"] else "; ".join(b["wrong"]))
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--teams", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--ledger", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--bill-share", type=float, default=0.1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cap-s", type=float, default=120.0)
    parser.add_argument("--reads", help=f"comma-separated, of {','.join(READS)}")
    parser.add_argument("--pg-server", default=SERVER)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result) if args.json else render(result))
    bad = [b["wrong"] for b in result["built"].values() if b["wrong"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

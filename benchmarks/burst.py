"""Benchmark: a burst of requests recorded (prefect_gpu_budget/admission/ledger/queue.py).

`--processes` agent processes (subprocesses of this one) x `--requests / --processes` threads
each ask the ledger for admission at the same instant (`Ledger.queue.ask`, what `Gate.admit` calls
first), against one team whose hourly cap admits 8 of them: the other jobs queue. Measured per
backend, with a fresh ledger each (a PostgreSQL database of its own, or a SQLite file):

- recorded s: from the common start instant to the last job's `requested_at` (its request
  committed, decided and in the queue);
- admitted: how many the ledger admitted (must be 8: the cap);
- agent transactions per request: the transactions the agents' engines ended, / requests.

With `--before DIR` the same burst also runs with the package of another checkout (a git
worktree of an earlier commit), in turn with this one, and the ratio is printed.

Usage: python -m benchmarks.burst [--requests 1024] [--processes 8]
       [--backend postgresql,sqlite] [--before DIR] [--rounds 1] [--json]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/burst.py`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import json
import subprocess
import tempfile
import time
from typing import Any

from prefect_gpu_budget.testing.postgres import SERVER, postgres_database

ORG, TEAM = "burst", "burst/team"  # as in burst_agent.py
RATE_CENTS = 360
CAP_JOBS = 8


def _prepare(url: str) -> None:
    from benchmarks.harness.ledger import fresh_ledger
    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    ledger = fresh_ledger(url)
    try:
        ledger.config.set_budget(BudgetRule(ORG, hourly_cap_cents=10**9))
        ledger.config.set_budget(BudgetRule(TEAM, hourly_cap_cents=CAP_JOBS * RATE_CENTS))
    finally:
        ledger.db.dispose()


def _measure(url: str, start_at: float) -> dict[str, Any]:
    import sqlalchemy as sa

    from prefect_gpu_budget.admission.ledger import Ledger, jobs

    ledger = Ledger(url, create=False)
    try:
        with ledger.db.engine.connect() as conn:
            rows = conn.execute(sa.select(jobs.c.requested_at, jobs.c.state)).all()
    finally:
        ledger.db.dispose()
    return {
        "recorded": len(rows),
        "recorded_s": max(r.requested_at for r in rows) - start_at if rows else None,
        "admitted": sum(1 for r in rows if r.state != "queued"),
    }


def burst(url: str, requests: int, processes: int, tree: Path) -> dict[str, Any]:
    """One burst against the ledger at `url`, its agents importing the package from `tree`."""
    _prepare(url)
    per = requests // processes
    env = {**os.environ, "PYTHONPATH": str(tree)}
    agents = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("burst_agent.py")), url, str(per)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for agent in agents:  # every agent imported and connected before the start
        assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
    start_at = time.time() + 0.5
    for agent in agents:
        assert agent.stdin is not None
        agent.stdin.write(f"{start_at!r}\n")
        agent.stdin.flush()
    reports = [json.loads(a.communicate()[0].strip().splitlines()[-1]) for a in agents]
    out = _measure(url, start_at)
    out.update(
        requests=per * processes,
        failed=sum(r["failed"] for r in reports),
        errors=[e for r in reports for e in r["errors"]][:3],
        package={r["package"] for r in reports}.pop(),
        transactions_per_request=sum(r["transactions"] for r in reports) / (per * processes),
    )
    return out


@contextlib.contextmanager
def _database(backend: str, server: str) -> Any:
    if backend == "postgresql":
        with postgres_database("burst", server) as url:
            yield url
    else:
        with tempfile.TemporaryDirectory(prefix="burst-") as tmp:
            yield f"sqlite:///{tmp}/ledger.db"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--backend", default="postgresql,sqlite")
    parser.add_argument("--before", type=Path, help="another checkout, run in turn with this one")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pg-server", default=SERVER)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    trees = {"now": here} | ({"before": args.before.resolve()} if args.before else {})
    results: list[dict[str, Any]] = []
    for backend in args.backend.split(","):
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                with _database(backend, args.pg_server) as url:
                    print(f"{backend} round {round_ + 1}: {name} ...", file=sys.stderr)
                    row = burst(url, args.requests, args.processes, tree)
                results.append({"backend": backend, "tree": name, "round": round_ + 1, **row})
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print("| backend | tree | round | requests | recorded s | admitted | failed | xacts/request |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['backend']} | {r['tree']} | {r['round']} | {r['requests']} | "
            f"{r['recorded_s']:.2f} | {r['admitted']} | {r['failed']} | "
            f"{r['transactions_per_request']:.2f} |"
        )
    if args.before:
        for backend in args.backend.split(","):
            now = [
                r["recorded_s"] for r in results if r["backend"] == backend and r["tree"] == "now"
            ]
            old = [
                r["recorded_s"]
                for r in results
                if r["backend"] == backend and r["tree"] == "before"
            ]
            print(f"{backend}: now / before recorded s = {sum(now) / sum(old):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

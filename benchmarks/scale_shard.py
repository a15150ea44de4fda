"""Benchmark: one org's shard of a thousand-org deployment, replayed through the real decision
code (docs/scale.md, issue 51 item 5).

One org of `--teams` teams whose sessions (`--agents` in all, each team's session template giving
each its day budget on its first job) ask for jobs as a Poisson stream of `--per-hour`
admissions an hour; each job runs an exponential time of mean `--job-minutes` (at most its
hour's `max_runtime`). The stream is replayed in virtual time (each call given its instant as
`now`), as fast as the ledger answers, by one admitter, for `--minutes` of it: each arrival is
`Ledger.queue.request` (record and decide, one transaction under the org's lock, what
`Gate.admit` runs for the ledger), then `Settlements.mark_started`; each end is
`Settlements.settle` (one transaction under the org's lock). No budget binds: this measures
the path every admission takes, not waiting.

Measured on the ledger's engine (SQLAlchemy events, as `benchmarks/harness/commits.py` counts):
per admission, the decision's wall time (`request`), the org lock's hold (from the statement
that takes it, `pg_advisory_xact_lock` or SQLite's `BEGIN IMMEDIATE`, to its commit) of the
request and of the settlement, and write commits and lock takings. Each figure is given per
band of open jobs in the org at the time (the decision reads every open job of its org), and
the lock's busy share an hour at the stream's rate: (request hold + settle hold) x admissions
an hour / 3600 s, what must stay well under 1 for the org's admissions to keep pace on one
shard.

Usage: python -m benchmarks.scale_shard [--per-hour 1000] [--minutes 60] [--agents 100]
       [--teams 10] [--job-minutes 10] [--ledger postgres|sqlite] [--json]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import contextlib
import heapq
import json
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from benchmarks.harness.report import logger, table
from prefect_gpu_budget.testing.postgres import SERVER, postgres_database
from prefect_gpu_budget.testing.stats import percentile

log = logger("shard")
ORG = "shard"
RATE = 2_500_000
"""$2.50 an hour: each job's rate."""
MAX_RUNTIME_S = 3600.0
BANDS = (0, 100, 300, 1000, 3000, 10_000, 30_000, 100_000)


class LockHolds:
    """Each org-lock hold on `engine` (the lock's statement to the commit or rollback) and the
    write commits, from now on; `take()` hands over what was seen since the last call."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.holds: list[float] = []
        self.commits = self.locks = 0
        self._lock = threading.Lock()
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "commit", self._end)
        sa.event.listen(engine, "rollback", self._end)

    def _statement(self, conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if "pg_advisory_xact_lock" in statement or statement.startswith("BEGIN IMMEDIATE"):
            conn.info["lock_at"] = time.perf_counter()
            with self._lock:
                self.locks += 1

    def _end(self, conn: Any) -> None:
        at = conn.info.pop("lock_at", None)
        read = conn.get_execution_options().get("gpu_budget_read")
        with self._lock:
            if at is not None:
                self.holds.append(time.perf_counter() - at)
            if not read:
                self.commits += 1

    def take(self) -> tuple[float, int, int]:
        """(lock held, s; commits; lock takings) since the last call."""
        with self._lock:
            out = (sum(self.holds), self.commits, self.locks)
            self.holds, self.commits, self.locks = [], 0, 0
        return out


@dataclass(frozen=True)
class Load:
    per_hour: float
    minutes: float
    agents: int
    teams: int
    job_minutes: float
    seed: int = 0


def sessions(load: Load) -> list[str]:
    per_team = max(1, load.agents // load.teams)
    return [f"{ORG}/t{t:03d}/a{a:04d}" for t in range(load.teams) for a in range(per_team)]


def set_up(ledger: Any, load: Load) -> None:
    """The org's month, each team's week and its sessions' template (a day each): none binds."""
    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    big = 10**15
    ledger.config.set_budget(BudgetRule(ORG, 10**9, big, period="month"))
    for t in range(load.teams):
        team = f"{ORG}/t{t:03d}"
        ledger.config.set_budget(BudgetRule(team, 10**8, big, period="week"))
        ledger.config.set_session_template(BudgetRule(team, 10**7, big // 100, period="day"))


def _job(scope: str) -> Any:
    from prefect_gpu_budget.admission.ledger import NewJob, holder_id
    from prefect_gpu_budget.units import rate_cents

    return NewJob(
        scope=scope,
        name="shard",
        instance_type="local:shard",
        provisioning="on-demand",
        nodes=1,
        rate_micro_per_hour=RATE,
        rate_cents=rate_cents(RATE),
        priority=0,
        max_runtime_s=MAX_RUNTIME_S,
        expected_runtime_s=None,
        holder=holder_id(),
    )


def events(load: Load, t0: float) -> Iterator[tuple[float, str, str]]:
    """(instant, scope, "ask") of each arrival, in order."""
    rng = random.Random(load.seed)
    scopes = sessions(load)
    t, end = t0, t0 + load.minutes * 60
    while True:
        t += rng.expovariate(load.per_hour / 3600)
        if t >= end:
            return
        yield t, rng.choice(scopes), "ask"


def replay(ledger: Any, load: Load) -> tuple[list[dict[str, Any]], list[str]]:
    """Every admission: its open-job count, decision s, request lock hold (and, once it
    settled, its settlement's); and the jobs still open at the end."""
    rng = random.Random(load.seed + 1)
    holds = LockHolds(ledger.db.engine)
    t0 = time.time() - load.minutes * 60
    ends: list[tuple[float, str, str]] = []
    out: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for at, scope, _ in events(load, t0):
        while ends and ends[0][0] <= at:
            end, job_id, its_scope = heapq.heappop(ends)
            holds.take()
            ledger.settlements.settle(
                job_id, ended_at=end, outcome="completed", scope=its_scope, now=end
            )
            held, commits, locks = holds.take()
            by_id.pop(job_id).update(settle_hold_s=held, settle_commits=commits, settle_locks=locks)
        holds.take()
        began = time.perf_counter()
        job_id, decision = ledger.queue.request(_job(scope), now=at)
        took = time.perf_counter() - began
        held, commits, locks = holds.take()
        if decision.verdict != "admit":
            raise RuntimeError(f"not admitted: {decision.reason}")
        ledger.settlements.mark_started(job_id, at + 0.5)
        row = {
            "open": len(ends),
            "decision_s": took,
            "request_hold_s": held,
            "commits": commits + holds.take()[1],
            "locks": locks,
        }
        out.append(row)
        by_id[job_id] = row
        runtime = min(MAX_RUNTIME_S - 1, rng.expovariate(1 / (load.job_minutes * 60)))
        heapq.heappush(ends, (at + 0.5 + runtime, job_id, scope))
        if len(out) % 1000 == 0:
            log(f"{len(out):,} admissions, {len(ends):,} open, last decision {took * 1000:.1f} ms")
    return out, [job_id for _, job_id, _ in ends]


def steady(ledger: Any, job_ids: list[str], seconds: float) -> dict[str, float]:
    """What a running job costs the ledger between its admission and its settlement, each
    for `seconds` by one thread over the open jobs: `Views.stop_asked` (every running job's
    poll, `Gate`'s `preempt_poll_s` = 0.5 s) and `Settlements.heartbeat` (every `HEARTBEAT_S`
    = 15 s; a commit of its own, no org lock), per second."""
    out = {}
    for name, call in (
        ("stop_polls_per_s", ledger.views.stop_asked),
        ("heartbeats_per_s", ledger.settlements.heartbeat),
    ):
        done, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            call(job_ids[done % len(job_ids)])
            done += 1
        out[name] = done / seconds
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def bands(rows: list[dict[str, Any]], per_hour: float) -> list[dict[str, Any]]:
    """The figures per band of open jobs at the admission (a settlement's, of those that
    settled within the replay)."""
    found = []
    for lo, hi in zip(BANDS, BANDS[1:], strict=False):
        mine = [r for r in rows if lo <= r["open"] < hi]
        if not mine:
            continue
        settled = [r for r in mine if "settle_hold_s" in r] or [{"settle_hold_s": 0.0}]
        settle = [r["settle_hold_s"] for r in settled]
        hold = _mean([r["request_hold_s"] for r in mine]) + _mean(settle)
        decisions = [r["decision_s"] for r in mine]
        found.append(
            {
                "open": f"{lo}-{hi - 1}",
                "admissions": len(mine),
                "decision_p50_ms": percentile(decisions, 50) * 1000,
                "decision_p95_ms": percentile(decisions, 95) * 1000,
                "request_hold_p50_ms": percentile([r["request_hold_s"] for r in mine], 50) * 1000,
                "settle_hold_p50_ms": percentile(settle, 50) * 1000,
                "hold_per_admission_ms": hold * 1000,
                "lock_busy_share": hold * per_hour / 3600,
                "commits_per_admission": _mean([r["commits"] for r in mine])
                + _mean([r.get("settle_commits", 0) for r in settled]),
                "locks_per_admission": _mean([r["locks"] for r in mine])
                + _mean([r.get("settle_locks", 0) for r in settled]),
            }
        )
    return found


@contextlib.contextmanager
def ledger_url(kind: str, tmp: Path, server: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'shard.db'}"
        return
    with postgres_database("scale_shard", server) as url:
        yield url


def run(load: Load, kind: str, server: str) -> dict[str, Any]:
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.pricing.catalog import set_local_price

    with (
        tempfile.TemporaryDirectory(prefix="shard-") as raw,
        ledger_url(kind, Path(raw), server) as url,
    ):
        os.environ["PREFECT_GPU_BUDGET_PRICES"] = str(
            set_local_price("shard", "2.50", path=Path(raw) / "prices.csv")
        )
        ledger = Ledger(url)
        set_up(ledger, load)
        began = time.perf_counter()
        rows, open_ids = replay(ledger, load)
        wall = time.perf_counter() - began
        per_s = steady(ledger, open_ids, 5.0)
        ledger.db.dispose()
    return {
        "ledger": kind,
        **load.__dict__,
        "admissions": len(rows),
        "wall_s": wall,
        "bands": bands(rows, load.per_hour),
        "steady": per_s,
        "load_avg_1m": os.getloadavg()[0],
    }


def render(result: dict[str, Any]) -> str:
    header = [
        "open jobs",
        "admissions",
        "decision p50 / p95 ms",
        "request hold p50 ms",
        "settle hold p50 ms",
        "hold / admission ms",
        "lock busy share",
        "commits / adm",
        "locks / adm",
    ]
    rows = [
        [
            b["open"],
            str(b["admissions"]),
            f"{b['decision_p50_ms']:.1f} / {b['decision_p95_ms']:.1f}",
            f"{b['request_hold_p50_ms']:.1f}",
            f"{b['settle_hold_p50_ms']:.1f}",
            f"{b['hold_per_admission_ms']:.1f}",
            f"{b['lock_busy_share']:.3f}",
            f"{b['commits_per_admission']:.2f}",
            f"{b['locks_per_admission']:.2f}",
        ]
        for b in result["bands"]
    ]
    head = (
        f"{result['ledger']}: {result['per_hour']:g} admissions/h for {result['minutes']:g} "
        f"min, {result['agents']} agents in {result['teams']} teams, jobs of "
        f"{result['job_minutes']:g} min mean; {result['admissions']} admissions replayed in "
        f"{result['wall_s']:.0f} s (load {result['load_avg_1m']:.1f})"
    )
    st = result["steady"]
    tail = (
        f"one thread, open jobs: {st['stop_polls_per_s']:.0f} stop polls/s, "
        f"{st['heartbeats_per_s']:.0f} heartbeats/s"
    )
    return head + "\n" + table(header, rows) + "\n" + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--per-hour", type=float, default=1000)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--teams", type=int, default=10)
    parser.add_argument("--job-minutes", type=float, default=10)
    parser.add_argument("--ledger", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--pg-server", default=SERVER)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load = Load(args.per_hour, args.minutes, args.agents, args.teams, args.job_minutes)
    result = run(load, args.ledger, args.pg_server)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

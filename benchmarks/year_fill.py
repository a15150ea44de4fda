"""A ledger filled in bulk with `days` of one org's jobs (`benchmarks.year`): its teams' agent
sessions' settled jobs, their period totals and the cloud's bill lines for a share of them.

The budgets are set through the ledger's own API (`Config.set_budget`) before any job is
written. The jobs are written as the product writes them (`rows.new_job_row`, then a decision's
`decided_values`, `Settlements.mark_started`, `Settlements.settle`; an unrun ending as
`tables.ended_unrun`), but in bulk: COPY on PostgreSQL, `executemany` in transactions of
`BATCH` rows on SQLite, the `gpu_jobs` indexes built after the rows. Each job runs inside one
UTC day, so its cost books whole into one period of each budget on its path
(`accounting.book`); the totals are summed here and written to `gpu_period_spend`. A share of
the cloud jobs has a bill line (`gpu_bill_lines`, `gpu_bill_jobs`, one `gpu_bill_imports` row
per month): final and equal to the settlement (it moves no period) once its usage ended 48 h
ago, provisional (2% over) before that.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.ledger.tables import (
    bill_imports,
    bill_jobs,
    bill_lines,
    jobs,
    period_spend,
)
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import cost_micro, rate_cents

BATCH = 50_000
DAY = 86400.0
INSTANCES = ("aws:g5.xlarge", "aws:g5.12xlarge", "aws:p4d.24xlarge")
MAX_RUNTIME_S = 3610.0
"""What the gate reserves for a `max_runtime="1h"` job (its runtime and its kill grace)."""
PROVISIONAL_S = 48 * 3600.0
NO_LIMIT_MICRO = 10**15
EMPTY = dict.fromkeys(c.name for c in jobs.columns)


@dataclass(frozen=True)
class Shape:
    """What a filled ledger holds: `jobs` jobs over the `days` before `now`, in `teams` teams of
    `sessions` agent sessions each, of org `org`; `bill_share` of the cloud jobs billed."""

    jobs: int
    days: float
    teams: int = 1000
    sessions: int = 5
    org: str = "yr"
    bill_share: float = 0.1
    seed: int = 0
    now: float = field(default_factory=time.time)

    def team(self, i: int) -> str:
        return f"{self.org}/t{i:04d}"

    def session(self, k: int) -> str:
        return f"{self.team(k // self.sessions)}/s{k % self.sessions}"


def rules(shape: Shape) -> list[BudgetRule]:
    """The org's month, each team's week and each session's day: caps and budgets so large
    that no job of the fill would have waited."""
    out = [BudgetRule(shape.org, 10**9, NO_LIMIT_MICRO, period="month")]
    for i in range(shape.teams):
        out.append(BudgetRule(shape.team(i), 10**8, NO_LIMIT_MICRO, period="week"))
    for k in range(shape.teams * shape.sessions):
        out.append(BudgetRule(shape.session(k), 10**7, NO_LIMIT_MICRO // 100, period="day"))
    return out


@dataclass
class Totals:
    """What the fill wrote: per (budget scope, period start) the settled micro-dollars and the
    period's end, rows written, and the bill lines per billing period."""

    spend: dict[tuple[str, float], int] = field(default_factory=lambda: defaultdict(int))
    ends: dict[tuple[str, float], float] = field(default_factory=dict)
    rows: int = 0
    billed: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class Generator:
    """The rows of one shape, in request order."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed)
        catalog = Catalog.load()
        self.rates = [catalog.quote(i).rate_micro_per_hour for i in INSTANCES]
        self.totals = Totals()
        self._days: dict[int, list[tuple[str, float, float]]] = {}

    def _periods(self, day: int) -> list[tuple[str, float, float]]:
        """(level, period start, end) of the day's session, team and org periods."""
        found = self._days.get(day)
        if found is None:
            t = day * DAY + 1
            found = [(kind, *periods.bounds(kind, "UTC", t)) for kind in ("day", "week", "month")]
            self._days[day] = found
        return found

    def rows(self) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
        """(job row, its bill line or None), oldest first."""
        s, rng = self.shape, self.rng
        span = s.days * DAY - 3600.0
        first = s.now - s.days * DAY
        for n in range(s.jobs):
            requested = first + (n + rng.random()) * span / s.jobs
            k = rng.randrange(s.teams * s.sessions)
            kind = rng.randrange(len(INSTANCES))
            row = self._job(n, requested, s.session(k), kind)
            self.totals.rows += 1
            yield row, self._bill(row)

    def _job(self, n: int, requested: float, scope: str, kind: int) -> dict[str, Any]:
        rng, rate = self.rng, self.rates[kind]
        row = {
            **EMPTY,
            "id": f"{self.shape.seed:08x}-0000-4000-8000-{n:012x}",
            "org": self.shape.org,
            "scope": scope,
            "team": scope.rsplit("/", 1)[0],
            "name": f"sweep-{n // 16:07d}/{n % 16:04d}",
            "instance_type": INSTANCES[kind],
            "provisioning": "on-demand",
            "nodes": 1,
            "rate_micro_per_hour": rate,
            "rate_cents": rate_cents(rate),
            "priority": 0,
            "max_runtime_s": MAX_RUNTIME_S,
            "requested_at": requested,
            "heartbeat_at": requested,
            "holder": f"host-{n % 97}:{1000 + n % 5000}:{n}",
            "launcher": "sagemaker:year",
            "node_gpus": 0,
            "node_vcpu": 0,
            "node_memory_gib": 0,
            "reason": "",
            "reserved_micro": 0,
            "reserve_seconds": 0.0,
        }
        if rng.random() < 0.02:  # refused by a budget: ended unrun, settled at once at no cost
            reason = f"hourly_cap {scope}: would pass its cap"
            row.update(state="rejected", ended_at=requested, settled_at=requested, actual_micro=0)
            row["reason"] = reason
            return row
        admitted = requested + rng.uniform(0.01, 0.2)
        started = admitted + rng.uniform(0.2, 2.0)
        day_end = (started // DAY + 1) * DAY
        ended = min(started + rng.uniform(60.0, 3600.0), day_end - 1.0)
        billed = ended - started
        actual = cost_micro(rate, billed, round_up=False)
        outcome = "completed" if rng.random() < 0.9 else "failed"
        row.update(
            state="settled",
            reason="admitted: within every budget and cap",
            reserved_micro=cost_micro(rate, MAX_RUNTIME_S, round_up=True),
            reserve_seconds=MAX_RUNTIME_S,
            admitted_at=admitted,
            started_at=started,
            heartbeat_at=ended,
            ended_at=ended,
            settled_at=ended + 0.05,
            billed_seconds=billed,
            actual_micro=actual,
            outcome=outcome,
            external_id=f"year-{n}",
            placement="",
        )
        self._book(scope, started, actual)
        return row

    def _book(self, scope: str, started: float, actual: int) -> None:
        (_, day, day_end), (_, week, week_end), (_, month, month_end) = self._periods(
            int(started // DAY)
        )
        spend, ends = self.totals.spend, self.totals.ends
        for key, end in (
            ((scope, day), day_end),
            ((scope.rsplit("/", 1)[0], week), week_end),
            ((self.shape.org, month), month_end),
        ):
            spend[key] += actual
            ends[key] = end

    def _bill(self, row: dict[str, Any]) -> dict[str, Any] | None:
        if row["state"] != "settled" or self.rng.random() >= self.shape.bill_share:
            return None
        period = time.strftime("%Y-%m", time.gmtime(row["started_at"]))
        final = row["ended_at"] < self.shape.now - PROVISIONAL_S
        billed = row["actual_micro"] if final else row["actual_micro"] * 102 // 100
        self.totals.billed[period] += 1
        return {
            "line": {
                "source": "aws",
                "billing_period": period,
                "line_id": f"{period}/{row['external_id']}/usage",
                "job_id": row["id"],
                "kind": "job",
                "line_type": "Usage",
                "usage_start": row["started_at"],
                "usage_end": row["ended_at"],
                "billed_micro": billed,
                "currency": "USD",
                "mark": row["id"],
                "resource_id": f"arn:aws:sagemaker:training-job/{row['external_id']}",
                "description": f"SageMaker {row['instance_type']} on-demand",
                "reason": None,
            },
            "job": {
                "job_id": row["id"],
                "org": row["org"],
                "scope": row["scope"],
                "billed_micro": billed,
                "final": final,
                "held": False,
                "reason": None if final else "usage ended less than 48 h ago",
                "updated_at": self.shape.now,
            },
        }


def set_budgets(ledger: Ledger, shape: Shape) -> None:
    """Every budget of the shape, through the ledger's API (on a ledger with no job yet)."""
    for rule in rules(shape):
        ledger.config.set_budget(rule, now=shape.now)


def fill(ledger: Ledger, shape: Shape, log: Any) -> Totals:
    """Write the shape's jobs, period totals and bills into `ledger` (budgets set already)."""
    gen = Generator(shape)
    engine = ledger.db.engine
    _drop_job_indexes(engine)
    started = time.perf_counter()
    writer = _copy_rows if engine.dialect.name == "postgresql" else _insert_rows
    writer(engine, gen, log)
    log(f"{gen.totals.rows:,} rows in {time.perf_counter() - started:.0f} s; indexing")
    for index in jobs.indexes:
        index.create(engine, checkfirst=True)
    _write_totals(engine, gen.totals, shape)
    if engine.dialect.name == "postgresql":  # what autovacuum would do; SQLite is left
        with engine.begin() as conn:  # without statistics, as the product leaves it
            conn.exec_driver_sql("ANALYZE")
    log(f"filled in {time.perf_counter() - started:.0f} s")
    return gen.totals


def _drop_job_indexes(engine: sa.Engine) -> None:
    for index in jobs.indexes:
        index.drop(engine, checkfirst=True)


def _batches(gen: Generator) -> Iterator[tuple[list[dict], list[dict], list[dict]]]:
    rows: list[dict] = []
    lines: list[dict] = []
    billed: list[dict] = []
    for row, bill in gen.rows():
        rows.append(row)
        if bill is not None:
            lines.append(bill["line"])
            billed.append(bill["job"])
        if len(rows) == BATCH:
            yield rows, lines, billed
            rows, lines, billed = [], [], []
    if rows:
        yield rows, lines, billed


def _copy_rows(engine: sa.Engine, gen: Generator, log: Any) -> None:
    """COPY each table's rows (PostgreSQL), one transaction per batch."""
    tables = (jobs, bill_lines, bill_jobs)
    for count, batch in enumerate(_batches(gen)):
        raw = engine.raw_connection()
        try:
            with raw.cursor() as cur:
                for table, rows in zip(tables, batch, strict=True):
                    names = [c.name for c in table.columns]
                    with cur.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
                        for row in rows:
                            copy.write_row([row[n] for n in names])
            raw.commit()
        finally:
            raw.close()
        if count % 20 == 19:
            log(f"{gen.totals.rows:,} rows")


def _insert_rows(engine: sa.Engine, gen: Generator, log: Any) -> None:
    """`executemany` in one transaction per batch (SQLite)."""
    for count, (rows, lines, billed) in enumerate(_batches(gen)):
        with engine.begin() as conn:
            conn.execute(jobs.insert(), rows)
            if lines:
                conn.execute(bill_lines.insert(), lines)
                conn.execute(bill_jobs.insert(), billed)
        if count % 20 == 19:
            log(f"{gen.totals.rows:,} rows")


def _write_totals(engine: sa.Engine, totals: Totals, shape: Shape) -> None:
    """The period totals, and one import per billing period (with a few lines no job owns)."""
    spend = [
        {"scope": s, "period_start": p, "period_end": totals.ends[(s, p)], "settled_micro": v}
        for (s, p), v in totals.spend.items()
    ]
    with engine.begin() as conn:
        conn.execute(period_spend.delete())  # the zeros `set_budget` made before any job
        for i in range(0, len(spend), BATCH):
            conn.execute(period_spend.insert(), spend[i : i + BATCH])
        for period, count in sorted(totals.billed.items()):
            conn.execute(bill_lines.insert(), _unowned(period))
            conn.execute(
                bill_imports.insert().values(
                    source="aws",
                    billing_period=period,
                    imported_at=shape.now,
                    digest=f"{period}-{count}",
                    lines=count + 3,
                    read_from="benchmarks.year",
                )
            )


def _unowned(period: str) -> list[dict[str, Any]]:
    """A month's lines no job owns: untagged usage and the account's tax."""
    start = time.mktime(time.strptime(period + "-01", "%Y-%m-%d")) - time.timezone
    base = {
        "source": "aws",
        "billing_period": period,
        "job_id": None,
        "usage_start": start,
        "usage_end": start + DAY,
        "currency": "USD",
        "mark": None,
        "reason": None,
    }
    return [
        {
            **base,
            "line_id": f"{period}/untagged/{i}",
            "kind": "untagged",
            "line_type": "Usage",
            "billed_micro": 5_000_000,
            "resource_id": f"i-{i}",
            "description": "untagged EC2",
        }
        for i in range(2)
    ] + [
        {
            **base,
            "line_id": f"{period}/tax",
            "kind": "account",
            "line_type": "Tax",
            "billed_micro": 1_000_000,
            "resource_id": None,
            "description": "sales tax",
        }
    ]

"""Benchmark: the admission gate against bare Prefect global concurrency limits.

Measured side by side in one run, against one throwaway Prefect server (`prefect server start
--no-services` on SQLite, leases in memory, as Prefect's test harness serves):

1. bare Prefect: acquire + release one slot of a global concurrency limit (raw client API);
2. the gate: `admit` + `settle` uncontended, with Prefect limits in the loop, and the ledger's
   own decision (`Ledger.request`: record the job and decide, one transaction) alone, on
   SQLite and on PostgreSQL;
3. admissions per second with 1, 4, 16 and 32 admitters in separate processes;
4. the ledger's decision latency with 10^3 and with 10^6 settled rows in the ledger.

Usage: python -m benchmarks.gate_latency [--quick] [--json]

PostgreSQL is expected at 127.0.0.1:5432; the benchmark uses a database of its own
(`gate_bench_<id>`, dropped at the end), or the one GATE_BENCH_PG_URL names (created if missing,
its gate tables dropped and recreated, never dropped itself). It is skipped if unreachable.
Progress goes to stderr; the table (or, with --json, one JSON object) to stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/gate_latency.py` (and so are its admitters)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import argparse
import contextlib
import json
import multiprocessing as mp
import queue
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from multiprocessing.queues import Queue
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from benchmarks.harness import ensure_database, postgres_database, prefect_server
from benchmarks.harness.postgres import SERVER
from benchmarks.harness.report import logger, table
from benchmarks.harness.stats import percentile, summary_ms
from prefect_gpu_budget.admission import periods
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import (
    Ledger,
    NewJob,
    holder_id,
    jobs,
    metadata,
)
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog, Quote
from prefect_gpu_budget.units import rate_cents

PG_URL = os.environ.get("GATE_BENCH_PG_URL")
"""The PostgreSQL ledger's database; None: one of the run's own."""
ORG = "bench"
TEAM = f"{ORG}/team"
SCOPE = f"{TEAM}/s1"
INSTANCE = "aws:g5.xlarge"
PG_BULK_LIMIT_S = 60.0
"""Stop bulk-loading PostgreSQL past this many seconds (and say so) to bound the run."""
INSERT_BATCH = 20_000
TARGETS = {"gate_over_prefect": 1.5, "decision_ms_sqlite": 2.0, "size_growth": 1.2}


@dataclass(frozen=True)
class Config:
    iterations: int
    duration_s: float
    small_rows: int
    large_rows: int
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    warmup: int = 5

    @classmethod
    def of(cls, quick: bool) -> Config:
        if quick:
            return cls(iterations=50, duration_s=1.5, small_rows=10**3, large_rows=10**5)
        return cls(iterations=200, duration_s=3.0, small_rows=10**3, large_rows=10**6)


log = logger("bench")


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- setup -------------------------------------------------------------------------------------


def budgets() -> list[BudgetRule]:
    """Caps and budgets so large that nothing ever waits: the uncontended path."""
    return [
        BudgetRule(ORG, hourly_cap_cents=10**9, period_budget_micro=10**15, period="month"),
        BudgetRule(TEAM, hourly_cap_cents=10**9, period_budget_micro=10**15, period="week"),
    ]


def fresh_ledger(url: str) -> Ledger:
    """Drop and recreate the gate's tables, then set the benchmark budgets."""
    old = Ledger(url, create=False)
    metadata.drop_all(old.engine)
    old.dispose()
    ledger = Ledger(url)
    for rule in budgets():
        ledger.set_budget(rule)
    return ledger


@contextmanager
def postgres_ledger() -> Iterator[str | None]:
    """The PostgreSQL ledger's database (`PG_URL`, created if missing, else one of the run's
    own); None when the server does not answer."""
    with contextlib.ExitStack() as stack:
        try:
            if PG_URL is None:
                url: str | None = stack.enter_context(postgres_database("gate_bench"))
            else:
                ensure_database(PG_URL)
                url = PG_URL
        except sa.exc.SQLAlchemyError as exc:
            log(f"PostgreSQL unavailable, skipped: {str(exc).splitlines()[0]}")
            url = None
        yield url


def bench_job() -> GpuJob:
    return GpuJob(instance_type=INSTANCE, max_runtime="1h")


def new_job(scope: str, quote: Quote) -> NewJob:
    job = bench_job()
    return NewJob(
        scope=scope,
        name="bench",
        instance_type=job.instance_type,
        provisioning=job.provisioning,
        nodes=job.nodes,
        rate_micro_per_hour=quote.rate_micro_per_hour,
        rate_cents=rate_cents(quote.rate_micro_per_hour),
        priority=0,
        max_runtime_s=job.reserve_runtime_s,
        expected_runtime_s=None,
        holder=holder_id(),
    )


# -- 1. bare Prefect ---------------------------------------------------------------------------


def create_bare_limit(client: Any) -> str:
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = f"bench-bare-{uuid.uuid4().hex[:8]}"
    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1_000_000))
    return name


def bare_acquire_release(client: Any, name: str) -> None:
    response = client.increment_concurrency_slots_with_lease(
        names=[name], slots=1, mode="concurrency", lease_duration=60
    )
    client.release_concurrency_slots_with_lease(UUID(response.json()["lease_id"]))


def bench_bare_prefect(client: Any, name: str, cfg: Config) -> dict[str, float]:
    samples = [
        timed(lambda: bare_acquire_release(client, name))
        for _ in range(cfg.warmup + cfg.iterations)
    ]
    return summary_ms(samples[cfg.warmup :])


# -- 2. gate and ledger decision, uncontended --------------------------------------------------


def bench_gate(gate: Gate, cfg: Config) -> dict[str, Any]:
    job = bench_job()
    admits, settles, totals = [], [], []
    for _ in range(cfg.warmup + cfg.iterations):
        start = time.perf_counter()
        admission = gate.admit(job, SCOPE)
        admitted = time.perf_counter()
        gate.settle(admission, ended_at=time.time(), outcome="completed")
        done = time.perf_counter()
        admits.append(admitted - start)
        settles.append(done - admitted)
        totals.append(done - start)
    skip = cfg.warmup
    return {
        **summary_ms(totals[skip:]),
        "admit_p50_ms": summary_ms(admits[skip:])["p50_ms"],
        "settle_p50_ms": summary_ms(settles[skip:])["p50_ms"],
    }


def decision_samples(ledger: Ledger, quote: Quote, count: int) -> list[float]:
    """Time `request` (record + decide in one transaction); the settle after is not timed."""
    samples = []
    for _ in range(count):
        job = new_job(SCOPE, quote)
        start = time.perf_counter()
        job_id, decision = ledger.request(job)
        samples.append(time.perf_counter() - start)
        if decision.verdict != "admit":
            raise RuntimeError(f"benchmark job not admitted: {decision.reason}")
        ledger.settle(job_id, ended_at=time.time(), outcome="completed", scope=SCOPE)
    return samples


def bench_decision(ledger: Ledger, quote: Quote, cfg: Config) -> dict[str, float]:
    return summary_ms(decision_samples(ledger, quote, cfg.warmup + cfg.iterations)[cfg.warmup :])


# -- 3. throughput: concurrent admitters in separate processes -----------------------------------


def admitter(index: int, api_url: str, commands: Queue, results: Queue) -> None:
    """One admitter process, with its own client (and, per round, its own Ledger and Gate)."""
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            limits, catalog = RateLimits(client), Catalog.load()
            results.put(("ready", index, None))
            while (command := commands.get()) is not None:
                kind, target = command
                if kind == "prefect":
                    op = partial(bare_acquire_release, client, target)
                    done = admitter_round(index, op, commands, results)
                else:
                    ledger = Ledger(target, create=False)
                    gate = Gate(ledger, limits, catalog=catalog)
                    op = gate_round_trip(gate, f"{TEAM}/w{index}")
                    done = admitter_round(index, op, commands, results)
                    ledger.dispose()
                results.put(("done", index, done))
    except Exception as exc:  # report, so the parent does not wait for nothing
        results.put(("failed", index, f"{type(exc).__name__}: {exc}"))


def gate_round_trip(gate: Gate, scope: str) -> Callable[[], None]:
    job = bench_job()

    def op() -> None:
        gate.settle(gate.admit(job, scope), ended_at=time.time(), outcome="completed")

    return op


def admitter_round(
    index: int, op: Callable[[], None], commands: Queue, results: Queue
) -> dict[str, Any]:
    """Warm up, say so, wait for the common start, then run `op` in a loop until the stop."""
    op()
    results.put(("armed", index, None))
    start_at, stop_at = commands.get()
    time.sleep(max(0.0, start_at - time.time()))
    count, errors, first_error, latencies = 0, 0, None, []
    while time.time() < stop_at:
        began = time.perf_counter()
        try:
            op()
        except Exception as exc:
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
            continue
        latencies.append(time.perf_counter() - began)  # tail included, even past the stop
        if time.time() <= stop_at:
            count += 1
    return {"count": count, "errors": errors, "first_error": first_error, "latencies": latencies}


class AdmitterPool:
    """`size` spawned admitter processes, reused across rounds (spawning costs ~1 s of CPU each)."""

    def __init__(self, size: int, api_url: str, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.results: Queue = ctx.Queue()
        self.commands: list[Queue] = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(target=admitter, args=(i, api_url, q, self.results), daemon=True)
            for i, q in enumerate(self.commands)
        ]
        for proc in self.procs:
            proc.start()
        self._collect("ready", size)

    def _collect(self, kind: str, count: int) -> list[Any]:
        out = []
        deadline = time.monotonic() + self.timeout_s
        while len(out) < count:
            try:
                got, index, payload = self.results.get(
                    timeout=max(1.0, deadline - time.monotonic())
                )
            except queue.Empty:
                raise RuntimeError(f"admitters: {len(out)}/{count} {kind} in time") from None
            if got == "failed":
                raise RuntimeError(f"admitter {index} failed: {payload}")
            if got != kind:
                raise RuntimeError(f"admitter {index}: expected {kind}, got {got}")
            out.append(payload)
        return out

    def round(self, command: tuple[str, str], workers: int, duration_s: float) -> dict[str, Any]:
        """Run `command` (("prefect", limit name) or ("gate", ledger URL)) on `workers` admitters."""
        chosen = self.commands[:workers]
        for q in chosen:
            q.put(command)
        arming = time.perf_counter()
        self._collect("armed", workers)
        log(f"{workers} admitters armed in {time.perf_counter() - arming:.1f} s")
        start_at = time.time() + 0.3
        for q in chosen:
            q.put((start_at, start_at + duration_s))
        done = self._collect("done", workers)
        latencies = [s for d in done for s in d["latencies"]]
        total = sum(d["count"] for d in done)
        return {
            "workers": workers,
            "admissions": total,
            "per_s": total / duration_s,
            "p50_ms": percentile(latencies, 50) * 1000 if latencies else None,
            "p95_ms": percentile(latencies, 95) * 1000 if latencies else None,
            "max_ms": max(latencies) * 1000 if latencies else None,
            "errors": sum(d["errors"] for d in done),
            "first_error": next((d["first_error"] for d in done if d["first_error"]), None),
        }

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def bench_throughput(
    targets: dict[str, tuple[str, str]], api_url: str, cfg: Config
) -> dict[str, list[dict[str, Any]]]:
    """Admissions per second for each target: bare Prefect limits, and the gate per ledger."""
    log(f"spawning {max(cfg.concurrency)} admitter processes")
    started = time.perf_counter()
    pool = AdmitterPool(max(cfg.concurrency), api_url)
    log(f"admitters ready in {time.perf_counter() - started:.1f} s")
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for name, command in targets.items():
            out[name] = []
            for workers in cfg.concurrency:
                result = pool.round(command, workers, cfg.duration_s)
                log(
                    f"{name}: {workers} admitters -> {result['per_s']:.1f}/s, "
                    f"max {result['max_ms']:.0f} ms, {result['errors']} errors"
                )
                out[name].append(result)
    finally:
        pool.close()
    return out


# -- 4. ledger size ------------------------------------------------------------------------------


def old_rows(count: int, now: float, rng: random.Random) -> list[dict[str, Any]]:
    """Settled jobs spread over the 12 months before the current week and month."""
    cutoff = (
        min(periods.bounds("month", "UTC", now)[0], periods.bounds("week", "UTC", now)[0]) - 86400
    )
    scopes = (SCOPE, f"{TEAM}/s2", f"{TEAM}/s3", f"{ORG}/other")
    rows = []
    for _ in range(count):
        runtime = rng.uniform(60, 3600)
        started = cutoff - rng.uniform(0, 365 * 86400)
        ended = started + runtime
        actual = int(1_006_000 * runtime / 3600)
        rows.append(
            {
                "id": str(uuid.uuid4()),
                "org": ORG,
                "scope": rng.choice(scopes),
                "name": "old",
                "instance_type": INSTANCE,
                "provisioning": "on-demand",
                "nodes": 1,
                "rate_micro_per_hour": 1_006_000,
                "rate_cents": 101,
                "priority": 0,
                "max_runtime_s": 3610.0,
                "state": "settled",
                "reason": "",
                "reserved_micro": 1_009_000,
                "reserve_seconds": 3610.0,
                "actual_micro": actual,
                "billed_seconds": runtime,
                "outcome": "completed",
                "requested_at": started - 1,
                "heartbeat_at": ended,
                "admitted_at": started - 0.5,
                "started_at": started,
                "ended_at": ended,
                "settled_at": ended + 0.1,
                "holder": "bench-host:1:1",
                "launcher": "local",
            }
        )
    return rows


def bulk_insert(ledger: Ledger, count: int, rng: random.Random, limit_s: float | None) -> int:
    """Insert `count` settled rows in batches; stop early past `limit_s`. Returns rows inserted."""
    started, done, now = time.perf_counter(), 0, time.time()
    while done < count:
        batch = old_rows(min(INSERT_BATCH, count - done), now, rng)
        with ledger.engine.begin() as conn:
            conn.execute(jobs.insert(), batch)
        done += len(batch)
        if limit_s is not None and time.perf_counter() - started > limit_s and done < count:
            break
    return done


def settled_count(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(jobs).where(jobs.c.state == "settled")
        return int(conn.execute(query).scalar_one())


def bench_size(url: str, quote: Quote, cfg: Config, limit_s: float | None) -> dict[str, Any]:
    ledger, rng = fresh_ledger(url), random.Random(0)
    try:
        bulk_insert(ledger, cfg.small_rows, rng, None)
        small_rows = settled_count(ledger)
        small = summary_ms(
            decision_samples(ledger, quote, cfg.warmup + cfg.iterations)[cfg.warmup :]
        )
        started = time.perf_counter()
        inserted = bulk_insert(ledger, cfg.large_rows - settled_count(ledger), rng, limit_s)
        load_s = time.perf_counter() - started
        large_rows = settled_count(ledger)
        large = summary_ms(
            decision_samples(ledger, quote, cfg.warmup + cfg.iterations)[cfg.warmup :]
        )
    finally:
        ledger.dispose()
    note = None
    if large_rows < cfg.large_rows:
        note = (
            f"bulk load stopped after {load_s:.0f} s at {large_rows:,} rows (limit {limit_s:.0f} s)"
        )
    return {
        "small_rows": small_rows,
        "large_rows": large_rows,
        "small": small,
        "large": large,
        "load_s": load_s,
        "insert_rows_per_s": inserted / load_s if load_s else None,
        "growth": large["p50_ms"] / small["p50_ms"],
        "note": note,
    }


# -- run ---------------------------------------------------------------------------------------


def run(cfg: Config) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    wall = time.perf_counter()
    catalog = Catalog.load()
    quote = catalog.quote(INSTANCE)
    with (
        tempfile.TemporaryDirectory(prefix="gate-bench-") as tmp,
        prefect_server(services=False, durable_leases=False) as api_url,
        postgres_ledger() as pg_url,
    ):
        backends = {"sqlite": f"sqlite:///{tmp}/ledger.db"}
        if pg_url is not None:
            backends["postgresql"] = pg_url
        out: dict[str, Any] = {
            "config": cfg.__dict__,
            "backends": list(backends),
            "cpus": os.cpu_count(),
            "load_avg_1m_at_start": os.getloadavg()[0],
        }
        with get_client(sync_client=True) as client:
            log(f"Prefect server at {api_url}; bare limit acquire+release x{cfg.iterations}")
            bare_limit = create_bare_limit(client)
            out["bare_prefect"] = bench_bare_prefect(client, bare_limit, cfg)
            out["gate"], out["decision"] = {}, {}
            for name, url in backends.items():
                log(f"{name}: gate admit+settle and ledger decision x{cfg.iterations}")
                ledger = fresh_ledger(url)
                gate = Gate(ledger, RateLimits(client), catalog=catalog)
                out["gate"][name] = bench_gate(gate, cfg)
                out["decision"][name] = bench_decision(ledger, quote, cfg)
                ledger.dispose()
        targets = {"prefect (bare)": ("prefect", bare_limit)}
        targets.update({f"gate, {name}": ("gate", url) for name, url in backends.items()})
        out["throughput"] = bench_throughput(targets, api_url, cfg)
        out["size"] = {}
        for name, url in backends.items():
            size_url = f"sqlite:///{tmp}/size.db" if name == "sqlite" else url
            log(f"{name}: ledger decision at {cfg.small_rows:,} and {cfg.large_rows:,} rows")
            limit = PG_BULK_LIMIT_S if name == "postgresql" else None
            out["size"][name] = bench_size(size_url, quote, cfg, limit)
    out["ratios"] = ratios(out)
    out["wall_s"] = time.perf_counter() - wall
    return out


def ratios(out: dict[str, Any]) -> dict[str, Any]:
    bare = out["bare_prefect"]["p50_ms"]
    return {
        "gate_over_prefect": {k: v["p50_ms"] / bare for k, v in out["gate"].items()},
        "decision_p50_ms": {k: v["p50_ms"] for k, v in out["decision"].items()},
        "size_growth": {k: v["growth"] for k, v in out["size"].items()},
    }


# -- report ------------------------------------------------------------------------------------


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def verdict(value: float, target: float) -> str:
    return "ok" if value <= target else "MISSED"


def report(out: dict[str, Any]) -> str:
    cfg = out["config"]
    sections = [
        f"Gate benchmark ({'quick' if cfg['iterations'] < 200 else 'full'}: "
        f"{cfg['iterations']} iterations, {cfg['duration_s']} s per throughput round; "
        f"{out['cpus']} CPUs, 1-min load {out['load_avg_1m_at_start']:.2f} at start; "
        "Prefect server: test harness, on SQLite, same machine)",
        "",
        "Latency, uncontended (ms)",
        "",
        latency_table(out),
        "",
        "The gate takes slots in two limits (bench, bench/team) in one request; the bare",
        "figure takes one slot in one limit.",
        "",
        "Throughput: acquire+release (bare) or admit+settle (gate) per second, all admitters",
        "together (separate processes); latency per round trip, including the one in flight",
        "at the stop.",
        "",
        throughput_table(out["throughput"]),
        "",
        "Ledger size: decision latency (ms, record + decide) against settled rows already in the ledger",
        "",
        size_table(out["size"]),
        "",
        "Targets",
        "",
        targets_table(out["ratios"]),
    ]
    notes = report_notes(out)
    if notes:
        sections += ["", "Notes", "", *[f"- {n}" for n in notes]]
    sections += ["", f"Total wall time {out['wall_s']:.0f} s."]
    return "\n".join(sections)


def latency_table(out: dict[str, Any]) -> str:
    bare = out["bare_prefect"]
    rows = [
        ["Prefect limit acquire+release (raw client)", "-", ms(bare["p50_ms"]), ms(bare["p95_ms"])]
    ]
    rows += [
        [
            f"Gate admit+settle (admit {ms(g['admit_p50_ms'])} + settle {ms(g['settle_p50_ms'])})",
            name,
            ms(g["p50_ms"]),
            ms(g["p95_ms"]),
        ]
        for name, g in out["gate"].items()
    ]
    rows += [
        ["Ledger decision (record + decide)", name, ms(d["p50_ms"]), ms(d["p95_ms"])]
        for name, d in out["decision"].items()
    ]
    return table(["Operation", "Ledger", "p50", "p95"], rows)


def size_table(size: dict[str, dict[str, Any]]) -> str:
    rows = [
        [
            name,
            f"{s['small_rows']:,}",
            ms(s["small"]["p50_ms"]),
            ms(s["small"]["p95_ms"]),
            f"{s['large_rows']:,}",
            ms(s["large"]["p50_ms"]),
            ms(s["large"]["p95_ms"]),
            f"{s['load_s']:.0f} s",
        ]
        for name, s in size.items()
    ]
    header = ["Ledger", "Rows (small)", "p50", "p95", "Rows (large)", "p50", "p95", "Bulk load"]
    return table(header, rows)


def report_notes(out: dict[str, Any]) -> list[str]:
    notes = [f"{k}: {s['note']}" for k, s in out["size"].items() if s["note"]]
    notes += [
        f"{k}, {r['workers']} admitters: {r['errors']} errors, first: {r['first_error']}"
        for k, rounds in out["throughput"].items()
        for r in rounds
        if r["errors"]
    ]
    if "postgresql" not in out["backends"]:
        notes.append(f"PostgreSQL skipped: {(PG_URL or SERVER).split('@')[-1]} unreachable")
    return notes


def throughput_table(throughput: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        [
            name,
            str(r["workers"]),
            f"{r['per_s']:.1f}",
            ms(r["p50_ms"]),
            ms(r["p95_ms"]),
            ms(r["max_ms"]),
            str(r["errors"]),
        ]
        for name, rounds in throughput.items()
        for r in rounds
    ]
    return table(["Path", "Admitters", "Per second", "p50 ms", "p95 ms", "max ms", "Errors"], rows)


def targets_table(r: dict[str, Any]) -> str:
    rows = [
        [
            f"Gate p50 / Prefect p50 ({k})",
            f"{v:.2f}",
            "<= 1.5",
            verdict(v, TARGETS["gate_over_prefect"]),
        ]
        for k, v in r["gate_over_prefect"].items()
    ]
    rows += [
        [
            f"Ledger decision p50 ({k})",
            f"{v:.2f} ms",
            "<= 2 ms" if k == "sqlite" else "-",
            verdict(v, TARGETS["decision_ms_sqlite"]) if k == "sqlite" else "-",
        ]
        for k, v in r["decision_p50_ms"].items()
    ]
    rows += [
        [
            f"Decision p50 large / small ledger ({k})",
            f"{v:.2f}",
            "<= 1.2",
            verdict(v, TARGETS["size_growth"]),
        ]
        for k, v in r["size_growth"].items()
    ]
    return table(["Figure", "Value", "Target", ""], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations, 10^5 rows")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    out = run(Config.of(args.quick))
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(report(out))


if __name__ == "__main__":
    main()

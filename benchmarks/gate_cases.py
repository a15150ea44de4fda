"""The gate benchmark's measured cases, run under one source tree: `python -m
benchmarks.gate_cases` with that tree on PYTHONPATH (see benchmarks/gate_latency.py, which
starts one per tree, and the Prefect server and the databases they share).

The process answers one case per JSON line on stdin with one JSON line on stdout
(`{"ok": result}` or `{"error": ...}`), after a first line that names the package it imported
(`{"ready": {"package": path}}`), until stdin ends. Anything else it prints goes to stderr. Its
admitter processes (spawned) inherit its `sys.path`, so they run the same tree's code.
"""

from __future__ import annotations

import os
import sys

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import json
import multiprocessing as mp
import queue
import random
import time
import traceback
import uuid
from collections.abc import Callable
from functools import partial
from multiprocessing.queues import Queue
from typing import Any, TextIO
from uuid import UUID

import sqlalchemy as sa

import prefect_gpu_budget
from benchmarks.harness.parts import part
from benchmarks.harness.report import logger
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.ledger import (
    Ledger,
    NewJob,
    holder_id,
    jobs,
    metadata,
)
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import team_of
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog, Quote
from prefect_gpu_budget.testing.stats import percentile, summary_ms
from prefect_gpu_budget.units import rate_cents

ORG = "bench"
TEAM = f"{ORG}/team"
SCOPE = f"{TEAM}/s1"
INSTANCE = "aws:g5.xlarge"
INSERT_BATCH = 20_000

TREE = os.environ.get("GATE_BENCH_TREE", "now")
"""The tree's label in the driver's report (the progress lines say it)."""

log = logger(f"bench {TREE}")


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
    metadata.drop_all(part(old, "db").engine)
    part(old, "db").dispose()
    ledger = Ledger(url)
    for rule in budgets():
        part(ledger, "config").set_budget(rule)
    return ledger


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


def bench_bare_prefect(client: Any, name: str, iterations: int, warmup: int) -> dict[str, float]:
    samples = [
        timed(lambda: bare_acquire_release(client, name)) for _ in range(warmup + iterations)
    ]
    return summary_ms(samples[warmup:])


# -- 2. gate and ledger decision, uncontended --------------------------------------------------


def bench_gate(gate: Gate, iterations: int, warmup: int) -> dict[str, Any]:
    job = bench_job()
    admits, settles, totals = [], [], []
    for _ in range(warmup + iterations):
        start = time.perf_counter()
        admission = gate.admit(job, SCOPE)
        admitted = time.perf_counter()
        part(gate, "holding").settle(admission, ended_at=time.time(), outcome="completed")
        done = time.perf_counter()
        admits.append(admitted - start)
        settles.append(done - admitted)
        totals.append(done - start)
    skip = warmup
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
        job_id, decision = part(ledger, "queue").request(job)
        samples.append(time.perf_counter() - start)
        if decision.verdict != "admit":
            raise RuntimeError(f"benchmark job not admitted: {decision.reason}")
        part(ledger, "settlements").settle(
            job_id, ended_at=time.time(), outcome="completed", scope=SCOPE
        )
    return samples


def bench_decision(ledger: Ledger, quote: Quote, iterations: int, warmup: int) -> dict[str, float]:
    return summary_ms(decision_samples(ledger, quote, warmup + iterations)[warmup:])


# -- 3. throughput: concurrent admitters in separate processes -----------------------------------


def admitter(index: int, api_url: str, commands: Queue, results: Queue) -> None:
    """One admitter process, with its own client (and, per round, its own Ledger and Gate)."""
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            limits, catalog = RateLimits(client), Catalog.load()
            results.put(("ready", index, prefect_gpu_budget.__file__))
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
                    part(ledger, "db").dispose()
                results.put(("done", index, done))
    except Exception as exc:  # report, so the parent does not wait for nothing
        results.put(("failed", index, f"{type(exc).__name__}: {exc}"))


def gate_round_trip(gate: Gate, scope: str) -> Callable[[], None]:
    job = bench_job()

    def op() -> None:
        part(gate, "holding").settle(
            gate.admit(job, scope), ended_at=time.time(), outcome="completed"
        )

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
        packages = set(self._collect("ready", size))
        if packages != {prefect_gpu_budget.__file__}:  # they must run this process's tree
            raise RuntimeError(f"admitters imported {packages}, not {prefect_gpu_budget.__file__}")

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
        scope = rng.choice(scopes)
        rows.append(
            {
                "id": str(uuid.uuid4()),
                "org": ORG,
                "scope": scope,
                "team": team_of(scope),
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
        with part(ledger, "db").engine.begin() as conn:
            conn.execute(jobs.insert(), batch)
        done += len(batch)
        if limit_s is not None and time.perf_counter() - started > limit_s and done < count:
            break
    return done


def settled_count(ledger: Ledger) -> int:
    with part(ledger, "db").engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(jobs).where(jobs.c.state == "settled")
        return int(conn.execute(query).scalar_one())


def bench_size(
    url: str,
    quote: Quote,
    rows: tuple[int, int],
    iterations: int,
    warmup: int,
    limit_s: float | None,
) -> dict[str, Any]:
    """Decision latency with `rows` (small, large) settled rows in a fresh ledger; the bulk
    load to the large count stops past `limit_s`."""
    ledger, rng = fresh_ledger(url), random.Random(0)
    try:
        bulk_insert(ledger, rows[0], rng, None)
        small_rows = settled_count(ledger)
        small = summary_ms(decision_samples(ledger, quote, warmup + iterations)[warmup:])
        started = time.perf_counter()
        inserted = bulk_insert(ledger, rows[1] - settled_count(ledger), rng, limit_s)
        load_s = time.perf_counter() - started
        large_rows = settled_count(ledger)
        large = summary_ms(decision_samples(ledger, quote, warmup + iterations)[warmup:])
    finally:
        part(ledger, "db").dispose()
    note = None
    if large_rows < rows[1]:
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


# -- the process: one tree's cases on request ---------------------------------------------------


class Cases:
    """What the driver can ask for, with what the cases share: one Prefect client, the catalog's
    quote, a bare limit and (during the throughput rounds) a pool of admitter processes."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.catalog = Catalog.load()
        self.quote = self.catalog.quote(INSTANCE)
        self.limits = RateLimits(client)
        self.bare_limit: str | None = None
        self.pool: AdmitterPool | None = None

    def run(self, case: str, **args: Any) -> Any:
        cases: dict[str, Callable[..., Any]] = {
            "bare": self.bare,
            "latency": self.latency,
            "throughput": self.throughput,
            "close_pool": self.close_pool,
            "size": self.size,
        }
        return cases[case](**args)

    def limit_name(self) -> str:
        if self.bare_limit is None:
            self.bare_limit = create_bare_limit(self.client)
        return self.bare_limit

    def bare(self, iterations: int, warmup: int) -> dict[str, float]:
        """Acquire + release one slot of a bare Prefect limit (no code of this package)."""
        return bench_bare_prefect(self.client, self.limit_name(), iterations, warmup)

    def latency(self, url: str, iterations: int, warmup: int) -> dict[str, Any]:
        """Admit + settle through the gate, then the ledger's decision alone, on a fresh ledger
        (left in place, budgets set, for the throughput rounds)."""
        ledger = fresh_ledger(url)
        try:
            gate = Gate(ledger, self.limits, catalog=self.catalog)
            return {
                "gate": bench_gate(gate, iterations, warmup),
                "decision": bench_decision(ledger, self.quote, iterations, warmup),
            }
        finally:
            part(ledger, "db").dispose()

    def throughput(self, target: str, workers: int, duration_s: float, pool: int) -> dict[str, Any]:
        """One round of `workers` admitters: bare Prefect limits (`target` "prefect") or the gate
        on the ledger at URL `target`. The first round spawns `pool` admitter processes."""
        if self.pool is None:
            log(f"spawning {pool} admitter processes")
            started = time.perf_counter()
            self.pool = AdmitterPool(pool, os.environ["PREFECT_API_URL"])
            log(f"admitters ready in {time.perf_counter() - started:.1f} s")
        command = ("prefect", self.limit_name()) if target == "prefect" else ("gate", target)
        return self.pool.round(command, workers, duration_s)

    def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def size(
        self,
        url: str,
        small_rows: int,
        large_rows: int,
        iterations: int,
        warmup: int,
        limit_s: float | None,
    ) -> dict[str, Any]:
        rows = (small_rows, large_rows)
        return bench_size(url, self.quote, rows, iterations, warmup, limit_s)


def answer(replies: TextIO, reply: dict[str, Any]) -> None:
    replies.write(json.dumps(reply, default=str) + "\n")
    replies.flush()


def serve() -> None:
    """Answer the driver's requests, one JSON line each, until stdin ends."""
    replies = os.fdopen(os.dup(1), "w")
    # whatever else writes to stdout (this process's or its children's) goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        cases = Cases(client)
        answer(replies, {"ready": {"package": prefect_gpu_budget.__file__}})
        try:
            for line in sys.stdin:
                try:
                    reply = {"ok": cases.run(**json.loads(line))}
                except Exception as exc:  # the driver says which case and tree failed
                    reply = {
                        "error": f"{type(exc).__name__}: {exc}",
                        "trace": traceback.format_exc(),
                    }
                answer(replies, reply)
        finally:
            cases.close_pool()


if __name__ == "__main__":
    serve()

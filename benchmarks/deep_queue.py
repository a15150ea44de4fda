"""Benchmark: what a deep queue of waiting jobs costs (prefect_gpu_budget/admission/watcher.py).

Per depth (`--waiters`), N agent processes (subprocesses of this one) x P waiting threads each
(P = waiters / N) share one real `prefect server start` (on a PostgreSQL database of its own:
under this load a SQLite server answers 503s and Prefect's client backs off) and one ledger, a
fresh one per depth (a PostgreSQL database of its own, or a SQLite file). One team's hourly cap
admits `CAP_JOBS` = 8 jobs at once, in the ledger and in a Prefect global concurrency limit.
The same `--jobs` run at every depth: each thread takes jobs from its process's share until it
is gone, so the queue holds min(waiters, jobs) - 8 jobs nearly all the time.

A job is driven through the gate directly, as `run_gpu_job` drives it (`Gate.admit`, the Prefect
limits taken, `Gate.started`, a `--job-s` sleep as the job, `Gate.settle`), in plain threads,
not through Prefect flows: 128 task-runner threads per process on a 2-core machine would
measure Prefect's task orchestration, not the queue.

Measured per depth:
- jobs run / failed: settled `completed` rows in the ledger; the agents' exceptions;
- cap use: job-seconds (sum of ended_at - started_at) / (8 x busy window), the busy window from
  the first admission to the last end;
- cap held: the most jobs ever admitted at once, from the rows' [admitted_at, settled_at)
  windows (must never pass 8);
- ledger transactions per job (PostgreSQL): `xact_commit + xact_rollback` of the depth's own
  ledger database in `pg_stat_database`, from just before the agents start to after they ended
  (they flush their statistics on exit; the snapshot is cleared and read 1.5 s later), / jobs;
  and the sessions opened to it (`sessions`) per job: PostgreSQL counts each session's start as
  a transaction too, so connections the pool opens and closes show in the transactions;
- headroom to admission: order admissions and settlements by time; the (k + 8)-th admission
  could happen only once the k-th settlement committed (its `settled_at`). For each k: the
  (k + 8)-th job's `started_at` (stamped right after `Gate.admit` returned in its thread, so it
  includes the wake-up and the Prefect limit) minus the k-th `settled_at`; p50 / p95 / max.
  Also the ledger's own part: the (k + 8)-th `admitted_at` minus the k-th `settled_at`;
- agent CPU: user + system seconds of all agent processes (`os.times()` in each, from the
  start signal to its last job's end), per minute of the busy window; and per waiter-minute
  (sum over jobs of the time `Gate.admit` waited);
- ledger connections per process (PostgreSQL): every 0.1 s the parent counts each agent's
  established TCP connections to the ledger's port (its `/proc/<pid>/fd` socket inodes against
  `/proc/net/tcp`; an agent connects to no other PostgreSQL); the peak over the run of the
  busiest agent. A process here also runs its jobs (admit, start, settle), not only waits, so
  the peak is also given over the samples in which the agent, past its first settlement, had
  jobs waiting in `Gate.admit` and none admitted or running or getting in line (a `request`, or the budgets read that
  follows it, in flight): its jobs only waited (each agent writes those counts to a file of
  its own as they change); and, for the first 5 such samples over 2 connections, what those
  connections' backends were doing (`pg_stat_activity` by client port).
- ledger calls per job, by method, counted in each agent (the gate's and the watcher's).

Usage: python -m benchmarks.deep_queue [--waiters 16,256,1024] [--processes 4,4,8]
       [--jobs N] [--job-s 1.0] [--backend postgresql,sqlite] [--json] [--keep DIR]
       [--pg-server postgresql://postgres@127.0.0.1:5432]

PostgreSQL is expected at 127.0.0.1:5432 (databases `deep_queue_<id>`, dropped at the end).
Progress goes to stderr; the tables (or, with --json, one JSON object) to stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/deep_queue.py` (and so are its agents)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"

import argparse
import contextlib
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import sqlalchemy as sa

from benchmarks.harness.report import logger, table
from prefect_gpu_budget.testing.postgres import SERVER, postgres_database, server_of
from prefect_gpu_budget.testing.servers import PrefectServer, read_line, serving
from prefect_gpu_budget.testing.stats import percentile

CAP_JOBS = 8
"""Jobs the team's hourly cap admits at once."""
PRICE_CENTS = 360
"""The hourly price of one job (`local:deep` at $3.60/h)."""
DEFAULT_PROCESSES = {16: 4, 256: 4, 1024: 8}
SAMPLE_S = 0.1
PG_PORT_HEX = f"{5432:04X}"
COUNTED = [
    "queue.ask",
    "queue.request",
    "config.path_budgets",
    "queue.try_admit",
    "queue.decided",
    "settlements.record_lease",
    "settlements.mark_started",
    "settlements.heartbeat",
    "settlements.settle",
    "views.job",
    "views.states",
    "queue.recheck",
    "views.versions",
    "queue.cancel_queued",
    "queue.unadmit",
    "views.stop_asked",
    "settlements.record_submission",
]
"""The ledger calls an agent counts (each one transaction, retries aside)."""

log = logger("deep")


@dataclass(frozen=True)
class AgentConfig:
    index: int
    ledger_url: str
    prices: str
    scope: str
    threads: int
    jobs: int
    job_s: float
    running_path: str
    """Where the agent keeps the number of its jobs admitted and not yet settled."""


@dataclass(frozen=True)
class Depth:
    backend: str
    waiters: int
    processes: int
    jobs: int
    job_s: float

    @property
    def per_process(self) -> int:
        return self.waiters // self.processes


# -- the agent process -------------------------------------------------------------------------


def agent_main(raw: str) -> None:
    """One agent: `threads` threads run `jobs` jobs through the gate; prints one JSON line."""
    cfg = AgentConfig(**json.loads(raw))
    os.environ["PREFECT_GPU_BUDGET_PRICES"] = cfg.prices
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.limits import RateLimits
    from prefect_gpu_budget.job import GpuJob
    from prefect_gpu_budget.pricing.catalog import Catalog

    activity = Activity(cfg.running_path)
    ledger = Ledger(cfg.ledger_url, create=False)
    calls = count_calls(ledger, activity)
    ended = count_transactions(ledger.db.engine)
    job = GpuJob(instance_type="local:deep", max_runtime="10m")
    left, lock = [cfg.jobs], threading.Lock()
    waited: list[float] = []
    errors: list[str] = []
    count = activity.running
    with get_client(sync_client=True) as client:
        gate = Gate(ledger, RateLimits(client), catalog=Catalog.load(Path(cfg.prices)))

        def worker() -> None:
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                try:
                    activity.asking(1)
                    try:
                        admission = gate.admit(job, cfg.scope)
                    finally:
                        activity.asking(-1)
                    count(1)
                    gate.holding.started(admission, time.time())
                    waited.append(admission.waited_s)
                    time.sleep(cfg.job_s)
                    gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
                    count(-1)
                except Exception as exc:  # counted and reported, the run goes on
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])

        print("ready", flush=True)
        sys.stdin.readline()
        before = os.times()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(cfg.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after = os.times()
    ledger.db.dispose()
    cpu = (after.user - before.user) + (after.system - before.system)
    out = {"cpu_s": cpu, "waited_s": sum(waited), "errors": errors, "done": len(waited)}
    out["calls"] = calls
    out["transactions_ended"] = ended[0]
    print(json.dumps(out), flush=True)


def count_transactions(engine: Any) -> list[int]:
    """Transactions the agent's engine commits or rolls back from now on (one per ledger call;
    what `pg_stat_database` counts beyond them was not the agents' calls)."""
    ended = [0]

    def end(_conn: Any) -> None:
        ended[0] += 1

    sa.event.listen(engine, "commit", end)
    sa.event.listen(engine, "rollback", end)
    return ended


class Activity:
    """What an agent's jobs are doing, kept in a file the parent reads: jobs admitted and not
    settled, jobs settled, and calls in flight that get a job in line (`ask`: the request)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        self.counts = [0, 0, 0, 0]  # admitted or running, settled, getting in line, asking
        self._write()

    def _write(self) -> None:
        os.pwrite(self._fd, "".join(f"{n:8d}" for n in self.counts).encode(), 0)

    def running(self, step: int) -> None:
        with self._lock:
            self.counts[0] += step
            self.counts[1] += step < 0
            self._write()

    def in_line(self, step: int) -> None:
        with self._lock:
            self.counts[2] += step
            self._write()

    def asking(self, step: int) -> None:
        """A job's `Gate.admit` began (1) or returned (-1)."""
        with self._lock:
            self.counts[3] += step
            self._write()


def count_calls(ledger: Any, activity: Activity) -> dict[str, int]:
    """Count the `COUNTED` calls on `ledger` (from the gate and the watcher) from now on, and
    tell `activity` of the calls that get a job in line."""
    calls = dict.fromkeys(COUNTED, 0)
    lock = threading.Lock()

    def counted(name: str, method: Any) -> Any:
        in_line = name in ("queue.ask", "queue.request")

        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                calls[name] += 1
            if not in_line:
                return method(*args, **kwargs)
            activity.in_line(1)
            try:
                return method(*args, **kwargs)
            finally:
                activity.in_line(-1)

        return call

    for counted_call in COUNTED:  # `store.method`
        store, name = counted_call.split(".")
        target = getattr(ledger, store)
        setattr(target, name, counted(counted_call, getattr(target, name)))
    return calls


# -- connections, from outside ---------------------------------------------------------------


def _pg_socket_inodes() -> dict[str, int]:
    """Inode -> local port of the established TCP connections to port 5432 on this host."""
    found: dict[str, int] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(name).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[2].rsplit(":", 1)[1] == PG_PORT_HEX and fields[3] == "01":
                    found[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def pg_connections(pid: int, inodes: dict[str, int]) -> list[int]:
    """The local ports of those of `inodes` the process `pid` holds open."""
    ports = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    ports.append(inodes[target[8:-1]])
    return ports


def only_waiting(path: Path) -> bool:
    """Whether the agent, as it last wrote (`Activity`), had settled a job already (past the
    start), had jobs waiting in `Gate.admit`, and none admitted or running or getting in line."""
    try:
        running, settled, in_line, asking = map(int, path.read_bytes().split())
    except (OSError, ValueError):
        return False
    return running == 0 and in_line == 0 and settled > 0 and asking > 0


class ConnectionSampler:
    """Every `SAMPLE_S`, each agent's ledger connections: each one's peak, and its peak among
    the samples in which none of its jobs was admitted or running (only waiting)."""

    def __init__(self, pids: list[int], running: list[Path], admin: sa.Engine) -> None:
        self.pids = pids
        self.admin = admin
        self.evidence: list[list[str]] = []
        """What the backends of an only-waiting agent over 2 connections were doing (first 5)."""
        self.running = running
        self.peaks = [0] * len(pids)
        self.waiting_peaks = [0] * len(pids)
        self.waiting_samples = [0] * len(pids)
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            inodes = _pg_socket_inodes()
            ports = [pg_connections(pid, inodes) for pid in self.pids]
            counts = [len(p) for p in ports]
            for i, path in enumerate(self.running):
                if only_waiting(path):
                    self.waiting_samples[i] += 1
                    self.waiting_peaks[i] = max(self.waiting_peaks[i], counts[i])
                    if counts[i] > 2 and len(self.evidence) < 5:
                        self.evidence.append(self._doing(ports[i]))
            self.peaks = [max(a, b) for a, b in zip(self.peaks, counts, strict=True)]
            self.peak_total = max(self.peak_total, sum(counts))

    def _doing(self, ports: list[int]) -> list[str]:
        with self.admin.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT state, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) "
                    "FROM pg_stat_activity WHERE client_port = ANY(:p)"
                ),
                {"p": ports},
            )
            return [f"{state}: {query}" for state, query in rows]

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the parent --------------------------------------------------------------------------------


def xacts(admin: sa.Engine, database: str) -> tuple[int, int]:
    """Committed + rolled-back transactions of `database` so far, and the sessions opened to
    it (a fresh snapshot). A session's start counts one transaction itself."""
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        done, sessions = conn.execute(
            sa.text(
                "SELECT xact_commit + xact_rollback, sessions FROM pg_stat_database "
                "WHERE datname = :d"
            ),
            {"d": database},
        ).one()
        return int(done), int(sessions)


@contextlib.contextmanager
def fresh_ledger(backend: str, tmp: Path, tag: str, server: str) -> Iterator[str]:
    """The URL of an empty ledger for one depth: a database or a file of its own."""
    if backend == "postgresql":
        with postgres_database(f"deep_queue_{tag}", server) as url:
            yield url
    else:
        yield f"sqlite:///{tmp / f'ledger-{tag}.db'}"


def windows_peak(rows: list[dict[str, Any]]) -> int:
    """The most rows whose [admitted_at, settled_at) windows overlap at one instant."""
    edges = [(r["admitted_at"], 1) for r in rows] + [(r["settled_at"], -1) for r in rows]
    edges.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    held = peak = 0
    for _, step in edges:
        held += step
        peak = max(peak, held)
    return peak


def headroom_delays(rows: list[dict[str, Any]], column: str) -> list[float]:
    """For each k: the (k + cap)-th `column` time minus the k-th settlement (module docstring)."""
    settled = sorted(r["settled_at"] for r in rows)
    taken = sorted(r[column] for r in rows)
    return [taken[k + CAP_JOBS] - settled[k] for k in range(len(taken) - CAP_JOBS)]


def run_depth(
    depth: Depth, prices: Path, tmp: Path, admin: sa.Engine | None, server: str
) -> dict[str, Any]:
    """One depth: a fresh ledger, the agents started together, the figures."""
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.limits import RateLimits
    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    org = f"dq{depth.waiters}"
    team = f"{org}/team"
    tag = f"{depth.backend[:2]}{depth.waiters}"
    with fresh_ledger(depth.backend, tmp, tag, server) as url:
        ledger = Ledger(url)
        ledger.config.set_budget(
            BudgetRule(team, hourly_cap_cents=CAP_JOBS * PRICE_CENTS, max_wait_s=3600)
        )
        limits = RateLimits()
        try:
            limits.ensure([(team, CAP_JOBS * PRICE_CENTS)])
        finally:
            limits.close()
        shares = [depth.jobs // depth.processes] * depth.processes
        for i in range(depth.jobs % depth.processes):
            shares[i] += 1
        procs: list[subprocess.Popen] = []
        logs = [tmp / f"agent-{tag}-{i}.log" for i in range(depth.processes)]
        running = [tmp / f"agent-{tag}-{i}.running" for i in range(depth.processes)]
        for i in range(depth.processes):
            cfg = AgentConfig(
                i,
                url,
                str(prices),
                f"{team}/a{i}",
                depth.per_process,
                shares[i],
                depth.job_s,
                str(running[i]),
            )
            with logs[i].open("w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.deep_queue", "--agent"]
                        + [json.dumps(asdict(cfg))],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
        try:
            deadline = time.monotonic() + 300
            for i, proc in enumerate(procs):
                if read_line(proc, deadline).strip() != "ready":
                    raise RuntimeError(f"agent {i} not ready: {logs[i].read_text()[-800:]}")
            database = sa.make_url(url).database if admin is not None else None
            if admin is not None:
                time.sleep(1.5)
                x0 = xacts(admin, database)
            log(f"{depth.backend} {depth.waiters} waiters: {depth.processes} agents go")
            wall0 = time.time()
            sampler = (
                ConnectionSampler([p.pid for p in procs], running, admin)
                if admin is not None
                else None
            )
            with sampler or contextlib.nullcontext():
                for proc in procs:
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                timeout = 120 + 20 * depth.jobs * depth.job_s / CAP_JOBS
                reports = []
                end = time.monotonic() + timeout
                for i, proc in enumerate(procs):
                    line = read_line(proc, end)
                    if not line:
                        raise RuntimeError(
                            f"agent {i} gave no report: {logs[i].read_text()[-800:]}"
                        )
                    reports.append(json.loads(line))
                for proc in procs:
                    proc.wait(timeout=60)
            wall = time.time() - wall0
            if admin is not None:
                time.sleep(1.5)
                x1 = xacts(admin, database)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        rows = [r for r in ledger.views.jobs(org) if r["state"] == "settled"]
        ledger.db.dispose()
    pg = None if admin is None else (x1[0] - x0[0], x1[1] - x0[1])
    return figures(depth, rows, reports, sampler, pg, wall)


def figures(
    depth: Depth,
    rows: list[dict[str, Any]],
    reports: list[dict[str, Any]],
    sampler: ConnectionSampler | None,
    transactions: tuple[int, int] | None,
    wall: float,
) -> dict[str, Any]:
    ran = [r for r in rows if r["outcome"] == "completed" and r["started_at"] is not None]
    errors = [e for rep in reports for e in rep["errors"]]
    out: dict[str, Any] = {
        "backend": depth.backend,
        "waiters": depth.waiters,
        "processes": depth.processes,
        "per_process": depth.per_process,
        "jobs": depth.jobs,
        "job_s": depth.job_s,
        "ran": len(ran),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "load_avg_1m": os.getloadavg()[0],
    }
    if ran:
        first = min(r["admitted_at"] for r in ran)
        last = max(r["ended_at"] for r in ran)
        busy = last - first
        job_seconds = sum(r["ended_at"] - r["started_at"] for r in ran)
        delays = headroom_delays(ran, "started_at")
        ledger_delays = headroom_delays(ran, "admitted_at")
        cpu = sum(rep["cpu_s"] for rep in reports)
        recorded = max(r["requested_at"] for r in ran)  # the last request is in the queue
        settled = sorted(r["settled_at"] for r in ran)
        after = [d for d, k in zip(delays, settled, strict=False) if k >= recorded]
        out.update(
            requests_recorded_s=recorded - first,
            headroom_p95_after_requests_s=percentile(after, 95) if after else None,
            headroom_n_after_requests=len(after),
            agent_transactions_per_job=sum(rep["transactions_ended"] for rep in reports) / len(ran),
            calls_per_job={
                name: round(sum(rep["calls"][name] for rep in reports) / len(ran), 3)
                for name in COUNTED
                if any(rep["calls"][name] for rep in reports)
            },
        )
        waited = sum(rep["waited_s"] for rep in reports)
        out.update(
            busy_s=busy,
            cap_use=job_seconds / (CAP_JOBS * busy),
            cap_held_max=windows_peak(ran),
            headroom_p50_s=percentile(delays, 50) if delays else None,
            headroom_p95_s=percentile(delays, 95) if delays else None,
            headroom_max_s=max(delays) if delays else None,
            ledger_headroom_p95_s=percentile(ledger_delays, 95) if ledger_delays else None,
            agent_cpu_s=cpu,
            cpu_s_per_min=cpu / (busy / 60),
            waiter_min=waited / 60,
            cpu_s_per_waiter_min=cpu / (waited / 60) if waited else None,
        )
    if transactions is not None:
        out["transactions"], out["sessions"] = transactions
        out["transactions_per_job"] = transactions[0] / max(1, len(ran))
        out["sessions_per_job"] = transactions[1] / max(1, len(ran))
    if sampler is not None:
        out["peak_connections_per_process"] = max(sampler.peaks)
        out["peak_connections_by_process"] = sampler.peaks
        out["peak_connections_total"] = sampler.peak_total
        out["peak_connections_only_waiting"] = max(sampler.waiting_peaks)
        out["only_waiting_samples_by_process"] = sampler.waiting_samples
        out["only_waiting_over_2_doing"] = sampler.evidence
    return out


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(results: list[dict[str, Any]]) -> str:
    header = ["backend", "waiters", "procs x P", "ran / failed", "cap use", "held max"]
    header += [
        "xacts/job (sessions/job)",
        "headroom p50 / p95 / max s",
        "CPU s/min",
        "CPU s/waiter-min",
    ]
    header += ["peak conns/proc (all / only waiting)", "wall s", "load 1m"]
    rows = []
    for r in results:
        rows.append(
            [
                r["backend"],
                str(r["waiters"]),
                f"{r['processes']} x {r['per_process']}",
                f"{r['ran']} / {r['failed']} of {r['jobs']}",
                _num(r.get("cap_use"), ".3f"),
                str(r.get("cap_held_max", "-")),
                f"{_num(r.get('transactions_per_job'), '.2f')} "
                f"({_num(r.get('sessions_per_job'), '.2f')})",
                " / ".join(
                    _num(r.get(k), ".3f")
                    for k in ("headroom_p50_s", "headroom_p95_s", "headroom_max_s")
                ),
                _num(r.get("cpu_s_per_min"), ".1f"),
                _num(r.get("cpu_s_per_waiter_min"), ".3f"),
                f"{r.get('peak_connections_per_process', '-')} / "
                f"{r.get('peak_connections_only_waiting', '-')}",
                f"{r['wall_s']:.0f}",
                f"{r['load_avg_1m']:.2f}",
            ]
        )
    return table(header, rows)


def targets(results: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's targets at each backend's deepest depth, against its shallowest."""
    out: dict[str, bool] = {}
    for backend in {r["backend"] for r in results}:
        mine = sorted((r for r in results if r["backend"] == backend), key=lambda r: r["waiters"])
        low, deep = mine[0], mine[-1]
        name = f"{backend}_{deep['waiters']}"
        out[f"{name}_every_job_ran"] = deep["ran"] == deep["jobs"] and deep["failed"] == 0
        compared = low is not deep
        if compared and "cap_use" in deep and "cap_use" in low:
            out[f"{name}_cap_use_vs_{low['waiters']}"] = deep["cap_use"] >= 0.9 * low["cap_use"]
        if deep.get("headroom_p95_s") is not None:
            out[f"{name}_headroom_p95_le_1s"] = deep["headroom_p95_s"] <= 1.0
        out[f"{name}_cap_never_exceeded"] = all(r.get("cap_held_max", 0) <= CAP_JOBS for r in mine)
        if "transactions_per_job" in deep:
            per = deep["transactions_per_job"]
            out[f"{name}_xacts_per_job_le_10"] = per <= 10
            if compared:
                out[f"{name}_xacts_per_job_vs_{low['waiters']}"] = (
                    per <= 1.5 * low["transactions_per_job"]
                )
        if "peak_connections_per_process" in deep:
            waiting = deep["peak_connections_only_waiting"]
            out[f"{name}_conns_per_only_waiting_process_le_2"] = waiting <= 2
            out[f"{name}_conns_per_process_le_2"] = deep["peak_connections_per_process"] <= 2
    return dict(sorted(out.items()))


def start_prefect(tmp: Path, prefect_url: str) -> PrefectServer:
    db = "postgresql+asyncpg://" + prefect_url.split("://", 1)[1]
    server = PrefectServer(
        tmp / "server-home", services=False, durable_leases=False, database_url=db
    )
    server.env["PREFECT_SERVER_LOGGING_LEVEL"] = "WARNING"
    return server


def run(
    depths: list[Depth], server: str = SERVER, keep: Path | None = None
) -> list[dict[str, Any]]:
    """Every depth against one Prefect server; with `keep`, its log and the agents' logs are
    copied there at the end."""
    from prefect_gpu_budget.pricing.catalog import set_local_price

    results = []
    admin = sa.create_engine(
        f"{server_of(server)}/postgres",
        poolclass=sa.NullPool,
        connect_args={"application_name": "deep-queue-monitor"},
    )
    with tempfile.TemporaryDirectory(prefix="deep-queue-") as raw:
        tmp = Path(raw)
        prices = set_local_price("deep", f"{PRICE_CENTS / 100:.2f}", gpus=1, path=tmp / "p.csv")
        with postgres_database("deep_queue_prefect", server) as prefect_url:
            prefect = start_prefect(tmp, prefect_url)
            with prefect, serving(prefect.api):
                os.environ["PREFECT_HOME"] = str(tmp / "client-home")
                log(f"Prefect server at {prefect.api}")
                for depth in depths:
                    pg = admin if depth.backend == "postgresql" else None
                    results.append(run_depth(depth, prices, tmp, pg, server))
                    log(json.dumps({k: v for k, v in results[-1].items() if k != "errors"}))
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for path in tmp.glob("*.log"):
                shutil.copy(path, keep / path.name)
    admin.dispose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--waiters", default="16,256,1024")
    parser.add_argument("--processes", help="per depth, comma-separated (default 4,4,8)")
    parser.add_argument("--jobs", type=int, help="jobs at every depth (default: the deepest)")
    parser.add_argument("--job-s", type=float, default=1.0, help="each job's sleep")
    parser.add_argument("--backend", default="postgresql,sqlite")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", type=Path, help="copy the server's and agents' logs here")
    parser.add_argument("--pg-server", default=SERVER, help="PostgreSQL server (no database)")
    args = parser.parse_args()
    if args.agent:
        agent_main(args.agent)
        return 0
    waiters = [int(w) for w in args.waiters.split(",")]
    if args.processes:
        processes = [int(p) for p in args.processes.split(",")]
    else:
        processes = [DEFAULT_PROCESSES.get(w, min(8, max(1, w // 16))) for w in waiters]
    jobs = args.jobs or max(waiters)
    depths = [
        Depth(backend, w, p, jobs, args.job_s)
        for backend in args.backend.split(",")
        for w, p in zip(waiters, processes, strict=True)
    ]
    load0 = os.getloadavg()
    results = run(depths, args.pg_server, args.keep)
    met = targets(results)
    if args.json:
        print(json.dumps({"load_avg_at_start": load0, "depths": results, "targets": met}))
    else:
        print(render(results))
        print()
        print(table(["target", "met"], [[k, str(v)] for k, v in met.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

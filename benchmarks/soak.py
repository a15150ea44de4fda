"""Soak: many agents in separate processes submit, cancel and finish GPU jobs for a long time.

Each agent is its own process with its own session scope `soak/team-<k>/agent-<i>` under
nested budgets (hourly caps on session, team and org, carried by Prefect global concurrency
limits; day, week and month budgets in the ledger on PostgreSQL), and loops through a mix of
jobs against the real `Gate`:

- run (55%): admitted, started, finished after 0.2-2 s and settled, through the job's life that
  `run_gpu_job` runs (`admission/lifecycle.py`: start recorded, settled once);
- impatient (15%): its own max_wait of 0.1-0.6 s; times out if it waits longer, else runs;
- interrupted (20%): a cancellation (an exception raised by a timer signal, like Ctrl-C or a
  task time-out) arrives 0.05-0.6 s after it starts waiting; it runs if admitted before that;
- withdrawn (10%): admitted, then cancelled before it starts.

Each agent keeps up to 3 jobs in flight and thinks 0-1.5 s between submissions; the session cap
holds 2 jobs, the team and org caps less than the sessions under them together, so some jobs
wait, at every level. Period budgets are sized never to bind (a budget running out would make
the end of the run unlike its start), but every decision reads them. A job still waiting 30 s
after the run ended is cancelled and counted as stuck.

Measured:
- admission latency: wall time of `Gate.admit` for jobs admitted at their first decision (they
  never waited): the ledger records and decides the request in one transaction, the Prefect
  limits of every capped scope on the path are taken in one request, the lease is recorded and
  the heartbeat starts. Waiting is workload, not gate cost, so jobs that waited are reported
  apart: from the start of the decision that admitted them to admit's return. Also, every
  ledger decision (`request`, `try_admit`) and every Prefect acquisition (granted or refused).
- per agent every 1-5 s: RSS (VmRSS), OS threads, open file descriptors and the ledger's
  SQLAlchemy pool (idle + checked out, filled to its steady size before the clock starts); from
  the parent: PostgreSQL backends with application_name `prefect-gpu-budget` in the soak
  database, and the Prefect server's RSS; each minute, the host's CPU steal and the rows
  PostgreSQL read per committed transaction in each database (`host_and_db`), to tell a gate
  whose queries do more work over time from a host that slows under it.
- start and end windows: the first and last `--edge` fraction (default 10%) of the run after a
  warm-up (10% of the run, 5-60 s). A window's p95 is the median of the p95s of up to 5
  consecutive groups of at least 20 samples, so one noisy burst moves the figure little.
  Memory: median RSS in the end window minus that in the start window, per agent. Connections,
  descriptors and threads: the end window's median must not pass the first half's maximum.
- at the end: nothing left queued, admitted or running; every count the agents kept matches the
  ledger; settled spend per (scope, period) equals the sum of the settled jobs' costs; no job
  cost more than its reservation; hourly caps never exceeded over the whole run (from the
  ledger's timestamps); no slot left taken in any Prefect limit.

Exit status 0 when every target is met, 1 when one is missed (`missed` in the JSON names them).

PostgreSQL is expected at 127.0.0.1:5432. The ledger is a database of the run's own
(`gate_soak_<id>`, dropped at the end) unless `--url` or GATE_SOAK_PG_URL names one (created if
missing, its gate tables dropped and recreated, never dropped itself). The Prefect server is a
real `prefect server start --no-services` on a PostgreSQL database of its own on the same server
(`gate_soak_prefect_<id>`, dropped at the end; not SQLite: under this load a SQLite server
answers "database is locked" with 503s, and Prefect's client backs off 2 s or more, which would
be measured as gate latency). Without services it never repossesses expired leases, so a leaked
slot stays visible at the end.

Usage: python -m benchmarks.soak --minutes 30 [--agents 8] [--url URL] [--json] [--keep DIR]
Progress goes to stderr; the table (or, with --json, one JSON object) to stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/soak.py` (and so are its agents)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import argparse
import faulthandler
import itertools
import json
import math
import random
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import sqlalchemy as sa

from benchmarks.harness import PrefectServer, postgres_database, serving
from benchmarks.harness.postgres import ensure_database, server_of
from benchmarks.harness.report import logger, table
from benchmarks.harness.servers import read_line
from benchmarks.harness.stats import percentile
from prefect_gpu_budget.admission.audit import audit, slot_mismatches
from prefect_gpu_budget.admission.gate import Admission, AdmissionRefused, Gate, GateEvents
from prefect_gpu_budget.admission.ledger import Ledger, metadata, normalise_url
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.policy import BudgetRule, Decision
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import (
    LaunchResult,
    Probe,
    StartHook,
    StartRecord,
    SubmitHook,
    ignore_submission,
)
from prefect_gpu_budget.pricing.catalog import Catalog, set_local_price

PG_URL = os.environ.get("GATE_SOAK_PG_URL")
"""The ledger's database; None: one of the run's own."""
ORG = "soak"
INSTANCE = "local:soak"
PRICE_USD = "3.60"
RATE_CENTS = 360
AGENTS_PER_TEAM = 4
IN_FLIGHT = 3
SESSION_JOBS = 2
MAX_RUNTIME_S, KILL_GRACE_S = 30, 1
RUN_S = (0.2, 2.0)
THINK_S = (0.0, 1.5)
KINDS = {"run": 55, "impatient": 15, "interrupt": 20, "withdraw": 10}
BUDGET_MAX_WAIT_S = 120.0
"""A job with no max_wait of its own times out after this: it counts as starved."""
DRAIN_S = 30.0
"""A job still waiting this long after the run ended is cancelled and counted as stuck."""
SILENT_S = 30.0
"""An agent whose samples stop this long has hung: its threads' stacks go to its log."""
DUMP_SIGNAL = signal.SIGUSR2
TARGETS = {"latency_p95_ratio": 1.2, "rss_growth_mib": 8.0}
GROUPS, MIN_GROUP = 5, 20
STREAMS = {
    "admit": "admit, not waiting",
    "wake": "admit after a wait",
    "decide": "ledger decision",
    "acquire": "Prefect acquire",
}
APP_NAME = "prefect-gpu-budget"
MESSAGES = 10
"""The audit's findings reported one by one; more are counted."""
FAILURES = ("errors", "rejected", "starved", "stuck")
"""Counts that must stay 0: a job the gate failed, refused outright, or never decided."""


log = logger("soak")


# -- agent: one process, one session scope ---------------------------------------------------


class Cancelled(BaseException):
    """A cancellation that arrives while a job waits, like Ctrl-C or a task time-out."""


class Stuck(BaseException):
    """Raised in a job still waiting `DRAIN_S` after the run ended, so the agent can stop."""


class Recorder:
    """Samples and counters of one agent, written as one JSON line per sampling interval.

    Only the current interval's samples are held, so the recorder's own memory stays flat.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "w", buffering=1)  # noqa: SIM115 (closed in close())
        self._lock = threading.Lock()
        self._latency: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []

    def latency(self, stream: str, seconds: float) -> None:
        with self._lock:
            self._latency[stream].append((round(time.time(), 3), round(seconds * 1000, 3)))

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def error(self, exc: BaseException) -> None:
        with self._lock:
            self.counts["errors"] += 1
            if len(self.errors) < 5:
                self.errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")

    def flush(
        self, sample: dict[str, Any], final: bool = False, unreleased: list[str] | None = None
    ) -> None:
        with self._lock:
            latency, self._latency = self._latency, defaultdict(list)
            line = {**sample, "latency": latency, "counts": dict(self.counts), "final": final}
            if final:
                line["errors"] = self.errors
                line["unreleased"] = unreleased or []
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


class TimedLedger(Ledger):
    """The ledger, timing its decisions (recording the request, and re-deciding a waiter)."""

    recorder: Recorder
    admitted_at = 0.0
    """perf_counter() when the last `try_admit` that admitted a waiting job began."""

    def request(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = super().request(*args, **kwargs)
        self.recorder.latency("decide", time.perf_counter() - began)
        return out

    def try_admit(self, *args: Any, **kwargs: Any) -> Decision:
        began = time.perf_counter()
        out = super().try_admit(*args, **kwargs)
        self.recorder.latency("decide", time.perf_counter() - began)
        if out.verdict == "admit":
            self.admitted_at = began
        return out


class TimedLimits(RateLimits):
    """The Prefect limits, timing each acquisition (granted or refused) and keeping the leases
    granted but not yet released, with the thread that took each: a slot left taken at the end
    is then either a lease the gate never released (named here) or one it never saw."""

    recorder: Recorder

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, str] = {}

    def acquire(self, *args: Any, **kwargs: Any) -> str | None:
        began = time.perf_counter()
        out = super().acquire(*args, **kwargs)
        self.recorder.latency("acquire", time.perf_counter() - began)
        if out is not None:
            self.held[out] = f"{threading.current_thread().name} at {time.time():.3f}"
        return out

    def release(self, lease_id: str) -> None:
        super().release(lease_id)
        self.held.pop(lease_id, None)


def process_sample() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {
        "rss_kib": int(re.search(r"VmRSS:\s+(\d+)", status)[1]),
        "threads": int(re.search(r"Threads:\s+(\d+)", status)[1]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


@dataclass(frozen=True)
class Sleeper:
    """A launcher whose job sleeps in this process until `seconds` after it starts, then
    ends `outcome`: what the soak runs through the users' path (`admission/lifecycle.py`, as
    `run_gpu_job` does), without a process per job. Its start is told as a real launcher's is
    (`StartRecord`, within the job's kill grace), and a stop ends it early."""

    seconds: float
    outcome: str = "completed"
    stopped: threading.Event = field(default_factory=threading.Event, compare=False)
    kind: ClassVar[str] = "local"

    def preflight(self, job: GpuJob, quote: Any) -> None:
        """Nothing to check."""

    def run(
        self,
        job: GpuJob,
        quote: Any,
        *,
        on_start: StartHook,
        log: Callable[[str], None],
        env: dict[str, str] | None = None,
        on_submit: SubmitHook = ignore_submission,
    ) -> LaunchResult:
        started = time.time()
        external_id = f"soak:{uuid.uuid4().hex[:12]}"
        record = StartRecord(on_start, started, external_id, min(job.kill_grace, job.max_runtime))
        outcome, detail, due = self.outcome, "", started + min(self.seconds, job.max_runtime)
        while not self.stopped.wait(max(0.0, min(0.05, due - time.time()))):
            if time.time() >= due:
                break
            try:
                record.check()
            except Exception as exc:  # as the local launcher: stopped, reported
                outcome, detail = "cancelled", str(exc)
                break
        ended = time.time()
        record.finish()  # the start is on record before the job settles
        return LaunchResult(outcome, started, ended, detail=detail, external_id=external_id)

    def probe(self, external_id: str) -> Probe:
        return Probe("unknown")

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        self.stopped.set()


class Runner:
    """Runs each admitted job in a thread of its own through the job's life
    (`lifecycle.run_admitted`: start, run, settle once), while the agent submits more."""

    def __init__(self, gate: Gate, recorder: Recorder) -> None:
        self.gate, self.recorder = gate, recorder
        self._running: set[threading.Thread] = set()
        self._seq = itertools.count()
        self._cond = threading.Condition()

    def add(self, seconds: float, admission: Admission) -> None:
        thread = threading.Thread(
            target=self._run,
            args=(seconds, admission),
            name=f"soak-job-{next(self._seq)}",
            daemon=True,
        )
        with self._cond:
            self._running.add(thread)
        thread.start()

    def _run(self, seconds: float, admission: Admission) -> None:
        try:
            ended = run_admitted(self.gate, admission, Sleeper(seconds))
            if ended.result.outcome == "completed":
                self.recorder.count("completed")
            else:
                raise RuntimeError(f"job ended {ended.result.outcome}: {ended.result.detail}")
        except Exception as exc:
            self.recorder.error(exc)
        finally:
            with self._cond:
                self._running.discard(threading.current_thread())
                self._cond.notify_all()

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def wait_below(self, count: int, deadline: float) -> None:
        with self._cond:
            self._cond.wait_for(
                lambda: len(self._running) < count, max(0.0, deadline - time.time())
            )

    def close(self) -> None:
        """Let the jobs still running end at their due time."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)


@dataclass(frozen=True)
class AgentConfig:
    index: int
    scope: str
    ledger_url: str
    prices: str
    out: str
    sample_s: float
    seed: int
    mix: dict[str, int]


class Agent:
    """Submits jobs in the main thread (where the cancellation signal lands)."""

    def __init__(self, cfg: AgentConfig, ledger: TimedLedger, limits: TimedLimits) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.recorder = Recorder(cfg.out)
        ledger.recorder = limits.recorder = self.recorder
        self.ledger = ledger
        events = GateEvents(queued=self._queued, waiting=self._waiting, admitted=self._admitted)
        self.gate = Gate(ledger, limits, catalog=Catalog.load(Path(cfg.prices)), events=events)
        self.runner = Runner(self.gate, self.recorder)
        self._waited = False
        self._cancel_after: float | None = None
        self._armed = False
        self._in_admit = False
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.signal(signal.SIGUSR1, self._on_stop)

    # gate events (main thread, inside admit)
    def _queued(self, job_id: str, decision: Decision, rules: list[BudgetRule]) -> None:
        self._waited = True
        self._waiting(job_id, decision)
        if self._cancel_after is not None:
            self._armed = True
            signal.setitimer(signal.ITIMER_REAL, self._cancel_after)

    def _waiting(self, job_id: str, decision: Decision) -> None:
        if decision.limit == "prefect_limit":
            self.recorder.count("prefect_limit_waits")

    def _admitted(self, admission: Admission) -> None:
        self._in_admit = False
        self._disarm()

    def _disarm(self) -> None:
        self._armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self._armed:
            self._armed = False
            raise Cancelled

    def _on_stop(self, signum: int, frame: Any) -> None:
        if self._in_admit:
            self._in_admit = False
            raise Stuck

    def sample(self) -> dict[str, Any]:
        pool = self.ledger.engine.pool
        return {
            "t": time.time(),
            **process_sample(),
            "pool_idle": pool.checkedin(),
            "pool_out": pool.checkedout(),
        }

    def warm_up(self) -> None:
        """One job through the whole path before the clock starts (imports, pools, limits),
        and the ledger's pool filled to its steady size, so that connections the pool opens
        lazily later are not taken for a leak."""
        pool = self.ledger.engine.pool
        held = [self.ledger.engine.connect() for _ in range(pool.size())]
        for conn in held:
            conn.close()
        admission = self.gate.admit(self.job("warm-up", None), self.cfg.scope)
        run_admitted(self.gate, admission, Sleeper(0.0, outcome="warm-up"))

    def job(self, kind: str, max_wait: float | None) -> GpuJob:
        return GpuJob(
            instance_type=INSTANCE,
            max_runtime=MAX_RUNTIME_S,
            kill_grace=KILL_GRACE_S,
            max_wait=max_wait,
            name=f"soak-{kind}",
        )

    def run(self, start: float, end: float) -> None:
        stop = threading.Event()

        def monitor() -> None:
            while not stop.wait(self.cfg.sample_s):
                self.recorder.flush(self.sample())

        time.sleep(max(0.0, start - time.time()))
        self.recorder.flush(self.sample())
        watcher = threading.Thread(target=monitor, name="soak-monitor", daemon=True)
        watcher.start()
        stopper = threading.Timer(
            end + DRAIN_S - time.time(), os.kill, (os.getpid(), signal.SIGUSR1)
        )
        stopper.start()
        while time.time() < end:
            if self.runner.running() >= IN_FLIGHT:
                self.runner.wait_below(IN_FLIGHT, end)
                continue
            try:
                self.submit()
            except (Exception, Cancelled) as exc:  # count and go on: a soak reports errors
                self.recorder.error(exc)
                time.sleep(0.5)
            time.sleep(self.rng.uniform(*THINK_S))
        stopper.cancel()
        self.runner.close()
        stop.set()
        watcher.join()
        held = self.gate.limits.held if isinstance(self.gate.limits, TimedLimits) else {}
        self.recorder.flush(
            self.sample(), final=True, unreleased=[f"{k} ({v})" for k, v in held.items()]
        )
        self.recorder.close()

    def submit(self) -> None:
        mix = self.cfg.mix
        kind = self.rng.choices(list(mix), weights=list(mix.values()))[0]
        max_wait = round(self.rng.uniform(0.1, 0.6), 2) if kind == "impatient" else None
        self._cancel_after = self.rng.uniform(0.05, 0.6) if kind == "interrupt" else None
        self._waited = False
        self.recorder.count("submitted")
        began = time.perf_counter()
        self._in_admit = True
        try:
            admission = self.gate.admit(self.job(kind, max_wait), self.cfg.scope)
        except Cancelled:
            self.recorder.count("interrupted")
            return
        except Stuck:
            self.recorder.count("stuck")
            return
        except AdmissionRefused as refused:
            if refused.state_name != "AdmissionTimeout":
                self.recorder.count("rejected")
            else:
                self.recorder.count("timed_out" if kind == "impatient" else "starved")
            return
        finally:
            self._in_admit = False
            self._disarm()
        elapsed = time.perf_counter() - began
        self.recorder.count("admitted")
        if self._waited:
            self.recorder.count("admitted_after_wait")
            self.recorder.latency("wake", time.perf_counter() - self.ledger.admitted_at)
        else:
            self.recorder.latency("admit", elapsed)
        if kind == "withdraw":
            self.gate.settle(admission, ended_at=time.time(), outcome="withdrawn")
            self.recorder.count("withdrawn")
            return
        self.runner.add(self.rng.uniform(*RUN_S), admission)


def agent_main(raw: str) -> None:
    cfg = AgentConfig(**json.loads(raw))
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    from prefect.client.orchestration import get_client

    ledger = TimedLedger(cfg.ledger_url, create=False)
    with get_client(sync_client=True) as client:
        agent = Agent(cfg, ledger, TimedLimits(client))
        agent.warm_up()
        print("ready", flush=True)
        start, end = map(float, sys.stdin.readline().split())
        agent.run(start, end)
    ledger.dispose()


# -- parent: setup, the run, the checks --------------------------------------------------------


@dataclass(frozen=True)
class Config:
    minutes: float
    agents: int
    url: str
    warmup_s: float
    edge: float
    sample_s: float
    seed: int
    mix: dict[str, int] = field(default_factory=lambda: dict(KINDS))
    keep: str | None = None

    @property
    def run_s(self) -> float:
        return self.minutes * 60

    def scopes(self) -> list[str]:
        return [f"{ORG}/team-{i // AGENTS_PER_TEAM}/agent-{i}" for i in range(self.agents)]


def budgets(cfg: Config) -> list[BudgetRule]:
    """Hourly caps that make jobs wait at every level; period budgets that never bind."""
    teams = Counter(s.rsplit("/", 1)[0] for s in cfg.scopes())
    team_jobs = {team: math.ceil(1.5 * size) for team, size in teams.items()}
    org_jobs = max(2, math.floor(0.9 * sum(team_jobs.values())))
    reservation = RATE_CENTS * 10_000 * (MAX_RUNTIME_S + KILL_GRACE_S) / 3600
    hours = cfg.run_s / 3600 + 0.5

    def budget(jobs: int) -> int:  # 5x the most these jobs can reserve and spend in the run
        return int(5 * jobs * (reservation + RATE_CENTS * 10_000 * hours))

    common = {"max_wait_s": BUDGET_MAX_WAIT_S}
    rules = [BudgetRule(ORG, org_jobs * RATE_CENTS, budget(org_jobs), "month", **common)]
    rules += [
        BudgetRule(team, jobs * RATE_CENTS, budget(jobs), "week", **common)
        for team, jobs in team_jobs.items()
    ]
    rules += [
        BudgetRule(scope, SESSION_JOBS * RATE_CENTS, budget(SESSION_JOBS), "day", **common)
        for scope in cfg.scopes()
    ]
    return rules


def fresh_ledger(cfg: Config) -> None:
    ledger = Ledger(cfg.url, create=False)
    try:
        metadata.drop_all(ledger.engine)
        ledger.create()
        for rule in budgets(cfg):
            ledger.set_budget(rule)
    finally:
        ledger.dispose()  # the parent holds no gate connection during the run


@contextmanager
def ledger_database(url: str | None) -> Iterator[str]:
    """The ledger's database: `url` (created if missing, never dropped), else one of the run's
    own, dropped at the end."""
    if url:
        ensure_database(url)
        yield url
        return
    with postgres_database("gate_soak") as own:
        yield own


@contextmanager
def work_dir(keep: str | None) -> Iterator[Path]:
    """Where the agents write their samples: `keep`, left in place, or a temporary folder."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix="gate-soak-") as name:
        yield Path(name)


@contextmanager
def prefect_server(prefect_url: str, tmp: Path) -> Iterator[PrefectServer]:
    """`prefect server start --no-services` on the PostgreSQL database `prefect_url`, served to
    this process.

    Without services the lease repossessor does not run, so a leaked slot stays taken and the
    check at the end sees it; a production server would hand it back about 75 s later.
    """
    db = "postgresql+asyncpg://" + prefect_url.split("://", 1)[1]
    server = PrefectServer(
        tmp / "server-home", services=False, durable_leases=False, database_url=db
    )
    server.env["PREFECT_SERVER_LOGGING_LEVEL"] = "WARNING"
    with server, serving(server.api):
        yield server


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024


class Agents:
    """The agent processes: spawned, readied, started together, awaited."""

    def __init__(self, cfg: Config, api_url: str, prices: Path, tmp: Path) -> None:
        env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(tmp / "home")}
        self.outs = [tmp / f"agent-{i}.jsonl" for i in range(cfg.agents)]
        self.logs = [tmp / f"agent-{i}.log" for i in range(cfg.agents)]
        self.procs = []
        self.dumped: set[int] = set()
        for i, scope in enumerate(cfg.scopes()):
            acfg = AgentConfig(
                i,
                scope,
                cfg.url,
                str(prices),
                str(self.outs[i]),
                cfg.sample_s,
                cfg.seed + i,
                cfg.mix,
            )
            with self.logs[i].open("w") as err:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--agent", json.dumps(asdict(acfg))],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        env=env,
                    )
                )

    def tail(self, i: int) -> str:
        lines = self.logs[i].read_text().strip().splitlines()
        return " | ".join(lines[-3:]) or f"exit code {self.procs[i].poll()}"

    def ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, proc in enumerate(self.procs):
            if read_line(proc, deadline).strip() != "ready":
                raise RuntimeError(f"agent {i} not ready: {self.tail(i)}")

    def start(self, start: float, end: float) -> None:
        for proc in self.procs:
            proc.stdin.write(f"{start} {end}\n")
            proc.stdin.flush()

    def dead(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]

    def dump_silent(self, now: float) -> None:
        """Write the stacks of every agent whose samples stopped `SILENT_S` ago into its log,
        once, so that a hang can be read after the run."""
        for i, proc in enumerate(self.procs):
            try:
                silent = now - self.outs[i].stat().st_mtime
            except OSError:
                continue
            if silent > SILENT_S and i not in self.dumped and proc.poll() is None:
                self.dumped.add(i)
                log(f"agent {i} silent for {silent:.0f} s; its stacks go to {self.logs[i].name}")
                proc.send_signal(DUMP_SIGNAL)

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(DUMP_SIGNAL)
                time.sleep(1)
                proc.kill()
                proc.wait()
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def gate_backends(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = :app"
                ),
                {"app": APP_NAME},
            ).scalar_one()
        )


def host_cpu() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot, from /proc/stat; (0, 0) where unreadable."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[7], sum(fields)


def db_work(engine: sa.Engine, url: str, prefect_url: str) -> dict[str, list[int]]:
    """Per database (the ledger's and the Prefect server's): cumulative committed transactions
    and rows read (returned + fetched), from `pg_stat_database`."""
    names = [u.rsplit("/", 1)[1] for u in (url, prefect_url)]
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT datname, xact_commit, tup_returned + tup_fetched FROM pg_stat_database "
                "WHERE datname = ANY(:names)"
            ),
            {"names": names},
        )
        found = {name: [int(x), int(r)] for name, x, r in rows}
    return {"ledger": found.get(names[0], [0, 0]), "prefect": found.get(names[1], [0, 0])}


def run(cfg: Config) -> dict[str, Any]:
    wall = time.perf_counter()
    fresh_ledger(cfg)
    out: dict[str, Any] = {
        "config": {**asdict(cfg), "url": cfg.url.split("@")[-1]},
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    monitor = sa.create_engine(
        normalise_url(cfg.url), pool_size=1, connect_args={"application_name": "gate-soak-monitor"}
    )
    prefect_db = postgres_database("gate_soak_prefect", server_of(cfg.url))
    with work_dir(cfg.keep) as tmp, prefect_db as prefect_url:
        prices = set_local_price("soak", PRICE_USD, gpus=1, path=tmp / "prices.csv")
        with prefect_server(prefect_url, tmp) as server:
            api_url = server.api
            create_limits(cfg)
            log(f"Prefect server at {api_url}; spawning {cfg.agents} agents")
            agents = Agents(cfg, api_url, prices, tmp)
            try:
                agents.ready(timeout_s=300)
                start = time.time() + 0.5
                end = start + cfg.run_s
                agents.start(start, end)
                until = time.strftime("%H:%M:%S", time.localtime(end))
                log(f"running {cfg.minutes:g} min, until {until}")
                parent = watch(cfg, prefect_url, agents, monitor, server.pid, end)
                out["vacuums"] = sum(1 for s in parent if s.get("vacuum"))
                codes = agents.wait(timeout_s=DRAIN_S + 90)
            finally:
                agents.kill()
            out["agent_exit_codes"] = codes
            out["agent_logs"] = {i: agents.tail(i) for i, c in enumerate(codes) if c != 0}
            records = [load(path) for path in agents.outs]
            out["ledger"] = check_ledger(cfg, records, start)
        out["load_avg_1m_at_end"] = os.getloadavg()[0]
    monitor.dispose()
    out.update(analyse(cfg, records, parent, start, end))
    out["targets"], out["missed"] = targets(out)
    out["wall_s"] = time.perf_counter() - wall
    return out


def watch(
    cfg: Config,
    prefect_url: str,
    agents: Agents,
    monitor: sa.Engine,
    server: int | None,
    end: float,
) -> list[dict[str, Any]]:
    """Sample the gate's PostgreSQL backends and the server's RSS until the run ends.

    A server with autovacuum off (some test machines) lets dead rows pile up in the ledger's
    tables, and every decision slows with them (seen: 45,000 dead rows in 30 minutes, the
    decision's median 6.7 -> 22 ms); production servers vacuum by default, so here the parent
    then vacuums the gate's tables and the Prefect server's database once a minute, as
    autovacuum would (`vacuums` in the JSON)."""
    samples: list[dict[str, Any]] = []
    next_log = time.time() + 60
    with monitor.connect() as conn:
        vacuum = conn.execute(sa.text("SHOW autovacuum")).scalar_one() == "off"
    if vacuum:
        log(
            "autovacuum is off on this server: vacuuming the gate's and Prefect's tables each minute"
        )
    while time.time() < end:
        samples.append(
            {"t": time.time(), "pg": gate_backends(monitor), "server_mib": rss_mib(server)}
        )
        if len(samples) == 1:
            samples[0].update(cpu=host_cpu(), db=db_work(monitor, cfg.url, prefect_url))
        dead = agents.dead()
        if dead:
            raise RuntimeError(f"agent {dead[0]} died: {agents.tail(dead[0])}")
        agents.dump_silent(time.time())
        if time.time() > next_log:
            log(f"{(end - time.time()) / 60:.1f} min left")
            next_log += 60
            samples[-1].update(cpu=host_cpu(), db=db_work(monitor, cfg.url, prefect_url))
            if vacuum:
                vacuum_tables(cfg.url, prefect_url)
                samples[-1]["vacuum"] = True
        time.sleep(min(cfg.sample_s, max(0.0, end - time.time())))
    return samples


def vacuum_tables(url: str, prefect_url: str) -> None:
    """`VACUUM (ANALYZE)` the gate's tables in the ledger's database, and the whole of the Prefect
    server's database (its concurrency-limit rows change on every acquire and release)."""
    for db, tables in ((url, ", ".join(metadata.tables)), (prefect_url, "")):
        engine = sa.create_engine(
            normalise_url(db), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
        )
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(f"VACUUM (ANALYZE) {tables}"))
        finally:
            engine.dispose()


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- checks ------------------------------------------------------------------------------------


def check_ledger(cfg: Config, records: list[list[dict[str, Any]]], start: float) -> dict[str, Any]:
    """What the ledger holds after the run: the audit's checks (`admission/audit.py`: no
    orphan, no charge doubled or lost, promise 1 at every admission instant, Prefect's slots
    against the ledger's running rate), and the counts the agents kept against the ledger's."""
    ledger = Ledger(cfg.url, create=False)
    try:
        rows = ledger.jobs(ORG)
        status = ledger.status(ORG)
        found = audit(ledger, scope=ORG)
    finally:
        ledger.dispose()
    problems: list[str] = []
    by_state = Counter(r["state"] for r in rows)
    outcomes = Counter(r["outcome"] for r in rows if r["state"] == "settled")
    left = {s: by_state[s] for s in ("queued", "admitted", "running") if by_state[s]}
    if left:
        problems.append(f"left unsettled: {left}")
    counts: Counter[str] = Counter()
    for lines in records:
        finals = [line for line in lines if line["final"]]
        counts.update(finals[-1]["counts"] if finals else {})
    expected = {
        "rows": (len(rows), counts["submitted"] + cfg.agents),
        "completed": (outcomes["completed"], counts["completed"]),
        "withdrawn": (outcomes["withdrawn"], counts["withdrawn"]),
        "timed out": (by_state["timed_out"], counts["timed_out"] + counts["starved"]),
        "cancelled while waiting": (
            by_state["cancelled"] + outcomes["cancelled"],
            counts["interrupted"] + counts["stuck"],
        ),
        "rejected": (by_state["rejected"], counts["rejected"]),
    }
    problems += [
        f"{what}: ledger {got}, agents {want}"
        for what, (got, want) in expected.items()
        if got != want
    ]
    over = [r["id"][:8] for r in rows if (r["actual_micro"] or 0) > r["reserved_micro"] > 0]
    if over:
        problems.append(f"{len(over)} jobs cost more than their reservation: {over[:3]}")
    for s in status:
        if s["reserved_micro"] or s["running"] or s["queued"]:
            problems.append(
                f"{s['scope']}: reserved {s['reserved_micro']}, running {s['running']}, "
                f"queued {s['queued']} after the run"
            )
    problems += found.messages[:MESSAGES]
    if len(found.messages) > MESSAGES:
        problems.append(f"... and {len(found.messages) - MESSAGES} more findings of the audit")
    return {
        "rows": len(rows),
        "rows_since_start": sum(1 for r in rows if r["requested_at"] >= start),
        "by_state": dict(by_state),
        "settled_outcomes": dict(outcomes),
        "spend_usd": sum(r["actual_micro"] or 0 for r in rows) / 1e6,
        "cancelled_after_admission": {  # where a cancellation can strand a Prefect lease
            "jobs": outcomes["cancelled"],
            "lease_recorded": sum(
                1 for r in rows if r["outcome"] == "cancelled" and r["lease_id"] is not None
            ),
        },
        "audit": {
            "orphans_left": found.orphans_left,
            "double_charges": found.double_charges,
            "missing_charges": found.missing_charges,
            "invariant_violations": found.invariant_violations,
        },
        "problems": problems,
        "leaked_slots": leaked_slots(cfg, rows),
    }


def create_limits(cfg: Config) -> None:
    """Create the Prefect limits once, as a deployment would, before the agents start."""
    limits = RateLimits()
    try:
        limits.ensure(
            (rule.scope, rule.hourly_cap_cents)
            for rule in budgets(cfg)
            if rule.hourly_cap_cents is not None
        )
    finally:
        limits.close()


def leaked_slots(cfg: Config, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per capped scope, the Prefect slots the ledger's running jobs do not explain (the audit's
    `slot_mismatches`); once everything settled, every slot still taken (none expected)."""
    limits = RateLimits()
    try:
        return dict(slot_mismatches(limits, rows, budgets(cfg)).by_scope)
    finally:
        limits.close()


# -- analysis ----------------------------------------------------------------------------------


def window_latency(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """p95 of a window: the median of the p95s of up to 5 consecutive groups of >= 20 samples."""
    values = [ms for _, ms in sorted(samples)]
    groups = min(GROUPS, len(values) // MIN_GROUP)
    if groups == 0:
        return {"n": len(values), "groups": 0, "p95_ms": None, "p50_ms": None}
    size = len(values) / groups
    chunks = [values[round(i * size) : round((i + 1) * size)] for i in range(groups)]
    return {
        "n": len(values),
        "groups": groups,
        "p95_ms": statistics.median(percentile(c, 95) for c in chunks),
        "p50_ms": percentile(values, 50),
        "pooled_p95_ms": percentile(values, 95),
        "max_ms": max(values),
    }


def per_minute_p95(samples: list[tuple[float, float]], t0: float, end: float) -> dict[str, Any]:
    """p95 of each whole minute after warm-up, and their least-squares trend over the run as a
    percentage of their mean: a leak climbs steadily, while a one-off step or a noisy minute
    (another tenant on the host) moves the start/end ratio but hardly the trend."""
    by_minute: dict[int, list[float]] = defaultdict(list)
    for t, ms in samples:
        if t0 <= t < end:
            by_minute[int((t - t0) // 60)].append(ms)
    whole = int((end - t0) // 60)
    points = [(60.0 * m, percentile(by_minute[m], 95)) for m in range(whole) if by_minute[m]]
    trend = trend_pct(points, whole - 1)
    return {"per_minute_p95_ms": [round(v, 1) for _, v in points], "trend_pct": trend}


def host_and_db(parent: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Each minute after warm-up: the host's CPU steal (%), and rows PostgreSQL read per
    committed transaction in the ledger's and the Prefect server's databases, with each one's
    trend (`trend_pct`). Latency that climbs while rows per transaction stay flat is not
    the queries doing more work; climbing with the steal, it is the host."""
    marks = [s for s in parent if "cpu" in s]
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a, b in itertools.pairwise(marks):
        if b["t"] <= t0:
            continue
        total = b["cpu"][1] - a["cpu"][1]
        if total > 0:
            series["steal_pct"].append((b["t"], 100 * (b["cpu"][0] - a["cpu"][0]) / total))
        for db in ("ledger", "prefect"):
            xacts = b["db"][db][0] - a["db"][db][0]
            if xacts > 0:
                series[f"{db}_rows_per_xact"].append(
                    (b["t"], (b["db"][db][1] - a["db"][db][1]) / xacts)
                )
    out = {}
    for name, points in series.items():
        trend = trend_pct(points, (points[-1][0] - points[0][0]) / 60)
        out[name] = {"per_minute": [round(v, 2) for _, v in points], "trend_pct": trend}
    return out


def within(t: float, window: tuple[float, float]) -> bool:
    return window[0] <= t < window[1]


def median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t seconds, value) in value per minute."""
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def trend_pct(points: list[tuple[float, float]], minutes: float) -> float | None:
    """The least-squares change over `minutes`, as a percentage of the points' mean."""
    slope = slope_per_min(points)
    if slope is None:
        return None
    mean = statistics.fmean(v for _, v in points)
    return 100 * slope * minutes / mean if mean else None


def analyse(
    cfg: Config,
    records: list[list[dict[str, Any]]],
    parent: list[dict[str, Any]],
    start: float,
    end: float,
) -> dict[str, Any]:
    t0 = start + cfg.warmup_s
    edge = (end - t0) * cfg.edge
    first, last, steady = (t0, t0 + edge), (end - edge, end + 1e-3), (t0, end + 1e-3)
    early = (t0, (t0 + end) / 2)  # connections may open lazily; they must not grow after
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    counts: Counter[str] = Counter()
    errors: list[str] = []
    unreleased: list[str] = []
    agents = []
    for index, lines in enumerate(records):
        for line in lines:
            for stream, pairs in line["latency"].items():
                streams[stream] += [tuple(p) for p in pairs]
        finals = [line for line in lines if line["final"]]
        if finals:
            counts.update(finals[-1]["counts"])
            errors += [f"agent {index}: {e}" for e in finals[-1]["errors"]]
            unreleased += [f"agent {index}: {u}" for u in finals[-1].get("unreleased", [])]
        agents.append(agent_figures(index, lines, (first, last, steady, early), finals))
    latency = {}
    for stream in STREAMS:
        a = window_latency([p for p in streams[stream] if within(p[0], first)])
        b = window_latency([p for p in streams[stream] if within(p[0], last)])
        ratio = b["p95_ms"] / a["p95_ms"] if a["p95_ms"] and b["p95_ms"] else None
        minutes = per_minute_p95(streams[stream], t0, end)
        latency[stream] = {"start": a, "end": b, "ratio": ratio, **minutes}
    pg = [(s["t"], s["pg"]) for s in parent]
    server = [(s["t"], s["server_mib"]) for s in parent if s["server_mib"] is not None]

    def edges(points: list[tuple[float, float]]) -> dict[str, float | None]:
        return {
            "start": median_of([v for t, v in points if within(t, first)]),
            "end": median_of([v for t, v in points if within(t, last)]),
            "early_max": max((v for t, v in points if within(t, early)), default=None),
            "max": max((v for t, v in points if within(t, steady)), default=None),
        }

    admitted = counts["admitted"]
    return {
        "windows": {
            "warmup_s": cfg.warmup_s,
            "start": [first[0] - start, first[1] - start],
            "end": [last[0] - start, last[1] - start],
        },
        "totals": {
            "submitted": counts["submitted"],
            "admitted": admitted,
            "admitted_without_wait": admitted - counts["admitted_after_wait"],
            "completed": counts["completed"],
            "withdrawn": counts["withdrawn"],
            "interrupted": counts["interrupted"],
            "timed_out": counts["timed_out"],
            "starved": counts["starved"],
            "stuck": counts["stuck"],
            "rejected": counts["rejected"],
            "prefect_limit_waits": counts["prefect_limit_waits"],
            "errors": counts["errors"],
            "admissions_per_s": admitted / cfg.run_s,
        },
        "leases_unreleased": unreleased,
        "throughput": {
            "start_per_s": sum(1 for t, _ in streams["decide"] if within(t, first)) / edge,
            "end_per_s": sum(1 for t, _ in streams["decide"] if within(t, last)) / edge,
        },
        "latency": latency,
        "agents": agents,
        "pg_backends": edges(pg),
        "prefect_server_mib": edges(server),
        "host_and_db": host_and_db(parent, t0),
        "flat": flat(agents, edges(pg)),
        "errors": errors,
    }


def flat(agents: list[dict[str, Any]], pg: dict[str, float | None]) -> dict[str, Any]:
    """End-window median against first-half maximum: PostgreSQL backends of the gate, and the
    sums over agents of pooled connections, descriptors and threads. Summed, with a slack of
    fewer than one per agent (`slack`): a few agents opening one more keep-alive socket late in
    a short run is not a leak, while a leak grows in every agent."""
    out = {"pg_backends": {"end": pg["end"], "early_max": pg["early_max"], "slack": 0}}
    for key in ("pool", "fds", "threads"):
        ends = [a[key]["end"] for a in agents]
        highs = [a[key]["early_max"] for a in agents]
        out[key] = {
            "end": None if None in ends else sum(ends),
            "early_max": None if None in highs else sum(highs),
            "slack": max(0, len(agents) - 1),
        }
    for figure in out.values():
        figure["ok"] = (
            None not in figure.values() and figure["end"] <= figure["early_max"] + figure["slack"]
        )
    return out


def agent_figures(
    index: int,
    lines: list[dict[str, Any]],
    windows: tuple[tuple[float, float], ...],
    finals: list[dict[str, Any]],
) -> dict[str, Any]:
    first, last, steady, early = windows
    samples = [line for line in lines if not line["final"]]

    def at(key: str, window: tuple[float, float]) -> float | None:
        return median_of([s[key] for s in samples if within(s["t"], window)])

    def most(key: str, window: tuple[float, float]) -> float | None:
        return max((s[key] for s in samples if within(s["t"], window)), default=None)

    for s in samples:
        s["pool"] = s["pool_idle"] + s["pool_out"]
    rss_start, rss_end = at("rss_kib", first), at("rss_kib", last)
    final = finals[-1] if finals else None
    return {
        "index": index,
        "samples": len(samples),
        "rss_start_mib": None if rss_start is None else rss_start / 1024,
        "rss_end_mib": None if rss_end is None else rss_end / 1024,
        "rss_max_mib": (most("rss_kib", steady) or 0) / 1024,
        "rss_growth_mib": None
        if rss_start is None or rss_end is None
        else (rss_end - rss_start) / 1024,
        "rss_slope_kib_per_min": slope_per_min(
            [(s["t"], s["rss_kib"]) for s in samples if within(s["t"], steady)]
        ),
        "threads": {
            "start": at("threads", first),
            "end": at("threads", last),
            "early_max": most("threads", early),
        },
        "fds": {"start": at("fds", first), "end": at("fds", last), "early_max": most("fds", early)},
        "pool": {
            "start": at("pool", first),
            "end": at("pool", last),
            "early_max": most("pool", early),
        },
        "final": None
        if final is None
        else {k: final[k] for k in ("rss_kib", "threads", "fds", "pool_idle", "pool_out")},
    }


def targets(out: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    agents = out["agents"]
    growth = [a["rss_growth_mib"] for a in agents]
    ratio = out["latency"]["admit"]["ratio"]

    bad = sum(out["totals"][k] for k in FAILURES)
    found = {
        "latency_p95_ratio": {
            "value": ratio,
            "target": f"<= {TARGETS['latency_p95_ratio']}",
            "ok": ratio is not None and ratio <= TARGETS["latency_p95_ratio"],
        },
        "rss_growth_mib": {
            "value": max(growth) if None not in growth and growth else None,
            "target": f"<= {TARGETS['rss_growth_mib']} per agent",
            "ok": bool(growth) and None not in growth and max(growth) <= TARGETS["rss_growth_mib"],
        },
        "connections_flat": {
            "value": {k: [v["end"], v["early_max"]] for k, v in out["flat"].items()},
            "target": "[end median, first-half max]: PostgreSQL backends; pool, fds, threads "
            "summed over agents; end <= max",
            "ok": all(v["ok"] for v in out["flat"].values()),
        },
        "connections_returned": {
            "value": [a["final"]["pool_out"] if a["final"] else None for a in agents],
            "target": "0 checked out in every agent after the run",
            "ok": all(a["final"] and a["final"]["pool_out"] == 0 for a in agents),
        },
        "no_errors": {
            "value": bad,
            "target": f"0 of {', '.join(FAILURES)}; every agent exits 0",
            "ok": bad == 0 and all(c == 0 for c in out["agent_exit_codes"]),
        },
        "ledger_consistent": {
            "value": len(out["ledger"]["problems"]),
            "target": "nothing left open; counts, spend and caps consistent",
            "ok": not out["ledger"]["problems"],
        },
        "prefect_slots_returned": {
            "value": out["ledger"]["leaked_slots"],
            "target": "no slot left taken in any Prefect limit",
            "ok": not out["ledger"]["leaked_slots"],
        },
    }
    return found, [name for name, t in found.items() if not t["ok"]]


# -- report ------------------------------------------------------------------------------------


def num(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


LATENCY_HEADER = ["Operation", "Samples s/e", "p50 start", "p50 end", "p95 start", "p95 end"]
AGENT_HEADER = ["Agent", "RSS start", "RSS end", "RSS max", "Growth", "KiB/min"]
AGENT_HEADER += ["Pool s/e", "FDs s/e", "Threads s/e", "Out after"]


def latency_rows(latency: dict[str, Any]) -> list[list[str]]:
    return [
        [
            STREAMS[k],
            f"{v['start']['n']} / {v['end']['n']}",
            *(num(v[w]["p50_ms"]) for w in ("start", "end")),
            *(num(v[w]["p95_ms"]) for w in ("start", "end")),
            num(v["ratio"], 2),
        ]
        for k, v in latency.items()
    ]


def agent_rows(agents: list[dict[str, Any]]) -> list[list[str]]:
    def pair(figure: dict[str, Any]) -> str:
        return f"{num(figure['start'], 0)} / {num(figure['end'], 0)}"

    return [
        [
            str(a["index"]),
            *(num(a[k]) for k in ("rss_start_mib", "rss_end_mib", "rss_max_mib")),
            num(a["rss_growth_mib"], 2),
            num(a["rss_slope_kib_per_min"], 0),
            *(pair(a[k]) for k in ("pool", "fds", "threads")),
            "-" if a["final"] is None else str(a["final"]["pool_out"]),
        ]
        for a in agents
    ]


def target_rows(found: dict[str, Any]) -> list[list[str]]:
    def shown(value: Any) -> str:
        return json.dumps(value) if isinstance(value, dict | list) else num(value, 2)

    return [
        [name, shown(t["value"]), t["target"], "ok" if t["ok"] else "MISSED"]
        for name, t in found.items()
    ]


def report(out: dict[str, Any]) -> str:
    cfg, tot, w, ledger = out["config"], out["totals"], out["windows"], out["ledger"]
    pg, srv = out["pg_backends"], out["prefect_server_mib"]
    sections = [
        f"Soak: {cfg['minutes']:g} min, {cfg['agents']} agents (separate processes), ledger on "
        f"PostgreSQL ({cfg['url']}), Prefect server on PostgreSQL; {out['cpus']} CPUs, 1-min "
        f"load {out['load_avg_1m_at_start']:.2f} at start, {out['load_avg_1m_at_end']:.2f} at end; "
        f"job mix {', '.join(f'{k} {v}' for k, v in cfg['mix'].items())}",
        "",
        f"Jobs: {tot['submitted']} submitted, {tot['admitted']} admitted "
        f"({tot['admissions_per_s']:.1f}/s; {tot['admitted_without_wait']} without waiting), "
        f"{tot['completed']} completed, "
        f"{tot['withdrawn']} withdrawn before start, {tot['interrupted']} cancelled while "
        f"waiting, {tot['timed_out']} timed out (own max_wait), {tot['starved']} starved, "
        f"{tot['stuck']} stuck at the end, "
        f"{tot['rejected']} rejected, {tot['errors']} errors; {tot['prefect_limit_waits']} waits "
        "on Prefect limits after the ledger admitted.",
        f"Ledger decisions per second: {out['throughput']['start_per_s']:.1f} in the start "
        f"window, {out['throughput']['end_per_s']:.1f} in the end window.",
        "",
        f"Latency (ms). Start window {w['start'][0]:.0f}-{w['start'][1]:.0f} s, end window "
        f"{w['end'][0]:.0f}-{w['end'][1]:.0f} s into the run ({w['warmup_s']:.0f} s warm-up "
        "left out). A window's p95 is the median of the p95s of up to 5 consecutive groups of "
        ">= 20 samples (none under 20 samples).",
        "",
        table([*LATENCY_HEADER, "p95 end/start"], latency_rows(out["latency"])),
        "",
        "admit, not waiting: Gate.admit wall time for jobs admitted at their first decision "
        "(record + decide, Prefect limits of 3 scopes, lease recorded, heartbeat started). "
        "admit after a wait: from the start of the decision that admitted a waiting job to "
        "admit's return.",
        "",
        "Per agent: medians over the start and end windows (MiB); KiB/min: least-squares RSS "
        "slope after warm-up; pool: the ledger's idle + checked-out connections; out after: "
        "checked out once the run ended.",
        "",
        table(AGENT_HEADER, agent_rows(out["agents"])),
        "",
        f"Gate backends in PostgreSQL, all agents: {num(pg['start'], 0)} at the start, "
        f"{num(pg['end'], 0)} at the end (max {num(pg['early_max'], 0)} in the first half, "
        f"{num(pg['max'], 0)} overall). Prefect server RSS {num(srv['start'])} -> "
        f"{num(srv['end'])} MiB.",
        "Per minute, trend over the run: "
        + "; ".join(
            f"{name} {num(v['per_minute'][0])} -> {num(v['per_minute'][-1])} "
            f"(trend {num(v['trend_pct'], 0, '%')})"
            for name, v in out["host_and_db"].items()
        )
        + ".",
        "",
        f"Ledger after the run: {ledger['rows']} jobs {ledger['by_state']}, settled outcomes "
        f"{ledger['settled_outcomes']}, spend ${ledger['spend_usd']:.2f}; "
        f"{len(ledger['problems'])} problems; Prefect slots left taken: "
        f"{ledger['leaked_slots'] or 'none'}.",
        *[f"- {p}" for p in ledger["problems"]],
        *[f"- {e}" for e in out["errors"]],
        *[f"- agent {i} log: {t}" for i, t in out["agent_logs"].items()],
        "",
        "Targets",
        "",
        table(["Figure", "Value", "Target", ""], target_rows(out["targets"])),
        "",
        f"Total wall time {out['wall_s']:.0f} s.",
    ]
    return "\n".join(sections)


def parse_mix(text: str) -> dict[str, int]:
    """`interrupt=0,run=70` -> the default mix with those weights replaced."""
    mix = dict(KINDS)
    for part in filter(None, text.split(",")):
        kind, _, weight = part.partition("=")
        if kind not in KINDS or not weight.isdigit():
            raise argparse.ArgumentTypeError(f"expected KIND=WEIGHT with KIND in {list(KINDS)}")
        mix[kind] = int(weight)
    if not any(mix.values()):
        raise argparse.ArgumentTypeError("at least one weight must be positive")
    return mix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="measured run length")
    parser.add_argument("--agents", type=int, default=8, help="agent processes")
    parser.add_argument(
        "--url",
        default=PG_URL,
        help="PostgreSQL ledger (its tables are dropped; default: a database of the run's own)",
    )
    parser.add_argument(
        "--warmup", type=float, help="seconds left out at the start (default 10%%, 5-60 s)"
    )
    parser.add_argument(
        "--edge", type=float, default=0.1, help="start/end window, fraction of the run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", metavar="DIR", help="keep the agents' samples and logs here")
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=dict(KINDS),
        help="job mix as weights, e.g. interrupt=0 (default: "
        + ",".join(f"{k}={v}" for k, v in KINDS.items())
        + ")",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent_main(args.agent)
        return
    if args.minutes <= 0 or args.agents < 1 or not 0 < args.edge <= 0.5:
        parser.error("--minutes and --agents must be positive, --edge in (0, 0.5]")
    run_s = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(60.0, max(5.0, 0.1 * run_s))
    if warmup >= run_s / 2:
        parser.error("--warmup must be under half the run")
    with ledger_database(args.url) as url:
        cfg = Config(
            minutes=args.minutes,
            agents=args.agents,
            url=url,
            warmup_s=warmup,
            edge=args.edge,
            sample_s=min(5.0, max(1.0, run_s / 150)),
            seed=args.seed,
            mix=args.mix,
            keep=args.keep,
        )
        out = run(cfg)
    print(json.dumps(out, indent=2, default=str) if args.json else report(out))
    sys.exit(1 if out["missed"] else 0)


if __name__ == "__main__":
    main()

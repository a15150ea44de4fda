"""Chaos: SIGKILL an admitter or a running job's holder at a random moment; afterwards, with
reconcile, nothing is lost.

Each run gives a fresh org a nested budget (hourly caps on the org, its team and each session,
so Prefect concurrency slots are taken; day and month period budgets) and starts WORKERS
admitter processes at once, each a real Gate with RateLimits against one Prefect server, each
running its job (`sleep`) with the LocalLauncher. One of them, the victim, is SIGKILLed at a
random moment of the run's phase (the runs cycle through PHASES):

- before_reserve: just before or while its ledger request commits;
- after_reserve: admitted by the ledger, before or while it takes and records its rate slots;
- running: while its job runs;
- settling: before, during or after handing the slots back, before or during the ledger
  settlement.

Every worker pauses PAUSE_S before each step of those phases (a slow machine) and tells the
parent through a pipe when each phase begins, so a kill delay drawn over the phase's usual
length (learned from the other workers) lands at every step. A fault counts as injected when
SIGKILL ended the victim while its last word was the run's phase. With --park-at, more runs
follow, each victim killed exactly at a step mark (`<acquire`: Prefect granted the lease, its
id not yet recorded; `<release`: the slots handed back, the ledger not yet settled).

After each run. Once the victim is dead, reconcile runs (as a scheduled reconcile would), the
other workers finish, reconcile runs again, and the run's org is audited with
`prefect_gpu_budget.admission.audit`. A victim killed between its admission and recording its
Prefect lease may hold slots nobody can hand back: Prefect has no API to find the lease, only
its expiry returns them. Reconcile keeps such a row open (`awaiting-lease-expiry`) so that the
ledger counts its rate as long as Prefect may count the slots; the difference this leaves when
Prefect never granted the lease is reported apart (`slot_mismatch_transient_cents`), not lost.

Faults that are not kills (--faults stall,escape; each run once per --fault-repeat): one job,
admitted by a Gate in this process, with max_runtime FAULT_MAX_RUNTIME_S and kill grace
FAULT_GRACE_S, its process tree watched from outside (by a marker in its environment):

- stall: another connection locks the ledger (SQLite `BEGIN IMMEDIATE`, PostgreSQL
  `LOCK TABLE gpu_jobs IN EXCLUSIVE MODE`) when the job starts, for longer than max_runtime plus
  grace; the job's start cannot be recorded, and it must still be stopped in time;
- escape: the job's command starts `nohup` and `setsid` children that outlive it and its
  max_runtime; they must be billed and stopped with the job.

For each: `overshoot_micro`, what its processes really ran (rate x their watched life) beyond
what it had reserved (guaranteed mode: max_runtime plus grace), and `unmetered_micro`, what
they ran beyond what was billed. Both must be 0; the tree must be gone afterwards
(`jobs_outlived_holder`).

At the end. Once every lease a dead worker may hold unrecorded has expired and the server's
repossessor has returned its slots (UNRECORDED_LEASE_S after the last stamp of such a row; polled, with
END_MARGIN_S to spare), reconcile runs again and the whole ledger is audited. These are the
figures: `orphans_left` (reservations without an owner), `double_charges` (and
`missing_charges`), `slot_mismatch_cents` (Prefect slots in use per capped scope against the
ledger's running rate, both 0 by then) and `invariant_violations` (promise 1 replayed over the
ledger's timestamps, so it held throughout). The same figures after each run's reconcile are
under `after_each_run`.

Workers are forked from a preloaded fork server, so each is a fresh process (its own pid, its
own Prefect client and database connections) without paying for the imports each time.

Usage: python -m benchmarks.chaos [--runs N] [--url SQLALCHEMY_URL] [--seed S] [--json]
                                 [--api-url PREFECT_API_URL] [--phases P1,P2]
                                 [--park-at MARK1,MARK2] [--faults stall,escape]
                                 [--fault-repeat R]

The ledger is a SQLite file in a temporary directory unless --url names one. A PostgreSQL
database is created if missing and its gate tables are dropped and recreated: give it its own
database (e.g. postgresql://postgres@127.0.0.1:5432/gate_chaos). The Prefect server is a
`prefect server start` of its own (a temporary PREFECT_HOME, durable filesystem lease storage,
its lease repossessor running) unless --api-url names a running one; that one must run the
repossessor too (the test harness and the ephemeral server do not), or the end-state slot
check fails. --phases limits the random runs to some phases; --park-at adds one run per step
mark after them (--runs 0: only those).
Progress goes to stderr; the table (or, with --json, one JSON object) to
stdout. Exit status 1 if anything was lost.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as `python benchmarks/chaos.py` (and so are its workers)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_UI_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import argparse
import json
import multiprocessing as mp
import random
import signal
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from benchmarks.harness import PrefectServer, ensure_database, serving
from benchmarks.harness.report import logger, table
from prefect_gpu_budget.admission.audit import (
    SlotCheck,
    audit,
    awaiting_rows,
    local_job_running,
    slot_mismatches,
)
from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.ledger import ACTIVE, Ledger, metadata
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.policy import BudgetRule
from prefect_gpu_budget.admission.reconcile import UNRECORDED_LEASE_S, Reconciled, reconcile
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher, marked_processes
from prefect_gpu_budget.pricing.catalog import Catalog, set_local_price
from prefect_gpu_budget.units import cost_micro, org_of

PHASES = ("before_reserve", "after_reserve", "running", "settling")
PHASE_END = {
    "before_reserve": "requested",
    "after_reserve": "admitted",
    "running": "settling",
    "settling": "done",
}
"""The word a worker says when each phase is over."""
STEPS = {
    "request": "before_reserve",
    "ensure": "after_reserve",
    "acquire": "after_reserve",
    "record_lease": "after_reserve",
    "release": "settling",
    "settle": "settling",
}
"""The product calls a worker marks (`>call` as it starts, `<call` once it returned), by phase,
in the order the gate makes them."""
WORKERS = 3
PAUSE_S = 0.02
"""A worker's pause before each step of a phase."""
VICTIM_JOB_S = 0.6
OTHER_JOB_S = (0.1, 0.3)
MAX_WAIT = "8s"
"""A worker gives up after waiting this long for room in its budgets."""
STALE_S = 30.0
REACH_S = 30.0
"""How long the victim may take to reach its phase."""
FINISH_S = 20.0
"""How long the other workers may take to finish once the victim is dead (a few seconds
normally; a worker still waiting then is stuck and counted)."""
END_MARGIN_S = 30.0
"""Past the latest expiry of a lease nobody recorded, how long the end waits for Prefect's slots
to match the ledger before it measures anyway."""
POLL_S = 1.0
END_FIGURES = (
    "orphans_left",
    "double_charges",
    "missing_charges",
    "slot_mismatch_cents",
    "invariant_violations",
    "awaiting_lease_expiry_left",
)
"""The end state, over the whole ledger, once every lease has expired: all must be zero."""
RUN_FIGURES = (
    "orphans_left",
    "double_charges",
    "missing_charges",
    "slot_mismatch_cents",
    "invariant_violations",
)
"""After each run's reconcile (`after_each_run`): all must be zero."""
FAULTS = ("stall", "escape")
"""Faults that are not kills: a ledger locked when a job starts; children escaping the job."""
FAULT_MAX_RUNTIME_S = 2.0
FAULT_GRACE_S = 1.0
STALL_EXTRA_S = 3.0
"""The stall lasts max_runtime plus grace plus this: past any moment the job may still run."""
FAULT_MARK_ENV = "CHAOS_TREE"
ESCAPE_SCRIPT = (
    "nohup sleep 30 >/dev/null 2>&1 &"
    " setsid sleep 30 >/dev/null 2>&1 &"
    " setsid sh -c 'trap \"\" TERM; sleep 30' >/dev/null 2>&1 &"
    " exit 0"
)
"""Children in the job's group, in a new session, and one ignoring SIGTERM; the command exits."""
ESCAPED_WATCH_S = 40.0
"""How long processes that outlive their job are watched (their whole life: `sleep 30`)."""
WATCH_SLACK_S = 0.25
"""What watching a process tree every 50 ms may add to its life as seen from outside."""
OTHER_FIGURES = (
    "overshoot_micro",
    "unmetered_micro",
    "slots_held_past_deadline_cents",
    "second_settles_charged",
    "jobs_outlived_holder",
    "worker_errors",
    "stuck_workers",
)
"""Counted over the runs and the end: all must be zero. `overshoot_micro` (the money bound
of guaranteed mode) and `unmetered_micro`: over the fault runs. `slots_held_past_deadline_cents`:
Prefect still held slots for a row awaiting lease expiry when reconcile settled it, once its
lease could no longer be alive (reconcile's UNRECORDED_LEASE_S too short for this server)."""


log = logger("chaos")


def budgets(org: str) -> list[BudgetRule]:
    """Two jobs at $3.60/h fit the team at once, one per session; the team's day budget holds
    two reservations, so waits come from caps and from the period budget."""
    return [
        BudgetRule(org, hourly_cap_cents=1080, period_budget_micro=100_000, period="month"),
        BudgetRule(f"{org}/t", hourly_cap_cents=720, period_budget_micro=25_000, period="day"),
        BudgetRule(f"{org}/t/s1", hourly_cap_cents=360),
        BudgetRule(f"{org}/t/s2", hourly_cap_cents=360, period_budget_micro=30_000, period="day"),
    ]


# -- the worker (a forked process) ---------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    api_url: str
    prices: str
    scope: str
    job_s: float
    park_at: str | None = None
    """A step mark (e.g. `<settle`) at which this worker stops, to be killed right there."""


PHASE_WORDS = {"started": "running", "settling": "settling"}
"""The lifecycle's phases (`admission/lifecycle.py`) as the words a worker tells the parent."""


def worker(spec: WorkerSpec, conn: Connection) -> None:
    """Admit, run and settle one job, saying each phase; a pause before each step."""
    from prefect.client.orchestration import get_client

    def say(word: str) -> None:
        conn.send((word, time.time()))

    def mark(word: str) -> None:
        say(word)
        if word == spec.park_at:
            time.sleep(3600)  # parked: the parent kills it here

    def step(call: Callable[..., Any], before: str | None = None, after: str | None = None):
        """`call` after a pause, marked `>name` when it starts and `<name` when it returns."""
        name = call.__name__

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                say(before)
            time.sleep(PAUSE_S)
            mark(f">{name}")
            out = call(*args, **kwargs)
            mark(f"<{name}")
            if after:
                say(after)
            return out

        return wrapped

    ledger = Ledger(spec.url, create=False)
    with get_client(sync_client=True) as client:
        if str(client.api_url).rstrip("/") != spec.api_url.rstrip("/"):
            raise RuntimeError(f"worker talks to {client.api_url}, not {spec.api_url}")
        limits = RateLimits(client)
        gate = Gate(ledger, limits, catalog=Catalog.load(Path(spec.prices)))
        # the gate calls these on its ledger and limits: each becomes a marked step
        for target, name, before, after in [
            (ledger, "request", "before_reserve", "requested"),
            (limits, "ensure", "after_reserve", None),
            (limits, "acquire", None, None),
            (ledger, "record_lease", None, None),
            (ledger, "settle", None, None),
            (limits, "release", None, None),
        ]:
            setattr(target, name, step(getattr(target, name), before, after))
        job = GpuJob(
            instance_type="local:chaos",
            max_runtime="10s",
            kill_grace="1s",
            max_wait=MAX_WAIT,
            command=["sleep", f"{spec.job_s:.3f}"],
        )
        try:
            admission = gate.admit(job, spec.scope)
        except AdmissionRefused as refused:
            say(f"refused:{refused.state_name}")
            return
        say("admitted")
        # the users' path (`run_gpu_job`'s): the phases are the lifecycle's own
        run_admitted(gate, admission, LocalLauncher(), phase=lambda name: say(PHASE_WORDS[name]))
        say("done")


# -- one run ------------------------------------------------------------------------------------


@dataclass
class Worker:
    proc: Any
    conn: Connection
    heard: list[tuple[str, float]] = field(default_factory=list)
    closed: bool = False
    """The worker's end of the pipe is closed: it exited or died."""

    def listen(self) -> None:
        """Read what the worker said so far (all of it once it is dead)."""
        while not self.closed:
            try:
                if not self.conn.poll():
                    return
                self.heard.append(self.conn.recv())
            except (EOFError, OSError):
                self.closed = True

    def words(self) -> list[tuple[str, float]]:
        """What it said about phases, without the step marks."""
        return [(word, at) for word, at in self.heard if word[0] not in "<>"]

    def last_word(self) -> str | None:
        words = self.words()
        return words[-1][0] if words else None

    def position(self) -> str:
        """Where in its phase it was last heard: `>step` (in it), `<step` (just after it)."""
        for word, _ in reversed(self.heard):
            if word[0] in "<>":
                return word
            return "-"  # said its phase, no step yet
        return "-"


@dataclass
class Setup:
    ledger: Ledger
    limits: RateLimits
    ctx: Any
    api_url: str
    prices: str
    rng: random.Random
    tag: str
    """Names this benchmark's orgs apart from any other on the same Prefect server."""
    awaiting: dict[str, str] = field(default_factory=dict)
    """Rows reconcile holds open until an unrecorded lease expires: job id -> org."""
    late: list[str] = field(default_factory=list)
    """Findings: Prefect still held slots when reconcile settled such a row."""
    late_cents: int = 0
    seen: dict[str, deque] = field(
        default_factory=lambda: {p: deque([2 * PAUSE_S], maxlen=50) for p in PHASES}
    )
    """Recent lengths of each phase in the workers that were not killed."""


@dataclass
class RunResult:
    org: str
    phase: str
    mark: str | None
    """The step mark the victim was killed at (None: at a random moment of `phase`)."""
    landed: str
    position: str
    """The victim's last step mark: `>acquire` killed in it, `<acquire` after it returned."""
    injected: bool
    delay_s: float
    reconciled: list[str]
    audit: Any
    second_settles_charged: int
    outlived: int
    errors: int
    stuck: int
    wall_s: float
    overshoot_micro: int = 0
    """Fault runs: real spend (rate x the tree's watched life) beyond the reservation."""
    unmetered_micro: int = 0
    """Fault runs: real spend beyond what was billed."""
    fault: str | None = None

    def lost(self) -> dict[str, int]:
        """This run's figures that are not zero among those that must be."""
        a = self.audit
        figures = {
            "orphans_left": a.orphans_left,
            "double_charges": a.double_charges,
            "missing_charges": a.missing_charges,
            "slot_mismatch_cents": a.slot_mismatch_cents,
            "invariant_violations": a.invariant_violations,
            "second_settles_charged": self.second_settles_charged,
            "jobs_outlived_holder": self.outlived,
            "worker_errors": self.errors,
            "stuck_workers": self.stuck,
            "overshoot_micro": self.overshoot_micro,
            "unmetered_micro": self.unmetered_micro,
        }
        return {k: v for k, v in figures.items() if v}


def spawn(setup: Setup, scope: str, job_s: float, park_at: str | None = None) -> Worker:
    reader, writer = setup.ctx.Pipe(duplex=False)
    spec = WorkerSpec(setup.ledger.url, setup.api_url, setup.prices, scope, job_s, park_at)
    proc = setup.ctx.Process(target=worker, args=(spec, writer), daemon=True)
    proc.start()
    writer.close()
    return Worker(proc, reader)


def await_word(workers: list[Worker], target: Worker, word: str, timeout: float) -> float | None:
    """Listen to every worker until `target` says `word` (when it said it) or falls silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = [at for heard, at in target.heard if heard == word]
        if said:
            return said[0]
        if target.closed:
            return None
        ready = wait([w.conn for w in workers if not w.closed], timeout=0.2)
        for w in workers:
            if w.conn in ready:
                w.listen()
    return None


def phase_lengths(heard: list[tuple[str, float]]) -> Iterator[tuple[str, float]]:
    for (word, at), (nxt, then) in zip(heard, heard[1:], strict=False):
        if word in PHASE_END and nxt == PHASE_END[word]:
            yield word, then - at


def landed_in(word: str | None) -> str:
    """The phase (or the moment between phases) a worker was in after saying `word`."""
    if word is None:
        return "starting"
    if word in PHASES:
        return word
    return {"requested": "queued", "admitted": "launching", "done": "finished"}.get(word, word)


def wait_jobs_gone(ledger: Ledger, org: str, timeout: float = 5.0) -> int:
    """Wait until no active local job of a dead holder runs any more; how many still do."""
    deadline = time.monotonic() + timeout
    while True:
        left = [
            r
            for r in ledger.orphans(stale_after=STALE_S)
            if r["org"] == org and r["state"] in ACTIVE and local_job_running(r)
        ]
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.05)


def one_run(setup: Setup, index: int, phase: str, mark: str | None = None) -> RunResult:
    """One run: start the workers, kill the victim in `phase` (exactly at the step mark `mark`
    if given), reconcile, let the others finish, reconcile again, audit the run's org."""
    started = time.perf_counter()
    rng = setup.rng
    org = f"chaos-{setup.tag}-{index}"
    rules = budgets(org)
    for rule in rules:
        setup.ledger.set_budget(rule)
    # as in steady state, the limits exist already (workers racing to create them only make
    # the server log the losers' 409s)
    setup.limits.ensure([(r.scope, r.hourly_cap_cents) for r in rules if r.hourly_cap_cents])
    scopes = [f"{org}/t/s1", f"{org}/t/s2", f"{org}/t/s1"]
    rng.shuffle(scopes)
    victim_at = rng.randrange(WORKERS)
    workers = [
        spawn(setup, scope, VICTIM_JOB_S, mark)
        if i == victim_at
        else spawn(setup, scope, rng.uniform(*OTHER_JOB_S))
        for i, scope in enumerate(scopes)
    ]
    victim = workers[victim_at]
    delay = 0.0
    try:
        if mark:
            await_word(workers, victim, mark, REACH_S)
        elif (said_at := await_word(workers, victim, phase, REACH_S)) is not None:
            if phase == "running":
                window = 0.9 * VICTIM_JOB_S
            else:
                window = statistics.median(setup.seen[phase])
            delay = rng.uniform(0, window)
            time.sleep(max(0.0, said_at + delay - time.time()))
        if victim.proc.is_alive():
            os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.join(timeout=30)
        victim.listen()
        landed = landed_in(victim.last_word())
        position = victim.position()
        injected = (
            victim.proc.exitcode == -signal.SIGKILL
            and victim.last_word() == phase
            and mark in (None, position)
        )
        outlived = wait_jobs_gone(setup.ledger, org)
        done = reconcile_tracked(setup)
        others = [w for w in workers if w is not victim]
        deadline = time.monotonic() + FINISH_S
        for w in others:
            w.proc.join(timeout=max(0.1, deadline - time.monotonic()))
        stuck = [w for w in others if w.proc.is_alive()]
        for w in stuck:
            os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.join(timeout=30)
        for w in others:
            w.listen()
            for name, length in phase_lengths(w.words()):
                setup.seen[name].append(length)
        errors = sum(1 for w in others if w not in stuck and w.proc.exitcode != 0)
        done += reconcile_tracked(setup)
        second = settle_again(setup.ledger, org)
        checked = audit(setup.ledger, setup.limits, scope=org, stale_after=STALE_S)
    finally:
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=30)
            w.conn.close()
    return RunResult(
        org=org,
        phase=phase,
        mark=mark,
        landed=landed,
        position=position,
        injected=injected,
        delay_s=delay,
        reconciled=list(last_actions(d for d in done if org_of(d.scope) == org).values()),
        audit=checked,
        second_settles_charged=second,
        outlived=outlived,
        errors=errors,
        stuck=len(stuck),
        wall_s=time.perf_counter() - started,
    )


# -- faults that are not kills ------------------------------------------------------------------


def marked(value: str) -> list[int]:
    """Live processes whose environment carries FAULT_MARK_ENV=value."""
    return marked_processes(FAULT_MARK_ENV, value)


class TreeWatch:
    """How long any process of a marked tree lives, watched from outside every 50 ms."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.first: float | None = None
        self.last: float | None = None
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            alive = marked(self.value)
            if alive:
                now = time.time()
                self.first = self.first or now
                self.last = now
                self.most = max(self.most, len(alive))
            time.sleep(0.05)

    def stop(self) -> float:
        """The tree's life in seconds (0 if it was never seen)."""
        self._stop.set()
        self._thread.join()
        return 0.0 if self.first is None or self.last is None else self.last - self.first


def hold_ledger_lock(url: str, seconds: float, held: threading.Event) -> None:
    """Lock the jobs table against writers from a connection of its own for `seconds`."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.split("///", 1)[1], isolation_level=None, timeout=60)
        try:
            conn.execute("BEGIN IMMEDIATE")
            held.set()
            time.sleep(seconds)
            conn.execute("COMMIT")
        finally:
            conn.close()
        return
    import sqlalchemy as sa

    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE gpu_jobs IN EXCLUSIVE MODE"))
            held.set()
            time.sleep(seconds)
    finally:
        engine.dispose()


def fault_run(setup: Setup, index: int, fault: str) -> RunResult:
    """One job under `fault` (stall or escape), admitted, run and settled by a Gate in this
    process; its tree's life watched from outside; the run's org audited."""
    started = time.perf_counter()
    org = f"chaos-{setup.tag}-{index}"
    rules = budgets(org)
    for rule in rules:
        setup.ledger.set_budget(rule)
    setup.limits.ensure([(r.scope, r.hourly_cap_cents) for r in rules if r.hourly_cap_cents])
    gate = Gate(setup.ledger, setup.limits, catalog=Catalog.load(Path(setup.prices)))
    value = uuid.uuid4().hex
    command = ["sleep", "30"] if fault == "stall" else ["sh", "-c", ESCAPE_SCRIPT]
    job = GpuJob(
        instance_type="local:chaos",
        max_runtime=FAULT_MAX_RUNTIME_S,
        kill_grace=FAULT_GRACE_S,
        max_wait=MAX_WAIT,
        command=command,
        env={FAULT_MARK_ENV: value},
    )
    admission = gate.admit(job, f"{org}/t/s1")
    locker, held = None, threading.Event()
    if fault == "stall":
        hold_s = FAULT_MAX_RUNTIME_S + FAULT_GRACE_S + STALL_EXTRA_S
        locker = threading.Thread(
            target=hold_ledger_lock, args=(setup.ledger.url, hold_s, held), daemon=True
        )
        locker.start()
        held.wait(60)
    watch = TreeWatch(value)
    errors = 0
    try:
        ended = run_admitted(gate, admission, LocalLauncher())
        result, row = ended.result, ended.row
    except Exception as exc:  # counted: the fault broke the job's bookkeeping
        log(f"fault run {fault}: {type(exc).__name__}: {exc}")
        errors, row, result = 1, setup.ledger.job(admission.job_id), None
    left = len(marked(value))  # what outlived the job
    gone_by = time.monotonic() + ESCAPED_WATCH_S
    while marked(value) and time.monotonic() < gone_by:  # its real life, to bill it against
        time.sleep(0.2)
    lived = watch.stop()
    if locker is not None:
        locker.join(timeout=60)
    rate = admission.quote.rate_micro_per_hour
    real = cost_micro(rate, max(0.0, lived - WATCH_SLACK_S), round_up=False)
    billed = row.get("actual_micro") or 0
    injected = (
        held.is_set() and result is not None and "could not be recorded" in result.detail
        if fault == "stall"
        else watch.most >= 3  # the children ran on their own
    )
    checked = audit(setup.ledger, setup.limits, scope=org, stale_after=STALE_S)
    return RunResult(
        org=org,
        phase=fault,
        mark=None,
        landed=fault,
        position=result.outcome if result is not None else "error",
        injected=injected,
        delay_s=0.0,
        reconciled=[],
        audit=checked,
        second_settles_charged=settle_again(setup.ledger, org),
        outlived=left,
        errors=errors,
        stuck=0,
        wall_s=time.perf_counter() - started,
        overshoot_micro=max(0, real - (row.get("reserved_micro") or 0)),
        unmetered_micro=max(0, real - billed),
        fault=fault,
    )


def reconcile_tracked(setup: Setup) -> list[Reconciled]:
    """Reconcile the whole ledger (as a scheduled reconcile would). When it settles a row it
    had held open until an unrecorded lease's latest expiry, Prefect must hold no slots for
    it any more: what Prefect still holds then in that org is counted (`late_cents`)."""
    done = reconcile(setup.ledger, setup.limits, stale_after=STALE_S)
    closed = set()
    for d in done:
        if d.action == "awaiting-lease-expiry":
            setup.awaiting[d.job_id] = org_of(d.scope)
        elif d.job_id in setup.awaiting:
            closed.add(setup.awaiting.pop(d.job_id))
    if closed:
        pending = set(setup.awaiting)
        for check in check_slots(setup, sorted(closed), pending).values():
            if check.mismatch_cents:
                setup.late_cents += check.mismatch_cents
                setup.late += [f"{m} just after reconcile's deadline" for m in check.messages]
    return done


def last_actions(done: Iterable[Reconciled]) -> dict[str, str]:
    """Each job's last reconcile action, in the order the jobs first came up."""
    out: dict[str, str] = {}
    for d in done:
        out[d.job_id] = d.action
    return out


def settle_again(ledger: Ledger, org: str | None) -> int:
    """Settle every finished job of the run (of the ledger: None) once more: how many that
    charged (none may)."""
    return sum(
        ledger.settle(row["id"], ended_at=time.time() + 3600, outcome="again") is not None
        for row in ledger.jobs(org)
        if row["state"] not in ACTIVE
    )


# -- setup and the whole benchmark ------------------------------------------------------------


def fresh_ledger(url: str) -> Ledger:
    if not url.startswith("sqlite"):
        ensure_database(url)
    old = Ledger(url, create=False)
    metadata.drop_all(old.engine)
    old.dispose()
    return Ledger(url)


@contextmanager
def prefect_server(api_url: str | None, home: Path) -> Iterator[str]:
    """The Prefect server at `api_url`, else one of our own (`prefect server start`, its own
    PREFECT_HOME, leases in durable filesystem storage, its lease repossessor running); its URL
    is exported for the workers (and for this process's client)."""
    if api_url is not None:
        with serving(api_url) as url:
            yield url
        return
    with PrefectServer(home) as server, serving(server.api) as url:
        yield url


def fork_server() -> Any:
    """Workers fork from a server that imported Prefect and the gate once (call after the
    Prefect API URL is in the environment: the fork server keeps the one it starts with)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "prefect.client.orchestration",
            "prefect_gpu_budget.admission.gate",
            "prefect_gpu_budget.launchers.local",
            "psycopg",
        ]
    )
    return ctx


def run(
    runs: int,
    url: str | None,
    seed: int,
    api_url: str | None = None,
    phases: tuple[str, ...] = PHASES,
    park_at: tuple[str, ...] = (),
    faults: tuple[str, ...] = (),
    fault_repeat: int = 1,
) -> dict[str, Any]:
    """`runs` runs cycling through `phases`, then one run per step mark in `park_at`, then
    `fault_repeat` runs of each fault in `faults`; then the end: every lease expired,
    reconcile, the whole ledger audited."""
    wall = time.perf_counter()
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="gpu-budget-chaos-") as tmp:
        url = url or f"sqlite:///{tmp}/ledger.db"
        prices = set_local_price("chaos", "3.6", gpus=0, path=Path(tmp) / "prices.csv")
        ledger = fresh_ledger(url)
        log(f"ledger {ledger.engine.dialect.name}; Prefect server {api_url or 'starting'}")
        home = Path(tmp) / "prefect-home"
        home.mkdir()
        with prefect_server(api_url, home) as served:
            limits = RateLimits()
            tag = uuid.uuid4().hex[:8]  # not from the seed: reruns must not share names
            ctx = fork_server()
            setup = Setup(ledger, limits, ctx, served, str(prices), rng, tag)
            plan = [(phases[i % len(phases)], None) for i in range(runs)]
            plan += [(STEPS[mark[1:]], mark) for mark in park_at]
            results, fault_results = [], []
            fault_plan = [fault for _ in range(fault_repeat) for fault in faults]
            try:
                for i, (phase, mark) in enumerate(plan):
                    result = one_run(setup, i, phase, mark)
                    results.append(result)
                    log(progress(i, len(plan), result))
                for j, fault in enumerate(fault_plan):
                    result = fault_run(setup, len(plan) + j, fault)
                    fault_results.append(result)
                    log(fault_progress(j, len(fault_plan), result))
                end = end_state(setup)
            finally:
                limits.close()
                ledger.dispose()
    out = summarise(results, end, fault_results)
    out.update(
        prefect_server="given" if api_url else "prefect server start (filesystem leases)",
        backend=make_backend(url),
        seed=seed,
        workers_per_run=WORKERS,
        cpus=os.cpu_count(),
        wall_s=round(time.perf_counter() - wall, 1),
    )
    return out


def check_slots(setup: Setup, orgs: list[str] | None, awaiting: set[str]) -> dict[str, SlotCheck]:
    """Prefect slots against the ledger's running rate, per org (all orgs with budgets: None)."""
    rules: dict[str, list[BudgetRule]] = defaultdict(list)
    for rule in setup.ledger.budgets():
        rules[org_of(rule.scope)].append(rule)
    return {
        org: slot_mismatches(setup.limits, setup.ledger.jobs(org), rules[org], awaiting)
        for org in (orgs if orgs is not None else sorted(rules))
    }


def end_state(setup: Setup) -> dict[str, Any]:
    """Wait until every Prefect lease a dead worker may hold unrecorded has expired and been
    repossessed, reconcile, and audit the whole ledger.

    Reconcile holds the row of such a lease open until UNRECORDED_LEASE_S after its last stamp
    (its admission, or a stamp while it asked for slots), by when the server has returned the
    slots: so the wait lasts until UNRECORDED_LEASE_S after the last such stamp, then until Prefect's slots match the ledger (at most
    END_MARGIN_S more). Meanwhile, every POLL_S, the ledger is reconciled and the slots of the
    orgs where anything was held are compared.
    """
    ledger = setup.ledger
    started = time.time()
    stamps = [  # an unrecorded lease's latest grant is near its row's last stamp
        max(r["admitted_at"], r["heartbeat_at"])
        for r in ledger.jobs()
        if r["admitted_at"] is not None and r["lease_id"] is None
    ]
    deadline = max(stamps, default=started) + UNRECORDED_LEASE_S
    bound = deadline + END_MARGIN_S
    awaiting = {r["id"] for r in awaiting_rows(ledger, stale_after=STALE_S)}
    first = check_slots(setup, None, awaiting)
    watch = [
        org for org, c in first.items() if c.slots_cents or c.mismatch_cents or c.transient_cents
    ]
    log(
        f"end: {len(awaiting)} rows awaiting lease expiry, Prefect holds "
        f"{sum(c.slots_cents for c in first.values())} slots in {len(watch)} orgs; waiting up to "
        f"{max(0.0, bound - started):.0f} s for every lease to expire"
    )
    actions: dict[str, str] = {}
    returned_after = at_deadline = None
    told = started
    while True:
        now = time.time()
        actions.update(last_actions(reconcile_tracked(setup)))
        pending = set(setup.awaiting)
        checks = check_slots(setup, watch, pending).values()
        held = sum(c.slots_cents for c in checks)
        off = sum(c.mismatch_cents + c.transient_cents + c.unrecorded_cents for c in checks)
        if held == 0 and returned_after is None:
            returned_after = now - started
        if now >= deadline and at_deadline is None:
            at_deadline = off  # has the repossessor beaten reconcile's deadline?
        if (now >= deadline and not pending and off == 0) or now >= bound:
            waited = time.time() - started
            break
        if now - told >= 15:
            told = now
            log(f"end: {len(pending)} rows awaiting, Prefect holds {held} slots; waiting")
        time.sleep(POLL_S)
    actions.update(last_actions(reconcile_tracked(setup)))
    second = settle_again(ledger, None)
    final = audit(ledger, stale_after=STALE_S)  # the slots apart: nothing explains a difference
    slots = check_slots(setup, None, set()).values()
    out = {
        "orphans_left": final.orphans_left,
        "double_charges": final.double_charges,
        "missing_charges": final.missing_charges,
        "slot_mismatch_cents": sum(c.mismatch_cents for c in slots),
        "invariant_violations": final.invariant_violations,
        "awaiting_lease_expiry_left": final.awaiting_lease_expiry,
        "second_settles_charged": second,
        "jobs": final.jobs,
        "capped_scopes_checked": sum(c.scopes for c in slots),
        "prefect_slots_held": sum(c.slots_cents for c in slots),
        "ledger_running_rate_cents": sum(
            r["rate_cents"] for r in ledger.jobs() if r["state"] in ACTIVE
        ),
        "wait": {
            "waited_s": round(waited, 1),
            "deadline_after_s": round(max(0.0, deadline - started), 1),
            "awaiting_rows_at_start": len(awaiting),
            "prefect_slots_held_at_start": sum(c.slots_cents for c in first.values()),
            "unrecorded_lease_slots_at_start": sum(c.unrecorded_cents for c in first.values()),
            "slots_returned_after_s": None if returned_after is None else round(returned_after, 1),
            "slot_difference_at_deadline_cents": at_deadline,
            "reconciled": dict(Counter(actions.values())),
        },
        "slots_held_past_deadline_cents": setup.late_cents,
        "messages": [*setup.late, *final.messages][:40],
    }
    slot_messages = [m for c in slots for m in c.messages]
    out["messages"] += [m for m in slot_messages if m not in out["messages"]][:40]
    log(
        f"end: waited {out['wait']['waited_s']} s; "
        + ", ".join(f"{k} {out[k]}" for k in END_FIGURES)
    )
    return out


def make_backend(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgresql"


def progress(i: int, runs: int, r: RunResult) -> str:
    lost = r.lost()
    verdict = "ok" if not lost else f"LOST {lost}: " + "; ".join(r.audit.messages[:3])
    how = f"at {r.mark}" if r.mark else f"after {r.delay_s * 1000:4.0f} ms"
    transient = r.audit.slot_transient_cents
    return (
        f"run {i + 1}/{runs}: {r.phase:<14} killed {how} in {r.landed} at {r.position:<14} "
        f"reconcile {','.join(r.reconciled) or '-':<17} "
        f"{verdict}{f' (transient {transient})' if transient else ''} ({r.wall_s:.1f} s)"
    )


def fault_progress(j: int, runs: int, r: RunResult) -> str:
    lost = r.lost()
    verdict = "ok" if not lost else f"LOST {lost}: " + "; ".join(r.audit.messages[:3])
    return (
        f"fault {j + 1}/{runs}: {r.phase:<7} {'injected' if r.injected else 'NOT injected'}, "
        f"job {r.position}, overshoot {r.overshoot_micro} micro-USD, unmetered "
        f"{r.unmetered_micro}, processes left {r.outlived}: {verdict} ({r.wall_s:.1f} s)"
    )


def summarise(
    results: list[RunResult], end: dict[str, Any], fault_results: list[RunResult] = ()
) -> dict[str, Any]:
    fault_results = list(fault_results)
    audits = [r.audit for r in results]
    fault_audits = [r.audit for r in fault_results]
    faults = Counter(r.phase for r in results if r.injected)
    random_faults = Counter(r.phase for r in results if r.injected and r.mark is None)
    out: dict[str, Any] = {
        "runs": len(results),
        "faults_injected": sum(faults.values()),
        "faults_by_phase": {p: faults.get(p, 0) for p in PHASES},
        "random_faults_by_phase": {p: random_faults.get(p, 0) for p in PHASES},
        "kills_landed": dict(Counter(r.landed for r in results)),
        "kill_points": dict(Counter(f"{r.landed} {r.position}" for r in results)),
        **{k: end[k] for k in END_FIGURES},
        "slot_mismatch_transient_cents": sum(a.slot_transient_cents or 0 for a in audits),
        "slots_held_past_deadline_cents": end["slots_held_past_deadline_cents"],
        "second_settles_charged": sum(r.second_settles_charged for r in results)
        + end["second_settles_charged"],
        "jobs_outlived_holder": sum(r.outlived for r in [*results, *fault_results]),
        "worker_errors": sum(r.errors for r in [*results, *fault_results]),
        "fault_runs": len(fault_results),
        "faults_by_kind": {
            f: sum(r.injected for r in fault_results if r.fault == f)
            for f in FAULTS
            if any(r.fault == f for r in fault_results)
        },
        "overshoot_micro": sum(r.overshoot_micro for r in fault_results),
        "unmetered_micro": sum(r.unmetered_micro for r in fault_results),
        "stuck_workers": sum(r.stuck for r in results),
        "after_each_run": {
            **{k: sum(getattr(a, k) or 0 for a in [*audits, *fault_audits]) for k in RUN_FIGURES},
            "slot_mismatch_transient_cents": sum(a.slot_transient_cents or 0 for a in audits),
            "unrecorded_lease_slots_cents": sum(a.slot_unrecorded_cents or 0 for a in audits),
            "awaiting_lease_expiry": sum(a.awaiting_lease_expiry for a in audits),
        },
        "end": {k: v for k, v in end.items() if k not in END_FIGURES and k != "messages"},
        "reconciled": dict(Counter(action for r in results for action in r.reconciled)),
        "jobs": end["jobs"],
        "run_s_median": round(statistics.median(r.wall_s for r in results), 2) if results else None,
        "messages": [
            f"run {i + 1} ({r.phase}, killed in {r.landed} at {r.position}): {m}"
            for i, r in enumerate(results)
            if r.lost()
            for m in [f"lost {r.lost()}", *r.audit.messages]
        ][:40]
        + [f"end: {m}" for m in end["messages"]],
    }
    lost = {k: out[k] for k in (*END_FIGURES, *OTHER_FIGURES) if out[k]}
    lost.update({f"after_each_run.{k}": out["after_each_run"][k] for k in RUN_FIGURES})
    out["lost"] = {k: v for k, v in lost.items() if v}
    out["by_fault_run"] = [
        {
            "fault": r.fault,
            "injected": r.injected,
            "outcome": r.position,
            "overshoot_micro": r.overshoot_micro,
            "unmetered_micro": r.unmetered_micro,
            "processes_left": r.outlived,
            "lost": r.lost(),
        }
        for r in fault_results
    ]
    out["messages"] = (
        out["messages"][:40]
        + [
            f"fault run {i + 1} ({r.fault}): {m}"
            for i, r in enumerate(fault_results)
            if r.lost()
            for m in [f"lost {r.lost()}", *r.audit.messages]
        ][:40]
    )
    out["by_run"] = [
        {
            "phase": r.phase,
            "mark": r.mark,
            "injected": r.injected,
            "landed": r.landed,
            "position": r.position,
            "delay_ms": round(r.delay_s * 1000, 1),
            "reconciled": r.reconciled,
            "awaiting_lease_expiry": r.audit.awaiting_lease_expiry,
            "slot_transient_cents": r.audit.slot_transient_cents,
            "unrecorded_lease_slots_cents": r.audit.slot_unrecorded_cents,
            "lost": r.lost(),
        }
        for r in results
    ]
    return out


# -- report ------------------------------------------------------------------------------------


def report(out: dict[str, Any]) -> str:
    phases = [[p, str(out["faults_by_phase"][p])] for p in PHASES]
    landed = [[k, str(v)] for k, v in sorted(out["kill_points"].items())]
    end, each, wait_ = out["end"], out["after_each_run"], out["end"]["wait"]
    figures = [[k, str(out[k])] for k in ("runs", "faults_injected", *END_FIGURES, *OTHER_FIGURES)]
    figures += [
        ["capped scopes checked at the end", str(end["capped_scopes_checked"])],
        [
            "Prefect slots held / ledger running rate at the end",
            f"{end['prefect_slots_held']} / {end['ledger_running_rate_cents']}",
        ],
    ]
    per_run = [[k, str(v)] for k, v in each.items()]
    waited = [
        ["waited (s)", str(wait_["waited_s"])],
        ["rows awaiting lease expiry when the runs ended", str(wait_["awaiting_rows_at_start"])],
        ["Prefect slots held then", str(wait_["prefect_slots_held_at_start"])],
        ["of them under leases nobody recorded", str(wait_["unrecorded_lease_slots_at_start"])],
        ["all slots back after (s)", str(wait_["slots_returned_after_s"])],
        [
            "slots vs ledger at reconcile's deadline (cents)",
            str(wait_["slot_difference_at_deadline_cents"]),
        ],
    ]
    fault_rows = [
        [k, str(out["faults_by_kind"].get(k, 0))] for k in FAULTS if k in out["faults_by_kind"]
    ]
    fault_rows += [
        ["overshoot past the reservations (micro-USD)", str(out["overshoot_micro"])],
        ["ran unmetered (micro-USD)", str(out["unmetered_micro"])],
    ]
    reconciled = [[k, str(v)] for k, v in sorted(out["reconciled"].items())]
    reconciled += [[f"{k} (at the end)", str(v)] for k, v in sorted(wait_["reconciled"].items())]
    sections = [
        f"Chaos: {out['runs']} runs of {out['workers_per_run']} admitters on {out['backend']}, "
        f"one SIGKILLed per run (Prefect server: {out['prefect_server']}; seed {out['seed']}, "
        f"{out['cpus']} CPUs, {out['wall_s']:.0f} s, median run {out['run_s_median']} s)",
        "",
        table(["Phase chosen", "Faults injected"], phases),
        "",
        table(["Where the kill landed (phase, last step mark)", "Kills"], landed),
        "",
        table(["Reconcile action", "Jobs"], reconciled or [["-", "0"]]),
        "",
        table(["After each run's reconcile", "Sum"], per_run),
        "",
        table(["Waiting for every lease to expire", "Value"], waited),
        "",
        table(["End state (whole ledger)", "Value"], figures),
    ]
    if out["fault_runs"]:
        sections += [
            "",
            f"{out['fault_runs']} fault runs, guaranteed mode (max_runtime "
            f"{FAULT_MAX_RUNTIME_S:.0f} s, grace {FAULT_GRACE_S:.0f} s)",
            "",
            table(["Fault", "Injected"], fault_rows),
        ]
    if out["messages"]:
        sections += ["", "Findings", "", *[f"- {m}" for m in out["messages"]]]
    sections += ["", "Nothing lost." if not out["lost"] else f"LOST: {out['lost']}"]
    return "\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs, one random kill each")
    parser.add_argument("--url", help="SQLAlchemy URL of the ledger (default: SQLite, temp)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--api-url",
        help="a running Prefect server with its lease repossessor (default: start one)",
    )
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    marks = [f"{side}{call}" for call in STEPS for side in "><"]
    parser.add_argument(
        "--park-at",
        default="",
        help=f"after the random runs, one run per step mark, of {','.join(marks)}",
    )
    parser.add_argument(
        "--faults", default="", help=f"after the kills, runs of each of {','.join(FAULTS)}"
    )
    parser.add_argument("--fault-repeat", type=int, default=1, help="runs of each fault")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    phases = tuple(args.phases.split(","))
    if not phases or not set(phases) <= set(PHASES):
        parser.error(f"--phases: a comma-separated subset of {','.join(PHASES)}")
    park_at = tuple(m for m in args.park_at.split(",") if m)
    if not set(park_at) <= set(marks):
        parser.error(f"--park-at: comma-separated marks of {','.join(marks)}")
    faults = tuple(f for f in args.faults.split(",") if f)
    if not set(faults) <= set(FAULTS) or args.fault_repeat < 1:
        parser.error(f"--faults: comma-separated kinds of {','.join(FAULTS)}; --fault-repeat >= 1")
    if args.runs < 0 or args.runs + len(park_at) + len(faults) == 0:
        parser.error("nothing to run: --runs N (N > 0), --park-at or --faults")
    out = run(
        args.runs, args.url, args.seed, args.api_url, phases, park_at, faults, args.fault_repeat
    )
    print(json.dumps(out, indent=2) if args.json else report(out))
    sys.exit(1 if out["lost"] else 0)


if __name__ == "__main__":
    main()

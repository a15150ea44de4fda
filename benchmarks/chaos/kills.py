"""One kill run: workers forked at once, the victim SIGKILLed in its phase (at a random moment,
or exactly at a step mark), reconcile, the others finished, the run's org audited."""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from benchmarks.chaos.checks import last_actions, reconcile_tracked, settle_again
from benchmarks.chaos.config import (
    FINISH_S,
    OTHER_JOB_S,
    PHASE_END,
    PHASES,
    REACH_S,
    STALE_S,
    VICTIM_JOB_S,
    WORKERS,
    budgets,
)
from benchmarks.chaos.state import RunResult, Setup
from benchmarks.chaos.worker import WorkerSpec, worker
from prefect_gpu_budget.admission.audit import audit, local_job_running
from prefect_gpu_budget.admission.ledger import ACTIVE, Ledger
from prefect_gpu_budget.units import org_of


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
            for r in ledger.views.orphans(stale_after=STALE_S)
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
        setup.ledger.config.set_budget(rule)
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

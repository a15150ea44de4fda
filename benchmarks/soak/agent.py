"""One agent process, one session scope: `Agent` submits the job mix against the real `Gate`
and samples itself; `agent_main` is the process's entry (`python -m benchmarks.soak --agent`)."""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.host import own_figures
from benchmarks.soak.config import (
    DRAIN_S,
    DUMP_SIGNAL,
    IN_FLIGHT,
    INSTANCE,
    KILL_GRACE_S,
    MAX_RUNTIME_S,
    RUN_S,
    THINK_S,
    AgentConfig,
)
from benchmarks.soak.jobs import Runner, Sleeper
from benchmarks.soak.recording import Recorder, TimedLedger, TimedLimits
from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.holding import Admission, GateEvents
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.rules.policy import BudgetRule, Decision
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog


class Cancelled(BaseException):
    """A cancellation that arrives while a job waits, like Ctrl-C or a task time-out."""


class Stuck(BaseException):
    """Raised in a job still waiting `DRAIN_S` after the run ended, so the agent can stop."""


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
        pool = self.ledger.db.engine.pool
        return {
            "t": time.time(),
            **own_figures(),
            "pool_idle": pool.checkedin(),
            "pool_out": pool.checkedout(),
        }

    def warm_up(self) -> None:
        """One job through the whole path before the clock starts (imports, pools, limits),
        and the ledger's pool filled to its steady size, so that connections the pool opens
        lazily later are not taken for a leak."""
        pool = self.ledger.db.engine.pool
        held = [self.ledger.db.engine.connect() for _ in range(pool.size())]
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
            self.gate.holding.settle(admission, ended_at=time.time(), outcome="withdrawn")
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
    ledger.db.dispose()

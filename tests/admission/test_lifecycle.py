"""An admitted job's life (`admission/lifecycle.py`) without Prefect or a ledger: a recording
gate and a scripted launcher show it settles once however the job ends, names a stop for
preemption `preempted`, and says when to requeue; `Running` (every runner's life after
admission) records the start once and stops a job once, at its deadline or when its admission
must stop, however many ask; `Settlement` settles once, from any thread, as the body's ending
names it. Two tests run a real job through a real gate (PostgreSQL and SQLite): one, with a
Prefect server's limits, counts the threads it holds; one sees the job handed its ledger id."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from typing import Any

import pytest

from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.ledger import STOPPED
from prefect_gpu_budget.admission.lifecycle import (
    PREEMPTED,
    PastMaxRuntime,
    Running,
    Settlement,
    StopAsked,
    outcome_of,
    run_admitted,
)
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchResult, Probe
from prefect_gpu_budget.settings import JOB_ID_ENV


class RecordingGate:
    """What the lifecycle calls on a gate (its `holding`), recorded; from a job's start, a
    thread hands a stop over to its life (`Admission.on_stop`), looking every 10 ms, as the
    admission's own thread does (`Holding.hold`)."""

    def __init__(self, looks: bool = True, reason: str = "") -> None:
        self.calls: list[tuple[str, Any]] = []
        self.holding = self  # the gate's `Holding`: started, submitted, settle
        self.looks = looks
        """False: the admission's thread never gets to hand a stop over (stuck on the ledger)."""
        self.reason = reason
        """The settled row's reason: the words its stopper wrote (`ask_stop`)."""

    def started(self, admission: Admission, at: float, external_id: str | None = None) -> None:
        self.calls.append(("started", external_id))
        if self.looks:
            threading.Thread(target=_looks, args=(admission,), daemon=True).start()

    def submitted(self, admission: Admission, external_id: str) -> None:
        self.calls.append(("submitted", external_id))

    def settle(self, admission: Admission, *, ended_at: float, outcome: str, **kw: Any) -> dict:
        self.calls.append(("settle", outcome))
        stopper = {"reason": self.reason} if self.reason else {}
        return {"outcome": outcome, "ended_at": ended_at, **stopper, **kw}

    def settles(self) -> list[str]:
        return [what for call, what in self.calls if call == "settle"]


def _looks(admission: Admission, most_s: float = 60.0) -> None:
    """As the admission's thread does: once `preempted` is set, hand the stop over to the
    job's life (`Admission.on_stop`), once (or give up after `most_s`)."""
    until = time.monotonic() + most_s
    while time.monotonic() < until:
        on_stop = admission.on_stop
        if admission.preempted.is_set() and on_stop is not None:
            admission.on_stop = None
            on_stop()
            return
        time.sleep(0.01)


class Scripted:
    """Starts, then waits until stopped or `run_s` passes; or raises `error` once started."""

    kind = "local"

    def __init__(self, run_s: float = 0.0, error: BaseException | None = None) -> None:
        self.run_s, self.error = run_s, error
        self.stopped = threading.Event()
        self.stops: list[str] = []

    def preflight(self, job: GpuJob, quote: Any) -> None: ...

    def run(self, job: GpuJob, quote: Any, *, on_start, log, env=None, on_submit=None):
        on_submit("ext-1")
        began = time.time()
        on_start(began, "ext-1")
        if self.error is not None:
            raise self.error
        self.stopped.wait(self.run_s)
        outcome = "cancelled" if self.stopped.is_set() else "completed"
        return LaunchResult(outcome, began, time.time(), exit_code=0, detail="done")

    def probe(self, external_id: str) -> Probe:
        return Probe("unknown")

    def stop(self, external_id: str, grace: float = 10.0) -> None:
        self.stops.append(external_id)
        self.stopped.set()


def _admission(pool: str | None = None, requeue: bool = True) -> Admission:
    job = GpuJob(instance_type="local:box", command=["true"], max_runtime="1m", requeue=requeue)
    return Admission("job-1", "lab/s", job, None, 0, 0.0, "fits", pool=pool)  # type: ignore[arg-type]


def test_a_job_that_ends_settles_once_from_its_result() -> None:
    gate = RecordingGate()
    ended = run_admitted(gate, _admission(), Scripted())  # type: ignore[arg-type]
    assert gate.calls == [("submitted", "ext-1"), ("started", "ext-1"), ("settle", "completed")]
    assert ended.result.outcome == "completed" and not ended.requeue


@pytest.mark.parametrize("error", [RuntimeError("crashed"), KeyboardInterrupt()])
def test_a_job_whose_launcher_raises_settles_once_as_cancelled(error: BaseException) -> None:
    gate, phases = RecordingGate(), []
    with pytest.raises(type(error)):
        run_admitted(gate, _admission(), Scripted(error=error), phase=phases.append)  # type: ignore[arg-type]
    assert gate.settles() == ["cancelled"]
    assert phases == ["started", "settling"]


def test_a_preempted_job_is_stopped_named_preempted_and_requeued() -> None:
    gate, admission, launcher = RecordingGate(), _admission(pool="lab"), Scripted(run_s=30)
    threading.Timer(0.2, admission.preempted.set).start()
    began = time.time()
    ended = run_admitted(gate, admission, launcher)  # type: ignore[arg-type]
    assert time.time() - began < 5
    assert launcher.stops == ["ext-1"]
    assert ended.result.outcome == PREEMPTED and ended.result.detail.startswith("preempted: ")
    assert gate.settles() == [PREEMPTED] and ended.requeue


def test_a_job_preempted_before_it_starts_is_stopped_as_it_starts() -> None:
    gate, admission, launcher = RecordingGate(), _admission(pool="lab", requeue=False), Scripted(30)
    admission.preempted.set()
    ended = run_admitted(gate, admission, launcher)  # type: ignore[arg-type]
    assert launcher.stops == ["ext-1"]
    assert ended.result.outcome == PREEMPTED and not ended.requeue


@pytest.mark.parametrize(
    ("reason", "detail"),
    [("stopped by its agent", "stopped by its agent (done)"), ("", "stopped by its owner (done)")],
)
def test_a_job_its_owner_stops_is_stopped_named_cancelled_and_not_requeued(
    reason: str, detail: str
) -> None:
    """Outside a pool too: an agent's `POST /v1/jobs/{id}/cancel` of its running trial. Its
    end is worded as its row words it: in its stopper's words (else `stopped by its owner`)."""
    gate, admission = RecordingGate(reason=reason), _admission(pool=None)
    launcher = Scripted(run_s=30)
    admission.stop_reason = STOPPED
    threading.Timer(0.2, admission.preempted.set).start()
    began = time.time()
    ended = run_admitted(gate, admission, launcher)  # type: ignore[arg-type]
    assert time.time() - began < 5
    assert launcher.stops == ["ext-1"]
    assert ended.result.outcome == "cancelled" and not ended.requeue
    assert ended.result.detail == detail and ended.stopped == STOPPED
    assert gate.settles() == ["cancelled"]


class Stops:
    """A runner's stop, counted."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.called = threading.Event()

    def __call__(self) -> None:
        self.calls.append(time.time())
        self.called.set()


def _ends_when_stopped(running: Running, stops: Stops, error: BaseException) -> dict:
    assert stops.called.wait(30), "never stopped"
    return running.ended(error)


def test_running_stops_a_job_at_its_deadline_once_and_names_it_timed_out() -> None:
    gate, stops = RecordingGate(), Stops()
    job = GpuJob(instance_type="local:box", command=["true"], max_runtime="1s")
    admission = Admission("job-1", "lab/s", job, None, 0, 0.0, "fits")  # type: ignore[arg-type]
    running = Running(gate, admission, deadline=True)  # type: ignore[arg-type]
    began = time.time()
    running.started(began, "pid:1", stops)
    running.started(began + 5, "pid:2", stops)  # a second start records nothing
    row = _ends_when_stopped(running, stops, RuntimeError("killed by the stop"))
    assert stops.calls[0] >= began + 1.0  # not before max_runtime
    running.stop(PREEMPTED)  # after it ended: nothing more is sent
    assert len(stops.calls) == 1 and running.stopped == "timed_out"
    assert gate.calls[0] == ("started", "pid:1") and gate.settles() == ["timed_out"]
    assert row["outcome"] == "timed_out" and not running.requeue


def test_the_deadline_does_not_wait_for_the_admissions_thread() -> None:
    """The admission's one thread also waits on the ledger and Prefect (a heartbeat, a lease
    renewal that hangs): a worker run's max_runtime is kept by a timer of its own, not by it."""
    gate, stops = RecordingGate(looks=False), Stops()
    job = GpuJob(instance_type="local:box", command=["true"], max_runtime="1s")
    admission = Admission("job-2", "lab/s", job, None, 0, 0.0, "fits")  # type: ignore[arg-type]
    running = Running(gate, admission, deadline=True)  # type: ignore[arg-type]
    began = time.time()
    running.started(began, "pid:1", stops)
    assert stops.called.wait(10), "the deadline waited for a look that never came"
    assert began + 1.0 <= stops.calls[0] < began + 5
    assert running.ended(RuntimeError("killed"))["outcome"] == "timed_out"


@pytest.mark.parametrize(("why", "outcome"), [(PREEMPTED, "preempted"), (STOPPED, "cancelled")])
def test_running_stops_a_job_asked_to_stop_before_it_was_stoppable(why: str, outcome: str) -> None:
    """A stop asked between the admission and the start stops the job as it starts."""
    gate, stops, admission = RecordingGate(), Stops(), _admission(pool="lab")
    admission.stop_reason = why
    admission.preempted.set()
    running = Running(gate, admission)  # type: ignore[arg-type]
    running.started(time.time(), "task:1")  # recorded; not stoppable yet
    time.sleep(0.05)
    assert not stops.calls
    running.stoppable(stops)
    row = _ends_when_stopped(running, stops, StopAsked(why))
    assert len(stops.calls) == 1 and row["outcome"] == outcome
    assert running.requeue == (why == PREEMPTED)  # only a preemption is queued again


def test_a_job_that_ended_before_its_stop_keeps_its_own_outcome() -> None:
    gate, stops, admission = RecordingGate(), Stops(), _admission(pool="lab")
    running = Running(gate, admission)  # type: ignore[arg-type]
    running.started(time.time(), "pid:1", stops)
    row = running.ended(returned="completed")
    admission.preempted.set()  # too late: the job is over
    time.sleep(0.1)
    assert not stops.calls and row["outcome"] == "completed" and not running.requeue


ENDINGS = [  # how the body ended, what it named its return, the outcome
    (None, "completed", "completed"),
    (None, "failed", "failed"),  # a worker's run that exited non-zero
    (None, "timed_out", "timed_out"),  # a worker's run stopped at max_runtime
    (PastMaxRuntime("past max_runtime"), "completed", "timed_out"),
    (StopAsked(PREEMPTED), "completed", "preempted"),  # a body whose capacity was reclaimed
    (StopAsked(STOPPED), "completed", "cancelled"),  # a body its owner stopped
    (RuntimeError("crashed"), "completed", "failed"),
    (TimeoutError("the body's own"), "completed", "failed"),  # not a stop at max_runtime
    (KeyboardInterrupt(), "completed", "cancelled"),
    (asyncio.CancelledError(), "completed", "cancelled"),
    (SystemExit(1), "completed", "cancelled"),
]


@pytest.mark.parametrize(("error", "returned", "outcome"), ENDINGS)
def test_a_body_is_settled_once_as_its_ending_names_it(
    error: BaseException | None, returned: str, outcome: str
) -> None:
    assert outcome_of(error, returned) == outcome
    gate = RecordingGate()
    running = Running(gate, _admission())  # type: ignore[arg-type]
    row = running.ended(error, returned=returned, ended_at=12.0, billed_seconds=3.0)
    assert gate.settles() == [outcome] and running.settlement.row is row
    assert row == {
        "outcome": outcome,
        "ended_at": 12.0,
        "billed_seconds": 3.0,
        "actual_micro": None,
    }


def test_a_settlement_asked_again_keeps_the_first_row() -> None:
    gate, released = RecordingGate(), []
    settlement = Settlement(gate, _admission(), then=partial(released.append, "gpus"))  # type: ignore[arg-type]
    assert settlement.row is None
    before = time.time()
    first = settlement.settle("completed")
    assert before <= first["ended_at"] <= time.time()  # ended now when not told
    assert settlement.settle("failed") is first
    assert settlement.settle("cancelled", ended_at=1.0) is first
    assert gate.settles() == ["completed"] and released == ["gpus"]


class SlowGate(RecordingGate):
    """Settles slowly, counting settlements, so that calls from other threads overlap it."""

    def __init__(self) -> None:
        super().__init__()
        self.settling = threading.Event()

    def settle(self, admission: Admission, *, ended_at: float, outcome: str, **kw: Any) -> dict:
        self.settling.set()
        time.sleep(0.2)
        return super().settle(admission, ended_at=ended_at, outcome=outcome, **kw)


def test_concurrent_settlements_settle_once_and_share_the_row() -> None:
    gate, released = SlowGate(), []
    settlement = Settlement(gate, _admission(), then=partial(released.append, "gpus"))  # type: ignore[arg-type]
    outcomes = ["completed", "failed", "cancelled", "timed_out"] * 4
    rows: list[dict] = []
    start = threading.Barrier(len(outcomes))

    def settle(outcome: str) -> None:
        start.wait()
        rows.append(settlement.settle(outcome))

    threads = [threading.Thread(target=settle, args=(o,)) for o in outcomes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(rows) == len(outcomes) and all(row is rows[0] for row in rows)
    assert len(gate.settles()) == 1 and released == ["gpus"]
    assert rows[0]["outcome"] in outcomes


class DownThenUpGate(RecordingGate):
    """Its first settlement raises (the ledger down past the gate's patience)."""

    def settle(self, admission: Admission, *, ended_at: float, outcome: str, **kw: Any) -> dict:
        if not self.calls:
            self.calls.append(("down", outcome))
            raise ConnectionError("ledger down")
        return super().settle(admission, ended_at=ended_at, outcome=outcome, **kw)


def test_a_settlement_that_raised_is_tried_again_and_gives_back_once() -> None:
    gate, released = DownThenUpGate(), []
    settlement = Settlement(gate, _admission(), then=partial(released.append, "gpus"))  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        settlement.settle("completed")
    assert settlement.row is None and released == ["gpus"]  # given back though unsettled
    assert settlement.settle("completed")["outcome"] == "completed"
    assert gate.settles() == ["completed"] and released == ["gpus"]


class PeakThreads:
    """The most threads alive at once, sampled every 10 ms while `holding` is set, that were
    not alive when it was made (the sampler itself and the process's one ledger watcher,
    shared by every job, aside)."""

    def __init__(self) -> None:
        self.before = {t.ident for t in threading.enumerate()}
        self.holding, self.done = threading.Event(), threading.Event()
        self.peak: list[str] = []
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.before.add(self._thread.ident)
        self._thread.start()

    def _sample(self) -> None:
        me = threading.current_thread().ident
        while not self.done.wait(0.01):
            if not self.holding.is_set():
                continue
            names = [
                t.name
                for t in threading.enumerate()
                if t.ident not in self.before
                and t.ident != me
                and not t.name.startswith("gpu-budget-watcher")
            ]
            if len(names) > len(self.peak):
                self.peak = names

    def stop(self) -> list[str]:
        self.done.set()
        self._thread.join(5)
        return self.peak


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_pool", [False, True])
def test_an_admitted_job_holds_at_most_five_threads(ledger, prefect_api, tmp_path, in_pool):
    """From its admission until it is settled, a job run by the local launcher through a gate
    with Prefect's limits (an hourly cap), in a capacity pool or not, holds at most 5 threads
    at once: its one thread (`Holding.hold`: its heartbeat, which also renews its lease, polls
    for a stop and hands it over to `Running`), the launcher's output pump, and the short
    hand-offs that record its start and its settlement."""
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.limits import RateLimits
    from prefect_gpu_budget.admission.rules.policy import BudgetRule
    from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional
    from prefect_gpu_budget.launchers.local import LocalLauncher
    from prefect_gpu_budget.pricing.catalog import Catalog, set_local_price

    prices = set_local_price("h100x8", "8", gpus=8, path=tmp_path / "prices.csv")
    ledger.config.set_budget(
        BudgetRule("threads", hourly_cap_cents=10_000, period_budget_micro=10**9)
    )
    ledger.config.set_budget(BudgetRule("threads/a"))
    if in_pool:
        pool = Pool("threads", "lab-t", 2, (8, 192, 2048), ("local:h100x8",), "H100")
        ledger.config.set_pool(pool, [TeamQuota("lab-t", "threads/a", proportional(pool, 8))])
    limits = RateLimits()
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    job = GpuJob(instance_type="local:h100x8", max_runtime="1m", command=["sleep", "1"])
    try:
        peaks = []
        for _ in range(2):  # the first warms what a process starts once (its ledger watcher)
            peak = PeakThreads()
            admission = gate.admit(job, "threads/a/s")
            assert (admission.pool is not None) == in_pool
            peak.holding.set()
            ended = run_admitted(gate, admission, LocalLauncher())
            peaks.append(peak.stop())
            assert ended.row["outcome"] == "completed"
    finally:
        limits.close()
    held = peaks[-1]
    print(f"threads an admitted job holds at most at once (pool: {in_pool}): {len(held)} {held}")
    assert 2 <= len(held) <= 5, held  # its one thread and the pump at least; never above 5
    assert sum("heartbeat" in name for name in held) == 1, held
    assert not any("running" in name for name in held), held  # no second watch of its own


@pytest.mark.timeout(120)
def test_the_job_is_handed_its_ledger_job_id(ledger, prices) -> None:
    """`run_admitted` hands the launcher, and through it the job's own process, the job's
    ledger id as GPU_BUDGET_JOB_ID (a cloud launcher marks the cloud's job with it), over any
    the caller's env holds, beside the rest of that env."""
    from prefect_gpu_budget.admission.gate import Gate
    from prefect_gpu_budget.admission.rules.policy import BudgetRule
    from prefect_gpu_budget.launchers.local import LocalLauncher

    ledger.config.set_budget(BudgetRule("ids", hourly_cap_cents=1_000, period_budget_micro=10**8))
    ledger.config.set_budget(BudgetRule("ids/a"))
    gate = Gate(ledger)
    said = 'echo "job $GPU_BUDGET_JOB_ID seed $SEED"'
    job = GpuJob(instance_type="local:box", max_runtime="1m", command=["sh", "-c", said])
    admission = gate.admit(job, "ids/a/s")
    lines: list[str] = []
    env = {"SEED": "7", JOB_ID_ENV: "not-its-id"}
    ended = run_admitted(gate, admission, LocalLauncher(), env=env, log=lines.append)

    row = ledger.views.job(admission.job_id)
    assert ended.row["outcome"] == row["outcome"] == "completed"
    assert f"job {row['id']} seed 7" in lines, lines

"""An admitted job's life (`admission/lifecycle.py`) without Prefect or a ledger: a recording
gate and a scripted launcher show it settles once however the job ends, names a stop for
preemption `preempted`, and says when to requeue; `Settlement` settles once, from any thread,
as the body's ending names it."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from typing import Any

import pytest

from prefect_gpu_budget.admission.gate import Admission
from prefect_gpu_budget.admission.ledger import STOPPED
from prefect_gpu_budget.admission.lifecycle import (
    PREEMPTED,
    PastMaxRuntime,
    Settlement,
    outcome_of,
    run_admitted,
)
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import LaunchResult, Probe


class RecordingGate:
    """What the lifecycle calls on a gate, recorded."""

    preempt_poll_s = 0.01

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def started(self, admission: Admission, at: float, external_id: str | None = None) -> None:
        self.calls.append(("started", external_id))

    def submitted(self, admission: Admission, external_id: str) -> None:
        self.calls.append(("submitted", external_id))

    def settle(self, admission: Admission, *, ended_at: float, outcome: str, **kw: Any) -> dict:
        self.calls.append(("settle", outcome))
        return {"outcome": outcome, "ended_at": ended_at, **kw}

    def settles(self) -> list[str]:
        return [what for call, what in self.calls if call == "settle"]


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


def test_a_job_its_owner_stops_is_stopped_named_cancelled_and_not_requeued() -> None:
    """Outside a pool too: an agent's `POST /v1/jobs/{id}/cancel` of its running trial."""
    gate, admission, launcher = RecordingGate(), _admission(pool=None), Scripted(run_s=30)
    admission.stop_reason = STOPPED
    threading.Timer(0.2, admission.preempted.set).start()
    began = time.time()
    ended = run_admitted(gate, admission, launcher)  # type: ignore[arg-type]
    assert time.time() - began < 5
    assert launcher.stops == ["ext-1"]
    assert ended.result.outcome == "cancelled" and not ended.requeue
    assert ended.result.detail.startswith("stopped by its owner")
    assert gate.settles() == ["cancelled"]


ENDINGS = [  # how the body ended, what it named its return, the outcome
    (None, "completed", "completed"),
    (None, "failed", "failed"),  # a worker's run that exited non-zero
    (None, "timed_out", "timed_out"),  # a worker's run stopped at max_runtime
    (PastMaxRuntime("past max_runtime"), "completed", "timed_out"),
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
    settlement = Settlement(gate, _admission())  # type: ignore[arg-type]
    row = settlement.ended(error, returned=returned, ended_at=12.0, billed_seconds=3.0)
    assert gate.settles() == [outcome] and settlement.row is row
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
    assert settlement.ended(RuntimeError("late")) is first
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

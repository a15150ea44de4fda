"""How an agent runs the jobs it got admitted: `Sleeper`, a launcher whose job sleeps in the
agent's process, and `Runner`, a thread per job through the job's life (`admission/lifecycle.py`).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from benchmarks.soak.recording import Recorder
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.base import (
    LaunchResult,
    Probe,
    StartHook,
    StartRecord,
    SubmitHook,
    ignore_submission,
)


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

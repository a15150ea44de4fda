"""A deployment launcher's flow run as `follow` reads and stops it, and when its bill may end:
it says it is over, max_runtime has passed since its start, and none of its processes is seen on
this host (`launchers/deployment.py` says why its end is nothing the job cannot forge)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling

from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers import flow_runs
from prefect_gpu_budget.launchers.base import LaunchResult
from prefect_gpu_budget.launchers.follow import Remote, Seen, Stop, first_line

logger = logging.getLogger("prefect_gpu_budget.launchers.deployment")


class FlowRunLauncher(Protocol):
    """What a followed flow run needs of the launcher that created it (`DeploymentLauncher`)."""

    start_timeout: float | None
    cancel_wait_s: float

    def cancel_flow_run(self, flow_run_id: UUID, why: str, log: Callable[[str], None]) -> None:
        """Ask for the flow run's cancellation, as `prefect flow-run cancel` does."""


PROCESS_ENDED_EVENT = "prefect.worker.executed-flow-run"
"""What a worker emits once the process of a flow run it started has exited (anyone with the
run's API access can emit it too: it may lengthen a bill, never end one)."""
END_NOT_OBSERVED = "end not observed: billed to max_runtime"
"""What a job's detail and log say when nothing later than max_runtime was reported or seen."""


def _billed_to(ended: float, deadline: float) -> str:
    """How a bill that ran past max_runtime ended."""
    return f"billed {ended - deadline:.1f}s past max_runtime, to its last reported or seen end"


@dataclass
class FollowedFlowRun(Remote[FlowRun]):
    """A flow run as `follow` reads and stops it (`Cancelling`, as `prefect flow-run cancel`
    does), and when its bill may end (see the module's docstring): it says it is over,
    max_runtime has passed since its start, and none of its processes is seen on this host. A
    deleted flow run is billed as one that says it is over."""

    launcher: FlowRunLauncher
    client: SyncPrefectClient
    flow_run: FlowRun
    job: GpuJob
    log: Callable[[str], None]
    deleted: float | None = None  # when it was found deleted
    over: bool = False  # it said it is over (or was deleted): latched
    claimed: float = 0.0  # the latest end it reported
    asked: float | None = None  # when it was asked to end (cancelled, or set Cancelling)
    checked: bool = False  # its end looked at, at max_runtime
    suspicion: str = ""  # why its end looks forged
    seen_late: bool = False  # one of its processes seen here past max_runtime
    killed: bool = False  # what of it still ran here was killed
    told_over: bool = False  # said once: it says it ended (before max_runtime)
    told_overdue: bool = False  # said once: it has not ended since it was asked to

    def __post_init__(self) -> None:
        self.run_id = self.flow_run.id
        self.name = f"flow run {self.run_id}"
        self.created = flow_runs.epoch(self.flow_run.created) or time.time()
        self.grace = self.job.kill_grace + self.launcher.cancel_wait_s
        """How long a flow run asked to end may take (and its worker's report of its end)."""

    def read(self) -> Seen[FlowRun]:
        try:
            self.flow_run = self.client.read_flow_run(self.run_id)
        except ObjectNotFound:  # as good as a claim that it is over: billed the same
            if self.deleted is None:
                self.deleted = time.time()
                self.over = True
                self.claimed = max(self.claimed, self.deleted)
        if self.deleted is not None:  # started then, if it was not seen to start before
            line = f"flow run {self.run_id} was deleted; its processes may still run"
            return Seen(self.flow_run, "deleted", line, self.deleted, over=True)
        flow_run = self.flow_run
        if flow_runs.over(flow_run):
            self.over = True
            self.claimed = max(self.claimed, flow_runs.ended_at(flow_run))
        state, start = flow_run.state, flow_run.start_time
        return Seen(
            flow_run,
            None if state is None else (state.type, state.name, state.message),
            flow_runs.state_line(flow_run),
            start.timestamp() if start is not None and flow_runs.ran(flow_run) else None,
            over=self.over,
        )

    def limit(self, started: float | None) -> tuple[float, Stop] | None:
        """max_runtime from its start; `start_timeout` from its creation, while not started."""
        runtime, timeout = self.job.max_runtime, self.launcher.start_timeout
        if started is not None:
            return started + runtime, Stop("timed_out", f"max_runtime {runtime:.0f}s reached")
        if timeout is None:
            return None
        return self.created + timeout, Stop("wait_expired", f"not started within {timeout:.0f}s")

    def stop(self, stop: Stop) -> bool:
        try:
            self.launcher.cancel_flow_run(self.run_id, stop.why, self.log)
        except Exception as exc:
            if stop.outcome == "cancelled":  # its start went unrecorded: the run ends here
                raise
            self.log(f"could not cancel flow run {self.run_id}, retrying: {first_line(exc)}")
            return False
        if stop.outcome != "wait_expired" and self.asked is None:
            self.asked = time.time()
        return True

    def end(
        self, seen: Seen[FlowRun], started: float | None, stopped: Stop | None, now: float
    ) -> LaunchResult | None:
        """Its result once its bill may end (None until then), in four steps: 1. what is seen
        of it here past max_runtime; 2. a claim of an end before max_runtime, said once; 3. at
        max_runtime, its end looked at (`_check_end`); 4. what still runs here after it was
        asked to end is killed, or said to run on (`_enforce`)."""
        flow_run = seen.job
        if started is None:  # over before it started: it never ran, nothing to meter
            ended = flow_runs.ended_at(flow_run)
            return self._result(flow_run, None, stopped, ended) if seen.over else None
        deadline = started + self.job.max_runtime
        pids = flow_runs.seen_here(self.run_id) if now >= deadline else []  # before: billed anyway
        scanned = time.time()  # none of them seen by now: the earliest end to bill
        self.seen_late = self.seen_late or bool(pids)
        if self.over and now < deadline:
            self._tell_over_early()
        if now >= deadline and not self.checked:
            self._check_end(flow_run, pids, stopped, now, deadline)
        if self.asked is not None and now >= self.asked + self.grace:
            self._enforce(pids)
        if not (self.over and self.checked and not pids):
            return None
        return self._billed_result(flow_run, started, stopped, deadline, scanned)

    def _tell_over_early(self) -> None:
        """Say once that it claims an end before max_runtime, which is billed all the same."""
        if not self.told_over:
            self.told_over = True
            self.log(
                f"flow run {self.run_id} says it ended; its end is not observed: billed to "
                f"max_runtime {self.job.max_runtime:.0f}s, its slot held until then"
            )

    def _check_end(
        self, flow_run: FlowRun, pids: list[int], stopped: Stop | None, now: float, deadline: float
    ) -> None:
        """At max_runtime: one not over is stopped (`follow` asks until it can); one over is
        checked once its worker's report is in (events land late) or its grace is up, and
        distrusted (`_distrust`) if its end looks forged."""
        if not self.over:
            self.checked = stopped is not None
            self.asked = now if self.checked and self.asked is None else self.asked
            return
        waiting_for_report = (
            not pids
            and self.deleted is None
            and now < deadline + self.grace
            and self._process_ended() is None
        )
        if waiting_for_report:
            return
        self.checked = True
        self.suspicion = self._suspicion(flow_run, pids)
        if self.suspicion:
            self.asked = now
            self._distrust(flow_run)

    def _enforce(self, pids: list[int]) -> None:
        """Its grace since it was asked to end is up: kill what of it still runs here (once),
        or say once that it has not ended (it stays metered until it does)."""
        if pids and not self.killed:
            self.killed = True
            flow_runs.kill_left(self.run_id, pids, self.log)
        elif not self.over and not self.told_overdue:
            self.told_overdue = True
            self.log(f"flow run {self.run_id} has not ended since it was cancelled; still metered")

    def _billed_result(
        self,
        flow_run: FlowRun,
        started: float,
        stopped: Stop | None,
        deadline: float,
        scanned: float,
    ) -> LaunchResult:
        """Its result, billed to the latest of max_runtime, its claimed end, its worker's
        report, and (seen here late) the moment none of its processes was seen."""
        reported = self._process_ended() or 0.0
        ended = max(deadline, self.claimed, reported, scanned if self.seen_late else 0.0)
        how = END_NOT_OBSERVED if ended == deadline else _billed_to(ended, deadline)
        detail = "; ".join(x for x in (self.suspicion, how) if x)
        self.log(f"flow run {self.run_id}: {detail}")
        return self._result(flow_run, started, stopped, ended, detail)

    def _process_ended(self) -> float | None:
        """When a worker reported the flow run's process ended (its executed-flow-run event),
        or None while none has (or the events cannot be read). Anyone with the run's API
        access can post this event: it may lengthen a bill, never end one."""
        from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

        wanted = EventFilter(
            event=EventNameFilter(name=[PROCESS_ENDED_EVENT]),
            related=EventRelatedFilter(
                resources_in_roles=[(f"prefect.flow-run.{self.run_id}", "flow-run")]
            ),
        )
        try:
            page = self.client.read_events(filter=wanted, limit=5)
        except Exception:  # the API is down: nothing reported
            return None
        times = [event.occurred.timestamp() for event in page.events]
        return max(times) if times else None

    def _suspicion(self, flow_run: FlowRun, pids: list[int]) -> str:
        """Why a flow run that says it is over, at max_runtime, looks like it runs on ("" if
        nothing says so; nothing can prove that it does not)."""
        name = f"flow run {flow_run.name} ({flow_run.id})"
        state = flow_run.state.name if flow_run.state else "?"
        said = "was deleted" if self.deleted is not None else f"is {state}"
        if pids:
            return f"suspicious end: {name} {said}, but {len(pids)} of its processes still run here"
        if self.deleted is None and self._process_ended() is None:
            return (
                f"suspicious end: {name} {said}, but no worker reported its process ended; its "
                "state may have been set through the API while the job ran on"
            )
        return ""

    def _distrust(self, flow_run: FlowRun) -> None:
        """Say a suspicious end loudly, and set the flow run Cancelling so that its worker
        kills its process (by its infrastructure_pid) if it still runs."""
        warning = f"{self.suspicion}. Billed to max_runtime {self.job.max_runtime:.0f}s at least"
        logger.warning("%s", warning)
        self.log(warning)
        if self.deleted is not None:
            return
        try:
            self.client.set_flow_run_state(
                flow_run.id, Cancelling(message="Cancelled: suspicious end"), force=True
            )
        except Exception as exc:  # billed to max_runtime either way
            self.log(f"could not cancel flow run {flow_run.id}: {first_line(exc)}")

    def _result(
        self,
        flow_run: FlowRun,
        started: float | None,
        stopped: Stop | None,
        ended: float,
        detail: str = "",
    ) -> LaunchResult:
        """The outcome its state and the stop that ended it say (a suspicious end: timed
        out; a deleted flow run: failed), from `started` (None: it never ran) to `ended`."""
        stopped_for = "timed_out" if self.suspicion else stopped.outcome if stopped else None
        if self.deleted is not None:
            outcome, said = "failed", "the flow run was deleted"
        else:
            assert flow_run.state is not None
            outcome = flow_runs.OUTCOME_OF.get(flow_run.state.type, "failed")
            if outcome != "completed" and stopped_for == "timed_out":
                outcome = "timed_out"
            elif outcome == "cancelled" and stopped_for == "wait_expired" and started is None:
                outcome = "wait_expired"
            message = flow_run.state.message
            said = flow_run.state.name + (f": {message}" if message else "")
        began = ended if started is None else started
        return LaunchResult(
            outcome,
            began,
            ended,
            detail=f"{said}; {detail}" if detail else said,
            external_id=str(flow_run.id),
            capacity_wait_s=max(0.0, began - self.created),
        )

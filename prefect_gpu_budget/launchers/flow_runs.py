"""What a flow run's record says of it (whether it ran, whether it is over, when it ended, its
state in a line, its outcome) and its processes on this host, as the deployment launcher
reads them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from datetime import datetime
from uuid import UUID

from prefect.client.schemas.objects import FlowRun, StateType

from prefect_gpu_budget.launchers.local import marked_processes

RUN_ID_ENV = "PREFECT__FLOW_RUN_ID"
"""The variable every Prefect worker and runner gives a flow run's process: how the launcher
finds the run's processes on its own host."""
OUTCOME_OF = {
    StateType.COMPLETED: "completed",
    StateType.FAILED: "failed",
    StateType.CRASHED: "failed",
    StateType.CANCELLED: "cancelled",
    StateType.CANCELLING: "cancelled",  # only when it never ran: see `over`
}


def epoch(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def ran(flow_run: FlowRun) -> bool:
    """Whether the flow run ever entered Running. (At a final state the server fills in a
    never-run flow run's start_time with its end time, so start_time alone cannot tell.)"""
    return flow_run.run_count > 0


def over(flow_run: FlowRun) -> bool:
    """Final, or cancelled before it ever ran. The server refuses Running after Cancelling, so
    such a run can never start; with no worker-side cancellation
    (PREFECT_WORKER_ENABLE_CANCELLATION) it would stay Cancelling until the server's
    cancelling timeout."""
    state = flow_run.state
    return state is not None and (
        state.is_final() or (state.type == StateType.CANCELLING and not ran(flow_run))
    )


def ended_at(flow_run: FlowRun) -> float:
    """When an `over` flow run ended: its end time, else when it was set to Cancelling."""
    state = flow_run.state
    return epoch(flow_run.end_time) or epoch(state.timestamp if state else None) or time.time()


def seen_here(flow_run_id: UUID) -> list[int]:
    """The flow run's live processes on this host (those that still carry its id in their
    environment, and that this process may read)."""
    return marked_processes(RUN_ID_ENV, str(flow_run_id))


def kill_left(flow_run_id: UUID, pids: list[int], log: Callable[[str], None]) -> None:
    """SIGKILL the flow run's processes that still run here after it was asked to end."""
    if not pids:
        return
    log(f"flow run {flow_run_id}: {len(pids)} of its processes still run here; killing them")
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def state_line(flow_run: FlowRun) -> str:
    state = flow_run.state
    if state is None:
        return f"flow run {flow_run.name}: no state"
    message = f": {state.message}" if state.message else ""
    return f"flow run {flow_run.name} ({flow_run.id}): {state.name}{message}"

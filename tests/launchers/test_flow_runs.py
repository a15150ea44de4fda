"""What the deployment launcher reads of a flow run's record (`launchers/flow_runs.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone

from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelled, Cancelling, Completed, Running

from prefect_gpu_budget.launchers import flow_runs


def _run(state, run_count: int = 0, end_time: datetime | None = None) -> FlowRun:
    return FlowRun(
        name="bright-otter",
        flow_id=uuid.uuid4(),
        state=state,
        run_count=run_count,
        end_time=end_time,
    )


def test_a_run_cancelled_before_it_ran_is_over_and_one_that_ran_is_not_until_final() -> None:
    assert flow_runs.over(_run(Cancelling()))  # never runs now: the server refuses Running
    assert not flow_runs.over(_run(Cancelling(), run_count=1))  # its worker still stops it
    assert not flow_runs.over(_run(Running(), run_count=1))
    assert flow_runs.over(_run(Completed(), run_count=1))
    assert flow_runs.over(_run(Cancelled(), run_count=1))
    assert not flow_runs.over(_run(None))


def test_a_run_ended_at_its_end_time_else_when_its_state_was_set() -> None:
    end = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
    assert flow_runs.ended_at(_run(Completed(), 1, end_time=end)) == end.timestamp()
    cancelling = Cancelling()
    assert flow_runs.ended_at(_run(cancelling)) == cancelling.timestamp.timestamp()


def test_the_state_line_names_the_run_and_its_state() -> None:
    run = _run(Completed(message="all done"), 1)
    assert flow_runs.state_line(run) == f"flow run bright-otter ({run.id}): Completed: all done"
    assert flow_runs.state_line(_run(None)) == "flow run bright-otter: no state"


def test_the_processes_of_a_run_are_found_by_its_id_and_killed() -> None:
    run_id = uuid.uuid4()
    env = {**os.environ, flow_runs.RUN_ID_ENV: str(run_id)}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while child.pid not in flow_runs.seen_here(run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flow_runs.seen_here(run_id) == [child.pid]
        assert flow_runs.seen_here(uuid.uuid4()) == []
        told: list[str] = []
        flow_runs.kill_left(run_id, flow_runs.seen_here(run_id), told.append)
        assert child.wait(10) == -9
        assert told == [f"flow run {run_id}: 1 of its processes still run here; killing them"]
    finally:
        child.kill()

"""The flow a test deployment runs: it records what it received, then sleeps.

Loaded by a `process` worker from this folder (`flow.from_source`), so it imports nothing from
the tests.

With `forge`, it plays a hostile job holding its flow run's API access (as every flow run's
code does): it starts a child in a session of its own (out of reach of its worker's kill of
the process group), then ends its own flow run through the API (`end`: forces it Completed and
emits the worker's `prefect.worker.executed-flow-run` event for it; `delete`: deletes it),
records that it did, and runs on.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.events import emit_event
from prefect.events.worker import EventsWorker
from prefect.runtime import flow_run
from prefect.states import Completed


@flow(name="gpu-target")
def target(
    job: dict | None = None, seconds: float = 0.0, out: str = "", forge: str = ""
) -> dict | None:
    """Record the job, this pid and the environment in `out/{flow run id}.json`; sleep."""
    child = None
    if forge:
        child = subprocess.Popen(["sleep", str(seconds)], start_new_session=True).pid
    if out:
        record = {"job": job, "pid": os.getpid(), "child": child, "environ": dict(os.environ)}
        Path(out, f"{flow_run.id}.json").write_text(json.dumps(record))
    if forge == "delete":
        with get_client(sync_client=True) as client:
            client.delete_flow_run(flow_run.id)
    elif forge == "end":
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Completed(), force=True)
        emit_event(
            event="prefect.worker.executed-flow-run",
            resource={"prefect.resource.id": "prefect.worker.process.forged"},
            related=[
                {
                    "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                    "prefect.resource.role": "flow-run",
                }
            ],
            payload={"identifier": str(os.getpid()), "status_code": 0},
        )
        EventsWorker.drain_all(timeout=30)
    if forge:
        Path(out, f"{flow_run.id}.forged").write_text(str(time.time()))
    time.sleep(seconds)
    return job

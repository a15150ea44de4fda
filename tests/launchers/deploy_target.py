"""The flow a test deployment runs: it records what it received, then sleeps.

Loaded by a `process` worker from this folder (`flow.from_source`), so it imports nothing from
the tests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run


@flow(name="gpu-target")
def target(job: dict | None = None, seconds: float = 0.0, out: str = "") -> dict | None:
    """Record the job, this pid and the environment in `out/{flow run id}.json`; sleep."""
    if out:
        record = {"job": job, "pid": os.getpid(), "environ": dict(os.environ)}
        Path(out, f"{flow_run.id}.json").write_text(json.dumps(record))
    time.sleep(seconds)
    return job

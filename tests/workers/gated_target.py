"""The flow the gated pool's deployments run: it sleeps. Loaded by the worker from this folder
(`flow.from_source`), so it imports nothing from the tests."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow


@flow(name="gated-target")
def target(seconds: float = 1.0, once: str | None = None) -> float:
    """Sleep `seconds`; with `once` (a file's path), only the first time: a run started again
    (queued again after a preemption) finds the file and ends at once."""
    if once is not None:
        if Path(once).exists():
            return 0.0
        Path(once).write_text("started")
    time.sleep(seconds)
    return seconds

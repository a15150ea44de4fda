"""The flow the gated pool's deployments run: it sleeps. Loaded by the worker from this folder
(`flow.from_source`), so it imports nothing from the tests."""

from __future__ import annotations

import time

from prefect import flow


@flow(name="gated-target")
def target(seconds: float = 1.0) -> float:
    time.sleep(seconds)
    return seconds

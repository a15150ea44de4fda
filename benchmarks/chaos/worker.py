"""The worker: a process forked per admitter, which admits, runs and settles one job through
a real `Gate`, telling the parent each phase and step through a pipe."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.chaos.config import MAX_WAIT, PAUSE_S, REACH_S
from prefect_gpu_budget.admission.gate import AdmissionRefused, Gate
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.lifecycle import run_admitted
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.launchers.local import LocalLauncher
from prefect_gpu_budget.pricing.catalog import Catalog


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    api_url: str
    prices: str
    scope: str
    job_s: float
    park_at: str | None = None
    """A step mark (e.g. `<settle`) at which this worker stops, to be killed right there."""


PHASE_WORDS = {"started": "running", "settling": "settling"}
"""The lifecycle's phases (`admission/lifecycle.py`) as the words a worker tells the parent."""
HELD_WHILE_PARKED = {"<release": "settle"}
"""The gate settles the row while the slots go back (`Holding._settle`): a worker parked once
they went back must not settle meanwhile, or its kill would find the row settled already."""
PARKED_AFTER = {"<settle": "<release"}
"""And a worker parked once the row settled waits for the slots to go back first, so that its
kill finds both done, and its last step mark is the one it parked at."""


def worker(spec: WorkerSpec, conn: Connection) -> None:
    """Admit, run and settle one job, saying each phase; a pause before each step."""
    from prefect.client.orchestration import get_client

    def say(word: str) -> None:
        conn.send((word, time.time()))

    said = {word: threading.Event() for word in PARKED_AFTER.values()}

    def mark(word: str) -> None:
        if word == spec.park_at and word in PARKED_AFTER:
            said[PARKED_AFTER[word]].wait(REACH_S / 2)  # never said: the run is not injected
        say(word)
        if word in said:
            said[word].set()
        if word == spec.park_at:
            time.sleep(3600)  # parked: the parent kills it here

    def step(call: Callable[..., Any], before: str | None = None, after: str | None = None):
        """`call` after a pause, marked `>name` when it starts and `<name` when it returns."""
        name = call.__name__

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                say(before)
            time.sleep(PAUSE_S)
            if HELD_WHILE_PARKED.get(spec.park_at or "") == name:
                time.sleep(3600)  # the step parked beside: the parent kills it before this
            mark(f">{name}")
            out = call(*args, **kwargs)
            mark(f"<{name}")
            if after:
                say(after)
            return out

        return wrapped

    ledger = Ledger(spec.url, create=False)
    with get_client(sync_client=True) as client:
        if str(client.api_url).rstrip("/") != spec.api_url.rstrip("/"):
            raise RuntimeError(f"worker talks to {client.api_url}, not {spec.api_url}")
        limits = RateLimits(client)
        gate = Gate(ledger, limits, catalog=Catalog.load(Path(spec.prices)))
        # the gate calls these on its ledger and limits: each becomes a marked step
        for target, name, before, after in [
            (ledger.queue, "ask", "before_reserve", "requested"),
            (limits, "ensure", "after_reserve", None),
            (limits, "acquire", None, None),
            (ledger.settlements, "record_lease", None, None),
            (ledger.settlements, "settle", None, None),
            (limits, "release", None, None),
        ]:
            setattr(target, name, step(getattr(target, name), before, after))
        job = GpuJob(
            instance_type="local:chaos",
            max_runtime="10s",
            kill_grace="1s",
            max_wait=MAX_WAIT,
            command=["sleep", f"{spec.job_s:.3f}"],
        )
        try:
            admission = gate.admit(job, spec.scope)
        except AdmissionRefused as refused:
            say(f"refused:{refused.state_name}")
            return
        say("admitted")
        # the users' path (`run_gpu_job`'s): the phases are the lifecycle's own
        run_admitted(gate, admission, LocalLauncher(), phase=lambda name: say(PHASE_WORDS[name]))
        say("done")

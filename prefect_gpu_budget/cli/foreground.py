"""A sweep run in the foreground of a command (`sweep`, `demo`), stopped cleanly by Ctrl-C.

The flow runs in a thread while the main thread shows its progress. The first Ctrl-C (or a
SIGTERM) stops the sweep as an agent's cancel does (`admission.stopping.stop_sweep`): no more
trials start, queued ones are cancelled, running ones get SIGTERM, their kill grace and SIGKILL
and are settled for what they ran; the run and its stopped trials end `Cancelled` in Prefect;
one line says what was stopped and what the sweep cost. A second Ctrl-C leaves at once
(`prefect-gpu-budget reconcile` settles what is left).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import typer

from prefect_gpu_budget.units import fmt_duration, fmt_usd

STOPPED_AT_CTRL_C = "stopped by Ctrl-C"
FIND_RUN_S = 30.0
"""How long a first Ctrl-C waits for the sweep's run to be on record (it may be starting)."""


def run_in_foreground(
    spec: Any,
    ledger: Any,
    start: Callable[[], Any],
    show: Callable[[threading.Thread], None],
) -> Any:
    """Run `start()` (the flow, returning its final state) in a thread while `show(thread)`
    shows progress; returns the final state. On Ctrl-C stop the sweep, wait for its trials to
    settle, say so, and exit 130."""
    outcome: dict[str, Any] = {}
    began = time.time()

    # set when the flow has returned: a `join` that a Ctrl-C interrupted may later return
    # while the thread still runs (CPython 3.11), so the stop waits on this instead
    done = threading.Event()

    def run() -> None:
        try:
            outcome["state"] = start()
        except BaseException as exc:  # shown by the caller, after the progress bar
            outcome["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, name="sweep", daemon=True)
    # ours while the sweep runs, even where the shell that started it ignores SIGINT
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker.start()
        try:
            show(worker)
        except KeyboardInterrupt:
            _stop(spec, ledger, done, began)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["state"]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop(spec: Any, ledger: Any, done: threading.Event, began: float) -> None:
    from prefect_gpu_budget.admission.ledger.results import SweepRecords
    from prefect_gpu_budget.admission.stopping import stop_sweep

    trials = spec.trials()
    grace = spec.job_for(trials[0] if trials else {}, spec.name).kill_grace
    typer.echo(
        f"\nstopping sweep {spec.name}: no more trials start; running ones get SIGTERM and "
        f"{fmt_duration(grace)} to end (Ctrl-C again to leave at once)",
        err=True,
    )
    try:
        run_id = _run_of(SweepRecords(ledger), spec, began, done)
        stopped = (
            stop_sweep(ledger, run_id, spec.scope, STOPPED_AT_CTRL_C)
            if run_id
            else {"cancelled": 0, "stopping": 0}
        )
        done.wait()
    except KeyboardInterrupt:
        typer.echo(
            "left at once: `prefect-gpu-budget reconcile` settles what is still running", err=True
        )
        os._exit(130)
    spent = sum(
        row["actual_micro"] or 0 for row in ledger.jobs(spec.scope, flow_run_id=run_id or "")
    )
    typer.echo(
        f"sweep {spec.name} stopped: {stopped['stopping']} running trials stopped, "
        f"{stopped['cancelled']} queued cancelled; it cost {fmt_usd(spent)}",
        err=True,
    )
    _leave(130)


def _leave(code: int) -> None:
    """Exit now: the sweep's run and trials are settled and their states set; what threads the
    gate still winds down must not hold the command (nor log into a closing interpreter).
    The run's last log lines are sent first, for at most a few seconds."""
    flushed = threading.Thread(target=_flush_run_logs, daemon=True)
    flushed.start()
    flushed.join(timeout=5.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _flush_run_logs() -> None:
    try:
        from prefect.logging.handlers import APILogHandler

        APILogHandler.flush()
    except Exception:  # nothing to send, or the API is gone: leave anyway
        pass


def _run_of(records: Any, spec: Any, began: float, done: threading.Event) -> str | None:
    """The sweep's run id, once it is on record (None if the sweep ended first)."""
    deadline = time.monotonic() + FIND_RUN_S
    while time.monotonic() < deadline:
        run_id = records.latest(spec.scope, spec.name, began - 1)
        if run_id or done.is_set():
            return run_id
        done.wait(0.2)
    return None

"""Sweeps run by a command in the foreground (`sweep`, `demo`, `serve`), stopped cleanly by
Ctrl-C.

The first Ctrl-C (or a SIGTERM) stops each sweep as an agent's cancel does
(`admission.stopping.stop_sweep`): no more trials start, queued ones are cancelled, running ones
get SIGTERM, their kill grace and SIGKILL and are settled for what they ran; the runs and their
stopped trials end `Cancelled` in Prefect; one line says what was stopped and what it cost. A
second Ctrl-C leaves at once (`prefect-gpu-budget reconcile` settles what is left).

`run_in_foreground` runs one sweep's flow in a thread of the command (`sweep`, `demo`);
`serve_in_foreground` serves deployments whose sweeps run in processes of their own (`serve`).
Both stop through `stop_and_leave`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import typer

from prefect_gpu_budget.units import fmt_duration, fmt_usd

STOPPED_AT_CTRL_C = "stopped by Ctrl-C"
FIND_RUN_S = 30.0
"""How long a first Ctrl-C waits for a sweep's run to be on record (it may be starting)."""
SWEEP_FLOWS = ("gpu-sweep", "agent-sweep")
"""The served flows that are sweeps: stopped through the ledger, their trials settled."""
EXIT_CODE = 130


def run_in_foreground(
    spec: Any,
    ledger: Any,
    start: Callable[[], Any],
    show: Callable[[threading.Thread], None],
    cleanup: Callable[[], None] | None = None,
) -> Any:
    """Run `start()` (the flow, returning its final state) in a thread while `show(thread)`
    shows progress; returns the final state. On Ctrl-C stop the sweep, wait for its trials to
    settle, run `cleanup`, say so, and exit 130."""
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
    with _signals_interrupt():
        worker.start()
        try:
            show(worker)
        except KeyboardInterrupt:
            trials = spec.trials()
            grace = spec.job_for(trials[0] if trials else {}, spec.name).kill_grace
            stop_and_leave(
                ledger,
                f"sweep {spec.name}",
                f"no more trials start; running ones get SIGTERM and {fmt_duration(grace)} to end",
                lambda: _run_of(ledger, spec, began, done),
                done.wait,
                cleanup,
            )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["state"]


def serve_in_foreground(deployments: list[Any], ledger: Any) -> None:
    """Serve `deployments` (Prefect's runner, in a thread) until Ctrl-C or SIGTERM; then stop
    the sweeps being served as `sweep` stops its own, and the runner after them."""
    from prefect.runner import Runner

    runner = Runner(pause_on_shutdown=True)
    ids = [runner.add_deployment(d) for d in deployments]
    sweep_ids = [i for d, i in zip(deployments, ids, strict=True) if d.flow_name in SWEEP_FLOWS]
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    typer.echo(f"serving {names}; Ctrl-C stops the running sweeps, then the runner")
    outcome: dict[str, Any] = {}

    def run() -> None:
        import asyncio

        try:  # not the main thread: the runner leaves SIGTERM to the handler below
            asyncio.run(runner.start())
        except BaseException as exc:
            outcome["error"] = exc

    server = threading.Thread(target=run, name="runner", daemon=True)
    with _signals_interrupt():
        server.start()
        try:
            while server.is_alive():
                server.join(0.5)
        except KeyboardInterrupt:
            stopping = _ServedSweeps(runner, server, sweep_ids, ledger)
            stop_and_leave(
                ledger,
                "serve",
                "no more runs or trials start; running trials get SIGTERM and their kill grace "
                "to end, then the runner stops",
                stopping.on_record,
                stopping.wait,
            )
    if "error" in outcome:
        raise outcome["error"]


def stop_and_leave(
    ledger: Any,
    what: str,
    how: str,
    runs: Callable[[], Iterable[tuple[str, str]]],
    wait: Callable[[], Any],
    cleanup: Callable[[], None] | None = None,
) -> NoReturn:
    """The one way a command stops its sweeps: each `(run id, scope)` that `runs()` yields is
    stopped as an agent's cancel stops it, `wait()` returns once they have ended, `cleanup`
    runs, one line says what was stopped and what it cost, and the command exits 130. A second
    Ctrl-C meanwhile leaves at once."""
    from prefect_gpu_budget.admission.stopping import stop_sweep

    typer.echo(f"\nstopping {what}: {how} (Ctrl-C again to leave at once)", err=True)
    ran: list[tuple[str, str]] = []
    try:
        for run_id, scope in runs():
            stop_sweep(ledger, run_id, scope, STOPPED_AT_CTRL_C)
            ran.append((run_id, scope))
        wait()
        if cleanup is not None:
            cleanup()
    except KeyboardInterrupt:
        typer.echo(
            "left at once: `prefect-gpu-budget reconcile` settles what is still running", err=True
        )
        _stop_temporary_server()
        os._exit(EXIT_CODE)
    rows = [row for run_id, scope in ran for row in ledger.views.jobs(scope, flow_run_id=run_id)]
    # read from the ledger, not from the asks above: each sweep's own watch, seeing it
    # cancelled, stops the same jobs and may be first
    running = sum(1 for r in rows if r["started_at"] and r["outcome"] == "cancelled")
    queued = sum(
        1 for r in rows if not r["started_at"] and "cancelled" in (r["state"], r["outcome"])
    )
    spent = sum(row["actual_micro"] or 0 for row in rows)
    typer.echo(
        f"{what} stopped: {running} running trial{'s' * (running != 1)} stopped, {queued} "
        f"queued cancelled; it cost {fmt_usd(spent)}",
        err=True,
    )
    _leave(EXIT_CODE)


class _signals_interrupt:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread while inside: ours even
    where the shell that started the command ignores SIGINT (a background job)."""

    def __enter__(self) -> None:
        self.previous = {
            sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _leave(code: int) -> NoReturn:
    """Exit now: the sweeps' runs and trials are settled and their states set; what threads the
    gate still winds down must not hold the command (nor log into a closing interpreter).
    The runs' last log lines are sent first, for at most a few seconds."""
    flushed = threading.Thread(target=_flush_run_logs, daemon=True)
    flushed.start()
    flushed.join(timeout=5.0)
    _stop_temporary_server()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_temporary_server() -> None:
    """A temporary Prefect server this command started is stopped at its exit; leaving at once
    skips that, so it is stopped here."""
    demo = sys.modules.get("prefect_gpu_budget.flows.demo")
    if demo is not None:
        demo.stop_temporary_server()
    server = sys.modules.get("prefect_gpu_budget.cli.server")
    if server is not None:  # `serve`'s own (`cli.server`)
        server.stop()


def _flush_run_logs() -> None:
    """Send the runs' last log lines, and their last events: the server records a trial's
    final state from its event. Nothing to send, or the API gone: leave anyway."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler

    with contextlib.suppress(Exception):
        APILogHandler.flush()
    with contextlib.suppress(Exception):
        EventsWorker.drain_all(timeout=4.0)


def _run_of(ledger: Any, spec: Any, began: float, done: threading.Event) -> list[tuple[str, str]]:
    """The sweep's run, once it is on record (none if the sweep ended first)."""
    records = ledger.sweeps
    deadline = time.monotonic() + FIND_RUN_S
    while time.monotonic() < deadline:
        run_id = records.latest(spec.scope, spec.name, began - 1)
        if run_id or done.is_set():
            return [(run_id, spec.scope)] if run_id else []
        done.wait(0.2)
    return []


class _ServedSweeps:
    """The sweeps a runner is running, found in Prefect and in the ledger, and its stop."""

    def __init__(
        self, runner: Any, thread: threading.Thread, deployment_ids: list[Any], ledger: Any
    ) -> None:
        self.runner, self.thread = runner, thread
        self.deployment_ids, self.ledger = deployment_ids, ledger
        self.run_ids: set[str] = set()

    def on_record(self) -> Iterator[tuple[str, str]]:
        """Start no more runs; yield each running sweep once it is on record in the ledger (a
        run still starting may take a few seconds)."""
        self.runner.stopping = True
        poller = getattr(self.runner, "_scheduled_run_poller", None)
        if poller is not None:  # what the runner's own stop sets first: submit no more runs
            poller.stopping = True
        records = self.ledger.sweeps
        deadline = time.monotonic() + FIND_RUN_S
        waiting = self._active()
        while waiting and time.monotonic() < deadline:
            for run_id in sorted(waiting):
                row = records.sweep(run_id)
                if row is not None:
                    self.run_ids.add(run_id)
                    yield run_id, row["scope"]
            waiting = self._active() - self.run_ids
            if waiting:
                time.sleep(0.5)

    def wait(self) -> None:
        """Until the stopped sweeps' runs have ended, then stop the runner (what else it runs
        ends as Prefect's runner ends it)."""
        while self.run_ids & self._active():
            time.sleep(0.5)
        if self.runner.started:
            self.runner.execute_in_background(self.runner.astop).result(timeout=60)
        self.thread.join(timeout=30)  # the runner pauses its schedules as it ends

    def _active(self) -> set[str]:
        """The runs of the served sweep deployments not yet ended."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=self.deployment_ids)),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(
                        type=FlowRunFilterStateType(
                            any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
                        )
                    )
                ),
            )
        return {str(run.id) for run in runs}

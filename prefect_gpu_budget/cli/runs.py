"""`demo`, `sweep`, `forecast`, `serve` and `deploy`: the commands that run flows; each loads
Prefect (or pandas, matplotlib) inside itself, on use."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from prefect_gpu_budget.cli.app import app
from prefect_gpu_budget.cli.common import console, current_ledger, fail, spend_ledger


@app.command()
def demo(
    out: str = typer.Option("gpu-budget-demo", help="Folder for the CSV, plot and demo ledger."),
    trials: int = typer.Option(
        12, min=1, max=12, help="About this many trials (learning rates x widths)."
    ),
    seconds: float = typer.Option(2.5, help="Length of each trial."),
) -> None:
    """Run a small real sweep under a budget whose caps bite (no server or GPU needed). Ctrl-C
    stops it as it stops `sweep`."""
    from prefect_gpu_budget.flows.demo import remove_demo_limits, run_demo
    from prefect_gpu_budget.sweeps.flow import gpu_sweep
    from prefect_gpu_budget.sweeps.foreground import run_in_foreground

    def in_foreground(spec: Any, ledger: Any) -> Any:
        state = run_in_foreground(
            spec,
            ledger.ledger(),
            lambda: gpu_sweep(spec, ledger=ledger, return_state=True),
            _until_ended,
            cleanup=remove_demo_limits,
        )
        return state.result()

    run_demo(out, seconds=seconds, trials=trials, run=in_foreground)


def _until_ended(worker: Any) -> None:
    """The demo's progress is its run's log lines: wait, where Ctrl-C reaches this thread."""
    while worker.is_alive():
        worker.join(timeout=0.5)


@app.command()
def sweep(
    spec_path: str = typer.Argument(..., metavar="SWEEP", help="The sweep spec YAML."),
    scope: str = typer.Option(None, help="Run it under this scope instead of the spec's."),
) -> None:
    """Run a sweep from its YAML spec: progress as trials finish, the results table at the end,
    and the run's page in the Prefect UI."""
    from prefect_gpu_budget.flows.demo import start_temporary_server
    from prefect_gpu_budget.launchers.local import LocalLauncher
    from prefect_gpu_budget.launchers.registry import launcher_for
    from prefect_gpu_budget.sweeps.flow import gpu_sweep, load_spec
    from prefect_gpu_budget.sweeps.foreground import run_in_foreground
    from prefect_gpu_budget.sweeps.spec import preflight

    spec = load_spec(spec_path, scope)  # a bad spec fails here, before any server starts
    if spec.launcher is None:  # what `forecast` and the first trial would refuse, refused now
        preflight(spec, LocalLauncher())
    start_temporary_server()
    if spec.launcher is not None:  # a launcher block loads from the server
        launcher = launcher_for(spec.launcher)
        if launcher is None:
            fail(f"launcher: no launcher {spec.launcher!r} (kind:block-name)")
        preflight(spec, launcher)
    ledger = current_ledger()
    total, started = len(spec.trials()), time.time()
    state = run_in_foreground(
        spec,
        ledger,
        lambda: gpu_sweep(spec, ledger=spend_ledger(), return_state=True),
        lambda worker: _show_progress(worker, ledger, spec, total, started),
    )
    df = state.result(raise_on_failure=False)
    df = getattr(df, "trials", df)  # a cancelled sweep's table (sweeps.flow.SweepCancelled)
    if not hasattr(df, "to_string"):
        fail(f"sweep {spec.name} ended {state.name}: {state.message}", code=1)
    typer.echo(_trials_table(df, spec))
    typer.echo(f"results: {df.attrs.get('results_dir')}")
    from prefect_gpu_budget.settings import prefect_api_url

    if prefect_api_url():
        from prefect.settings import PREFECT_UI_URL

        ui = PREFECT_UI_URL.value()
        if ui:
            typer.echo(f"run: {ui}/runs/flow-run/{state.state_details.flow_run_id}")


SWEEP_DROP_FIRST = ("non_finite_dropped", "blocked_s", "waited_s", "blocked_by", "reason")
"""What the sweep's table leaves out first where it cannot fit: counts and times, what held a
trial, then why it did not complete (cut to what is left before that)."""


def _trials_table(df: Any, spec: Any = None) -> str:
    """The trials as a table that fits the terminal: the reason cut to what is left, then
    times and counts left out, then the metrics other than the sweep's (the whole table stays
    in trials.csv and on the run in the UI); the state and cost stay."""
    from prefect_gpu_budget.frame_text import fit_frame, terminal_width

    columns = [c for c in df.columns if c not in ("job_id", "runtime_s")]
    shown = df[columns]
    if shown.empty:
        return shown.to_string(index=False)
    kept = {"trial", "state", "cost_usd", *SWEEP_DROP_FIRST}
    if spec is not None:
        kept |= {spec.metric, *spec.params()}
    others = [c for c in columns if c not in kept]  # the metrics but the sweep's own
    text, note = fit_frame(
        shown, terminal_width(), [*SWEEP_DROP_FIRST[:-1], *others, "reason"], cut="reason"
    )
    return text + (f"\n{note}" if note else "")


def _show_progress(worker: Any, ledger: Any, spec: Any, total: int, started: float) -> None:
    """A progress bar of the sweep's trials that have ended, read from the ledger."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from prefect_gpu_budget.admission.ledger import ACTIVE

    prefix = f"{spec.name}/"
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console.rich(),
        transient=False,
    ) as bar:
        task = bar.add_task(f"sweep {spec.name}", total=total)
        while worker.is_alive():
            worker.join(timeout=1.0)
            rows = [
                r
                for r in ledger.views.jobs(spec.scope, since=started)  # not its history
                if r["name"] and r["name"].startswith(prefix) and r["requested_at"] >= started
            ]
            ended = sum(r["state"] not in ("queued", *ACTIVE) for r in rows)
            waiting = sum(r["state"] == "queued" for r in rows)
            bar.update(
                task,
                completed=min(ended, total),
                description=f"sweep {spec.name}" + (f" ({waiting} waiting)" if waiting else ""),
            )
        bar.update(task, completed=total)


@app.command()
def forecast(
    sweep: str = typer.Argument(..., help="The sweep spec YAML."),
    scope: str = typer.Option(None, help="Run it under this scope instead of the spec's."),
    plot: str = typer.Option(None, help="Write the predicted spend plot (PNG) here."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Predict a sweep's makespan, spend and waits under the current caps, budgets and ledger."""
    from prefect_gpu_budget.sweeps.forecast import forecast as predict
    from prefect_gpu_budget.sweeps.forecast import plot as draw
    from prefect_gpu_budget.sweeps.spec import load_spec

    spec = load_spec(sweep, scope)
    ledger = current_ledger()
    result = predict(spec, ledger)
    if plot:
        path_rules = [r for r in ledger.config.path_budgets(spec.scope) if r.period_budget_micro]
        draw(result, Path(plot), path_rules[-1] if path_rules else None)
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
        return
    console.print(result.describe())


@app.command()
def serve(
    sweep: str = typer.Option(
        None, help="Sweep spec YAML for the sweep deployment (default: the example)."
    ),
    sweep_cron: str = typer.Option("0 2 * * *", help="When the sweep runs (UTC)."),
    report_cron: str = typer.Option("0 7 * * *", help="When the spend report runs (UTC)."),
    reconcile_every: int = typer.Option(300, help="Seconds between reconcile runs."),
    allow_shared_home: bool = typer.Option(
        False,
        "--allow-shared-home",
        help="Leave PREFECT_HOME and a SQLite ledger open to other users as they are, and "
        "start (a loud warning instead; or PREFECT_GPU_BUDGET_ALLOW_SHARED_HOME=1).",
    ),
) -> None:
    """Serve the sweep, spend-report and reconcile deployments from this process. A
    PREFECT_HOME or SQLite ledger of this user's that other users can reach it makes private
    (one line says so); another user's it refuses to start with. Ctrl-C (or SIGTERM) stops the
    running sweeps as `sweep` stops its own, then the runner. Without PREFECT_API_URL it
    starts a temporary Prefect server for itself and its sweeps, and stops it as it ends."""
    from prefect_gpu_budget.cli.agent import startup_check
    from prefect_gpu_budget.cli.common import given_ledger_url

    startup_check(given_ledger_url(), allow_shared_home)
    from prefect_gpu_budget.cli.server import ensure_server

    ensure_server("serve")  # before Prefect is imported: its URL is read once
    from prefect_gpu_budget.deployments import EXAMPLE_SPEC, deployments
    from prefect_gpu_budget.sweeps.foreground import serve_in_foreground

    served = deployments(
        sweep_spec=sweep or EXAMPLE_SPEC,
        sweep_cron=sweep_cron,
        report_cron=report_cron,
        reconcile_every_s=reconcile_every,
    )
    serve_in_foreground(served, current_ledger())


@app.command()
def deploy(
    work_pool: str = typer.Option(..., help="The work pool that runs the flows."),
    sweep: str = typer.Option(None, help="Sweep spec YAML for the sweep deployment."),
    sweep_cron: str = typer.Option("0 2 * * *"),
    report_cron: str = typer.Option("0 7 * * *"),
    reconcile_every: int = typer.Option(300),
) -> None:
    """Register the deployments on a work pool."""
    from prefect_gpu_budget.deployments import EXAMPLE_SPEC
    from prefect_gpu_budget.deployments import deploy as deploy_all

    ids = deploy_all(
        work_pool,
        sweep_spec=sweep or EXAMPLE_SPEC,
        sweep_cron=sweep_cron,
        report_cron=report_cron,
        reconcile_every_s=reconcile_every,
    )
    console.print(f"{len(ids)} deployments registered on work pool {work_pool}")

"""`gpu_sweep`: a grid and/or random search whose every trial passes the gate.

Each trial runs through the launcher with `GPU_BUDGET_METRICS_FILE` naming a JSON-lines file to
report to (`{"step": 10, "loss": 0.31}` ... then a line with `"summary": true`), so a trial can
be any program in any language, or a Python callable (`module:function`). A trial that fails, is
refused or times out is a row with its state and reason, never a crashed sweep.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext
from prefect.exceptions import CancelledRun
from prefect.futures import as_completed
from prefect.states import Cancelled
from prefect.task_runners import ThreadPoolTaskRunner

from prefect_gpu_budget.admission.ledger import wait_spans
from prefect_gpu_budget.admission.ledger.rows import STARTING
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.csv_cells import to_csv
from prefect_gpu_budget.launchers.base import Launcher
from prefect_gpu_budget.launchers.registry import launcher_for
from prefect_gpu_budget.placement.recorded import trial_job
from prefect_gpu_budget.sweeps import plots
from prefect_gpu_budget.sweeps.pictures import FinishedSweep, draw_all
from prefect_gpu_budget.sweeps.recording import SweepRecorder
from prefect_gpu_budget.sweeps.spec import Scalar, SweepSpec, load_spec
from prefect_gpu_budget.sweeps.summary import last_word, no_metric, summary_markdown
from prefect_gpu_budget.tasks.defaults import job_defaults
from prefect_gpu_budget.tasks.gpu_job import run_gpu_job
from prefect_gpu_budget.units import (
    micro_to_usd,
    org_of,
    redact_urls,
    scope_path,
)

EMPTY_COLUMNS = ("trial", "state", "reason", "cost_usd", "waited_s", "blocked_by", "blocked_s")
"""The trials table of a sweep that started no trial."""


class SweepCancelled(CancelledRun):
    """A sweep stopped before its end (an agent's cancel, Ctrl-C): what its run's `Cancelled`
    state holds, with the trials table in `trials`. Raised as Prefect's own `CancelledRun` is
    where a caller asks for the flow's result; `state.result(raise_on_failure=False)` returns
    it."""

    def __init__(self, message: str, trials: pd.DataFrame | None = None) -> None:
        super().__init__(message)
        self.trials = trials

    def __reduce__(self) -> tuple[Any, ...]:
        return (SweepCancelled, (str(self), self.trials))


def _trial_run_name(index: int, params: dict[str, Scalar]) -> str:
    """`trial 0003 lr=0.1 width=16`, with braces removed (Prefect formats run names)."""
    text = " ".join(f"{k}={v}" for k, v in params.items())
    return f"trial {index:04d} {text}".replace("{", "(").replace("}", ")")[:120]


@flow(name="gpu-sweep", task_runner=ThreadPoolTaskRunner(max_workers=64))
def gpu_sweep(
    spec: SweepSpec | dict[str, Any] | str,
    scope: str | None = None,
    ledger: SpendLedger | None = None,
    launcher: Launcher | None = None,
) -> pd.DataFrame:
    """Run every trial through the gate; publish the trials table, a summary and plots.

    `scope` runs the spec under another scope, e.g. an agent's own session
    (`acme/vision/agent-7`), which gets its team's session template if it has no budget.
    `launcher` runs the trials (a Vertex AI, SageMaker or deployment launcher block; local
    processes by default).
    """
    return run_sweep(load_spec(spec, scope), ledger, launcher)


def run_sweep(
    spec: SweepSpec,
    ledger: SpendLedger | None = None,
    launcher: Launcher | None = None,
    *,
    grant: str | None = None,
    results_root: Path | None = None,
) -> pd.DataFrame:
    """The body of a sweep flow (`gpu_sweep`, or an agent's `agent_sweep` with its `grant` and
    its results kept under `results_root`).

    Inside it, a `@gpu_task` that sets none of its own takes the sweep's scope (or a sub-scope
    of it), ledger, agent grant and job shape (`job_defaults`)."""
    shape = spec.job.model_dump(exclude_none=True)
    with job_defaults(scope=spec.scope, ledger=ledger or SpendLedger(), grant=grant, **shape):
        df = _sweep(spec, ledger, launcher, grant, results_root)
    if getattr(df, "attrs", {}).get("cancelled"):  # the run ends Cancelled, its table kept
        said = df.attrs["last_word"]
        return Cancelled(message=said, data=SweepCancelled(said, df))  # type: ignore[return-value]
    return df


def _sweep(
    spec: SweepSpec,
    ledger: SpendLedger | None,
    launcher: Launcher | None,
    grant: str | None,
    results_root: Path | None,
) -> pd.DataFrame:
    """The sweep in four steps (`SweepRun`): open it, run its trials, table them, publish."""
    run = SweepRun(spec, ledger, launcher, grant, results_root)  # 1.
    run.run_trials()  # 2.
    df, rows = run.table()  # 3.
    return run.publish(df, rows)  # 4.


class SweepRun:
    """One run of a sweep's flow: 1. open it (its results folder, its forecast, its progress
    artifact, its records in the ledger); 2. `run_trials`, at most `parallelism` at once, until
    all ran, its agent's grant is revoked or it is cancelled; 3. `table` the trials, with what
    each cost and waited; 4. `publish` the table, the summary and the plots."""

    def __init__(
        self,
        spec: SweepSpec,
        ledger: SpendLedger | None,
        launcher: Launcher | None,
        grant: str | None,
        results_root: Path | None,
    ) -> None:
        self.spec, self.ledger, self.grant = spec, ledger, grant
        self.logger = logger = get_run_logger()
        ctx = FlowRunContext.get()
        self.run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else "local"
        run_name = ctx.flow_run.name if ctx and ctx.flow_run else "local"
        self.out = (results_root or Path()) / spec.results_dir / f"{spec.name}-{run_name}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.trials = spec.trials()
        logger.info(
            "sweep %s: %d trials in %s, at most %d at once",
            spec.name,
            len(self.trials),
            spec.scope,
            spec.parallelism,
        )
        self.led = (ledger or SpendLedger()).ledger()
        if launcher is None and spec.launcher is not None:
            launcher = launcher_for(spec.launcher)
        self.launcher = launcher
        self.key = artifact_key(spec, agent=grant is not None)
        _publish_forecast(spec, self.led, self.out, logger, self.key)
        self.progress = create_progress_artifact(
            0.0, key=f"{self.key}-progress", description=f"Trials of {spec.name} finished"
        )
        store = self.led.sweeps if ctx and ctx.flow_run else None
        self.recorder = SweepRecorder(store, self.run_id, logger)
        self.recorder.open(spec, self.trials)
        self.futures: list[tuple[int, dict[str, Scalar], str, Any]] = []
        self.in_flight: dict[Any, int] = {}
        self.ended: dict[int, list[dict[str, Any]]] = {}

    def run_trials(self) -> None:
        """2. Submit each trial once a place is free, then wait for those still running."""
        for index, params in enumerate(self.trials):
            while len(self.in_flight) >= self.spec.parallelism:
                self.finished(next(as_completed(list(self.in_flight))))
            if self.stopped(index):
                break
            self.submit(index, params)
        for future in as_completed(list(self.in_flight)):
            self.finished(future)

    def stopped(self, index: int) -> bool:
        """Whether the sweep starts no more trials: its agent's grant was revoked, or it was
        cancelled."""
        spec, left = self.spec, len(self.trials) - index
        if self.grant is not None and self.led.grants.grant_scope(self.grant) is None:
            self.logger.warning(
                "sweep %s: its agent's grant was revoked; %d trials not started", spec.name, left
            )
            return True
        if self.recorder.cancelled():
            self.logger.warning("sweep %s: cancelled; %d trials not started", spec.name, left)
            return True
        return False

    def submit(self, index: int, params: dict[str, Scalar]) -> None:
        spec = self.spec
        name = f"{spec.name}/{index:04d}"
        metrics = self.out / f"trial-{index:04d}.jsonl"
        self.recorder.watch(index, metrics)
        future = run_gpu_job.with_options(task_run_name=_trial_run_name(index, params)).submit(
            spec.job_for(params, name, self.grant),
            spec.scope,
            self.ledger,
            str(metrics.resolve()),
            self.launcher,
        )
        self.futures.append((index, params, name, future))
        self.in_flight[future] = index

    def finished(self, future: Any) -> None:
        index = self.in_flight.pop(future)
        state = future.state
        reason = "" if state.is_completed() else redact_urls(state.message or "")
        self.ended[index] = self.recorder.ended(index, state.name, reason)
        update_progress_artifact(self.progress, 100.0 * len(self.ended) / len(self.trials))

    def table(self) -> tuple[pd.DataFrame, list[dict]]:
        """3. The trials table (a row a trial started) and the sweep's jobs in the ledger."""
        jobs = self.led.views.jobs(self.spec.scope, flow_run_id=self.run_id)
        parts: dict[str, list[dict]] = defaultdict(list)  # a trial's job placed again: its places
        for r in jobs:
            parts[r["name"]].append(r)
        records = []
        for index, params, name, future in self.futures:
            future.wait()  # the final state from the task itself: the API's copy may lag behind
            records.append(self.trial_row(index, params, future.state, parts.get(name, [])))
        df = pd.DataFrame(records, columns=None if records else list(EMPTY_COLUMNS))
        if "placements" in df and not df["placements"].astype(bool).any():
            df = df.drop(columns="placements")  # no trial asked for accelerators
        return df, [part for trial in parts.values() for part in trial]

    def trial_row(
        self, index: int, params: dict[str, Scalar], state: Any, parts: list[dict]
    ) -> dict[str, Any]:
        """A trial's row: its parameters, metrics, state, cost (of every place its job ran in,
        `parts`: its ledger rows), waits and runtime (of its last place), and its places."""
        row = trial_job(parts) if parts else {}
        # its start after admission is no limit: `waited_s` counts it, `blocked_*` do not
        spans = {k: v for k, v in (wait_spans(row) if row else {}).items() if k != STARTING}
        return {
            "trial": index,
            **params,
            **self.recorder.metrics(index),
            "non_finite_dropped": self.recorder.non_finite(index),
            "state": state.name,
            "reason": "" if state.is_completed() else redact_urls(state.message or ""),
            "cost_usd": micro_to_usd(row.get("actual_micro") or 0),
            "waited_s": round(_waited(row), 3) if row else None,
            "blocked_by": max(spans, key=spans.__getitem__) if spans else "",
            "blocked_s": round(sum(spans.values()), 3),
            "runtime_s": round(row["ended_at"] - row["started_at"], 3)
            if row.get("started_at")
            else 0.0,
            "job_id": row.get("id"),
            "placements": row.get("places", ""),
        }

    def publish(self, df: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
        """4. The table's files, the artifacts, and the sweep's outputs and end in the ledger."""
        spec, out, recorder = self.spec, self.out, self.recorder
        if spec.metric not in df or df[spec.metric].isna().all():
            self.logger.warning("sweep %s: %s", spec.name, no_metric(spec))
        to_csv(df, out / "trials.csv")  # no cell a spreadsheet formula
        df.to_parquet(out / "trials.parquet", index=False)
        curves = {f"{index:04d}": self.ended.get(index, []) for index, *_ in self.futures}
        pictures, summary = _publish(spec, df, curves, rows, self.led, out, self.key)
        outputs = {
            "results.json": ("application/json", df.to_json(orient="records").encode()),
            "summary.md": ("text/markdown", summary.encode()),
        }
        for picture in [*pictures, out / "forecast.png"]:
            if picture is not None and picture.exists():
                outputs[picture.name] = ("image/png", picture.read_bytes())
        said = last_word(spec, df, len(self.trials), recorder.cancelled())
        recorder.finish(outputs, said)
        df.attrs.update(cancelled=recorder.cancelled(), last_word=said)
        self.logger.info("sweep %s: results in %s", spec.name, out.resolve())
        df.attrs["results_dir"] = str(out.resolve())
        return df


def artifact_key(spec: SweepSpec, agent: bool) -> str:
    """The artifacts' key: the sweep's name; an agent's sweep's carries its session too, so an
    agent naming its sweep `nightly` never becomes the admin's latest `nightly-*`, and a digest
    of both as given, so no other session's name that reads the same in a key (`a/b` and
    `a-b`, `x_y` and `x-y`) shares its artifacts."""
    if not agent:
        return re.sub(r"[^a-z0-9-]", "-", spec.name.lower())
    digest = hashlib.sha256(f"{spec.scope}\0{spec.name}".encode()).hexdigest()[:10]
    return re.sub(r"[^a-z0-9-]", "-", f"agent-{spec.scope}-{spec.name}-{digest}".lower())


def _waited(row: dict) -> float:
    """Request to start: the gate's queue plus any wait for cloud capacity after admission."""
    return (row["started_at"] or row["admitted_at"] or row["ended_at"]) - row["requested_at"]


def _publish(
    spec: SweepSpec, df: pd.DataFrame, curves: dict, rows: list[dict], led, out: Path, key: str
) -> tuple[list[Path | None], str]:
    """The trials table, the summary and the plots as artifacts; returns the plots' files and
    the summary's markdown."""
    create_table_artifact(
        key=f"{key}-trials",
        table=json.loads(df.drop(columns=["job_id"]).to_json(orient="records")),
        description=f"Trials of sweep {spec.name}",
    )
    status = {s["scope"]: s for s in led.views.status(org_of(spec.scope))}  # its org's only
    path_status = [status[s] for s in reversed(scope_path(spec.scope)) if s in status]
    budget = next((s for s in path_status if s["period_budget_micro"] is not None), None)
    cap = next((s for s in path_status if s["hourly_cap_micro"] is not None), None)
    pictures = draw_all(
        FinishedSweep(
            spec=spec,
            trials=df,
            curves=curves,
            jobs=rows,
            budget_micro=budget and budget["period_budget_micro"],
            cap_micro_per_hour=cap and cap["hourly_cap_micro"],
            out=out,
        )
    )
    summary = summary_markdown(spec, df, budget)
    create_markdown_artifact(
        key=f"{key}-summary",
        markdown=summary + "\n\n" + plots.embed(pictures),
        description=f"Summary and plots of sweep {spec.name}",
    )
    return pictures, summary


def _publish_forecast(spec: SweepSpec, led, out: Path, logger, key: str) -> None:
    """Before spending anything: what the simulator predicts for this sweep, as an artifact."""
    from prefect_gpu_budget.sweeps.forecast import forecast, plot

    try:
        predicted = forecast(spec, led)
    except Exception as exc:  # a forecast never stops a sweep
        logger.warning("no forecast for sweep %s: %s", spec.name, exc)
        return
    # one line each: the likely outcome and the bound (the whole forecast is its artifact)
    told = predicted.trials, predicted.max_wait_s
    logger.info("forecast: %s", predicted.likely.headline(*told))
    logger.info("forecast at max_runtime: %s", predicted.bound.headline(*told))
    budgets = [r for r in led.config.path_budgets(spec.scope) if r.period_budget_micro is not None]
    picture = plot(predicted, out / "forecast.png", budgets[-1] if budgets else None)
    create_markdown_artifact(
        key=f"{key}-forecast",
        markdown=f"# Forecast for sweep `{spec.name}`\n\n{predicted.describe()}\n\n"
        + plots.embed([picture], "Predicted spend"),
        description=f"What the simulator predicted for sweep {spec.name} before it ran",
    )

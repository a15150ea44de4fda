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

from prefect_gpu_budget import plots
from prefect_gpu_budget.admission.ledger import wait_spans
from prefect_gpu_budget.admission.ledger.results import SweepRecords
from prefect_gpu_budget.admission.ledger.rows import STARTING
from prefect_gpu_budget.blocks.ledger import SpendLedger
from prefect_gpu_budget.csv_cells import to_csv
from prefect_gpu_budget.flows.recording import SweepRecorder
from prefect_gpu_budget.launchers.base import Launcher
from prefect_gpu_budget.launchers.registry import launcher_for
from prefect_gpu_budget.sweep_spec import Scalar, SweepSpec, load_spec
from prefect_gpu_budget.tasks.defaults import job_defaults
from prefect_gpu_budget.tasks.gpu_job import run_gpu_job
from prefect_gpu_budget.units import (
    fmt_duration,
    fmt_usd,
    micro_to_usd,
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
    logger = get_run_logger()
    ctx = FlowRunContext.get()
    run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else "local"
    run_name = ctx.flow_run.name if ctx and ctx.flow_run else "local"
    out = (results_root or Path()) / spec.results_dir / f"{spec.name}-{run_name}"
    out.mkdir(parents=True, exist_ok=True)
    trials = spec.trials()
    logger.info(
        "sweep %s: %d trials in %s, at most %d at once",
        spec.name,
        len(trials),
        spec.scope,
        spec.parallelism,
    )
    led = (ledger or SpendLedger()).ledger()
    if launcher is None and spec.launcher is not None:
        launcher = launcher_for(spec.launcher)
    key = _artifact_key(spec, agent=grant is not None)
    _publish_forecast(spec, led, out, logger, key)
    progress = create_progress_artifact(
        0.0, key=f"{key}-progress", description=f"Trials of {spec.name} finished"
    )

    recorder = SweepRecorder(SweepRecords(led) if ctx and ctx.flow_run else None, run_id, logger)
    recorder.open(spec, trials)
    futures, in_flight, ended = [], {}, {}

    def finished(future) -> None:
        index = in_flight.pop(future)
        state = future.state
        reason = "" if state.is_completed() else redact_urls(state.message or "")
        ended[index] = recorder.ended(index, state.name, reason)
        update_progress_artifact(progress, 100.0 * len(ended) / len(trials))

    for index, params in enumerate(trials):
        while len(in_flight) >= spec.parallelism:
            finished(next(as_completed(list(in_flight))))
        if grant is not None and led.grants.grant_scope(grant) is None:
            logger.warning(
                "sweep %s: its agent's grant was revoked; %d trials not started",
                spec.name,
                len(trials) - index,
            )
            break
        if recorder.cancelled():
            logger.warning(
                "sweep %s: cancelled; %d trials not started", spec.name, len(trials) - index
            )
            break
        name = f"{spec.name}/{index:04d}"
        metrics = out / f"trial-{index:04d}.jsonl"
        recorder.watch(index, metrics)
        future = run_gpu_job.with_options(task_run_name=_trial_run_name(index, params)).submit(
            spec.job_for(params, name, grant), spec.scope, ledger, str(metrics.resolve()), launcher
        )
        futures.append((index, params, name, future))
        in_flight[future] = index
    for future in as_completed(list(in_flight)):
        finished(future)

    rows_by_name = {r["name"]: r for r in led.views.jobs(spec.scope, flow_run_id=run_id)}
    records, curves = [], {}
    for index, params, name, future in futures:
        future.wait()  # the final state from the task itself: the API's copy may lag behind
        state = future.state
        row = rows_by_name.get(name, {})
        points = ended.get(index, [])
        curves[f"{index:04d}"] = points
        # its start after admission is no limit: `waited_s` counts it, `blocked_*` do not
        spans = {k: v for k, v in (wait_spans(row) if row else {}).items() if k != STARTING}
        records.append(
            {
                "trial": index,
                **params,
                **recorder.metrics(index),
                "non_finite_dropped": recorder.non_finite(index),
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
            }
        )
    df = pd.DataFrame(records, columns=None if records else list(EMPTY_COLUMNS))
    if spec.metric not in df or df[spec.metric].isna().all():
        logger.warning("sweep %s: %s", spec.name, _no_metric(spec))
    to_csv(df, out / "trials.csv")  # no cell a spreadsheet formula
    df.to_parquet(out / "trials.parquet", index=False)
    pictures, summary = _publish(spec, df, curves, list(rows_by_name.values()), led, out, key)
    outputs = {
        "results.json": ("application/json", df.to_json(orient="records").encode()),
        "summary.md": ("text/markdown", summary.encode()),
    }
    for picture in [*pictures, out / "forecast.png"]:
        if picture is not None and picture.exists():
            outputs[picture.name] = ("image/png", picture.read_bytes())
    last_word = _last_word(spec, df, len(trials), recorder.cancelled())
    recorder.finish(outputs, last_word)
    df.attrs.update(cancelled=recorder.cancelled(), last_word=last_word)
    logger.info("sweep %s: results in %s", spec.name, out.resolve())
    df.attrs["results_dir"] = str(out.resolve())
    return df


def _artifact_key(spec: SweepSpec, agent: bool) -> str:
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


def _best(spec: SweepSpec, df: pd.DataFrame) -> pd.Series | None:
    """The completed trial with the best value of the spec's metric, if any reported it."""
    done = df[df["state"] == "Completed"] if "state" in df else df.iloc[0:0]
    if spec.metric not in done or done[spec.metric].dropna().empty:
        return None
    values = pd.to_numeric(done[spec.metric], errors="coerce")
    if values.dropna().empty:
        return None
    return done.loc[values.idxmin() if spec.goal == "min" else values.idxmax()]


def _last_word(spec: SweepSpec, df: pd.DataFrame, planned: int, cancelled: bool) -> str:
    """One line on how the sweep went: what ran, what is best, why trials did not run."""
    done = int((df["state"] == "Completed").sum()) if "state" in df else 0
    words = [f"{done} of {planned} trials completed"]
    best = _best(spec, df)
    if best is not None:
        words.append(f"best {spec.metric} {best[spec.metric]:.4g} (trial {int(best['trial'])})")
    elif planned:
        words.append(_no_metric(spec))
    if cancelled:
        words.append(f"cancelled: {planned - len(df)} trials not started")
    failed = df[df["state"] != "Completed"] if "state" in df else df.iloc[0:0]
    if len(failed) and done == 0:
        words.append(f"trial {int(failed.iloc[0]['trial'])}: {failed.iloc[0]['reason'][:200]}")
    return "; ".join(words)


def _no_metric(spec: SweepSpec) -> str:
    return f"no trial reported {spec.metric!r}"


def _short(value: object) -> str:
    """A parameter value as a legend shows it: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


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
    status = {s["scope"]: s for s in led.views.status()}
    path_status = [status[s] for s in reversed(scope_path(spec.scope)) if s in status]
    budget = next((s for s in path_status if s["period_budget_micro"] is not None), None)
    cap = next((s for s in path_status if s["hourly_cap_micro"] is not None), None)
    pictures = [
        plots.metric_vs_params(
            df,
            spec.params(),
            spec.metric,
            out / "metric_vs_params.png",
            log_params=[name for name, dim in spec.random.items() if dim.log],
            goal=spec.goal,
        ),
        plots.learning_curves(
            curves,
            spec.metric,
            out / "learning_curves.png",
            labels={
                f"{int(r['trial']):04d}": ", ".join(f"{p}={_short(r[p])}" for p in spec.params())
                for r in df.to_dict("records")
            },
        ),
        plots.spend_over_time(
            rows,
            out / "spend.png",
            budget_micro=budget and budget["period_budget_micro"],
            cap_micro_per_hour=cap and cap["hourly_cap_micro"],
            title=f"spend of sweep {spec.name} in {spec.scope}",
        ),
    ]
    summary = _summary(spec, df, budget)
    create_markdown_artifact(
        key=f"{key}-summary",
        markdown=summary + "\n\n" + plots.embed(pictures),
        description=f"Summary and plots of sweep {spec.name}",
    )
    return pictures, summary


def _publish_forecast(spec: SweepSpec, led, out: Path, logger, key: str) -> None:
    """Before spending anything: what the simulator predicts for this sweep, as an artifact."""
    from prefect_gpu_budget.forecast import forecast, plot

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


def _summary(spec: SweepSpec, df: pd.DataFrame, budget: dict | None) -> str:
    done = df[df["state"] == "Completed"]
    lines = [f"# Sweep `{spec.name}` in `{spec.scope}`", ""]
    lines.append(
        f"- trials: {len(df)}; finished {len(done)}; "
        + ", ".join(
            f"{state} {count}"
            for state, count in df["state"].value_counts().items()
            if state != "Completed"
        )
    )
    best = _best(spec, df)
    if best is not None:
        params = ", ".join(f"{p}={_short(best[p])}" for p in spec.params())
        lines.append(
            f"- best trial {int(best['trial'])}: {spec.metric} {best[spec.metric]:.4g} ({params})"
        )
    else:
        lines.append(f"- warning: {_no_metric(spec)}")
    if spec.random:
        lines.append(f"- random draws from seed {spec.seed} (give `seed` to repeat them)")
    spent = int(round(df["cost_usd"].sum() * 1_000_000))
    if budget is not None:
        lines.append(
            f"- spent {fmt_usd(spent)}; {budget['scope']} has {fmt_usd(budget['settled_micro'])} settled of its "
            f"{fmt_usd(budget['period_budget_micro'])} {budget['period']} budget"
        )
    else:
        lines.append(f"- spent {fmt_usd(spent)}")
    held = df[df["blocked_by"] != ""]
    if held.empty:
        lines.append("- no trial waited on a budget, quota or queue")
    else:
        longest = held.loc[held["blocked_s"].idxmax()]
        lines.append(
            f"- {len(held)} trials waited on limits, {fmt_duration(held['blocked_s'].sum())} in "
            f"all; longest trial {int(longest['trial'])}, {fmt_duration(longest['blocked_s'])}, "
            f"mostly on {longest['blocked_by']}"
        )
    refused = df[df["state"] != "Completed"]
    for _, row in refused.head(5).iterrows():
        lines.append(f"- trial {int(row['trial'])} {row['state']}: {row['reason'][:200]}")
    return "\n".join(lines)

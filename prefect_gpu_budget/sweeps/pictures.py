"""The plots a sweep publishes, one registered function each.

A new plot is one function here, marked `@sweep_plot`: it gets the finished sweep
(`FinishedSweep`) and returns the PNG it wrote (None: nothing to draw). `sweeps/flow.py` draws
every registered plot in order, embeds each in the sweep's summary artifact and stores it with
the sweep's outputs, where the agents' door lists and serves it by file name. The drawing
itself lives in `sweeps/plots.py`, shared with the spend report and the forecast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from prefect_gpu_budget.sweeps import plots
from prefect_gpu_budget.sweeps.spec import SweepSpec
from prefect_gpu_budget.sweeps.summary import short


@dataclass(frozen=True)
class FinishedSweep:
    """What a sweep's plots are drawn from, once its trials are over."""

    spec: SweepSpec
    trials: pd.DataFrame
    """The trials table: one row per trial, its parameters, metric, state and cost."""
    curves: dict[str, list[dict[str, Any]]]
    """Per trial (`"0003"`), the metric lines it reported, in order."""
    jobs: list[dict[str, Any]]
    """The ledger's rows of the sweep's jobs."""
    budget_micro: int | None
    """The period budget nearest the sweep's scope on its path, if any."""
    cap_micro_per_hour: int | None
    """The hourly rate cap nearest the sweep's scope on its path, if any."""
    out: Path
    """The sweep's results folder: every plot's file goes here."""


SweepPlot = Callable[[FinishedSweep], Path | None]
SWEEP_PLOTS: list[SweepPlot] = []
"""Every plot a sweep publishes, in the order they appear."""


def sweep_plot(draw: SweepPlot) -> SweepPlot:
    """Register `draw` as one of the plots every sweep publishes."""
    SWEEP_PLOTS.append(draw)
    return draw


def draw_all(sweep: FinishedSweep) -> list[Path | None]:
    """Every registered plot of `sweep`, drawn in order."""
    return [draw(sweep) for draw in SWEEP_PLOTS]


@sweep_plot
def metric_vs_params(sweep: FinishedSweep) -> Path | None:
    """The metric against each parameter, the best trial marked."""
    spec = sweep.spec
    return plots.metric_vs_params(
        sweep.trials,
        spec.params(),
        spec.metric,
        sweep.out / "metric_vs_params.png",
        log_params=[name for name, dim in spec.random.items() if dim.log],
        goal=spec.goal,
    )


@sweep_plot
def learning_curves(sweep: FinishedSweep) -> Path | None:
    """Each trial's metric by step, labelled with its parameters."""
    params = sweep.spec.params()
    labels = {
        f"{int(row['trial']):04d}": ", ".join(f"{p}={short(row[p])}" for p in params)
        for row in sweep.trials.to_dict("records")
    }
    return plots.learning_curves(
        sweep.curves, sweep.spec.metric, sweep.out / "learning_curves.png", labels=labels
    )


@sweep_plot
def spend(sweep: FinishedSweep) -> Path | None:
    """The sweep's spend and rate over time, against its budget and cap."""
    return plots.spend_over_time(
        sweep.jobs,
        sweep.out / "spend.png",
        budget_micro=sweep.budget_micro,
        cap_micro_per_hour=sweep.cap_micro_per_hour,
        title=f"spend of sweep {sweep.spec.name} in {sweep.spec.scope}",
    )

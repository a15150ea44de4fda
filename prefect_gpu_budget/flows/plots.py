"""Plots as PNG files, and a way to show them on a run's page in the Prefect UI.

Prefect's UI renders markdown artifacts; a PNG embedded as a data URI shows there without any
file server, so every plot is both a file in the results folder and a picture on the run.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from prefect_gpu_budget.units import micro_to_usd


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def metric_vs_params(df: pd.DataFrame, params: list[str], metric: str, path: Path) -> Path | None:
    """One panel per swept parameter: the final metric of every finished trial."""
    done = df[df["state"] == "Completed"] if "state" in df else df
    if done.empty or metric not in done or not params:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(params), figsize=(4.2 * len(params), 3.6), squeeze=False)
    for ax, param in zip(axes[0], params, strict=True):
        values = done[[param, metric]].dropna()
        ax.scatter(values[param], values[metric], color="tab:blue")
        numeric = pd.api.types.is_numeric_dtype(values[param])
        if (
            numeric
            and (values[param] > 0).all()
            and values[param].max() / max(values[param].min(), 1e-300) > 50
        ):
            ax.set_xscale("log")
        ax.set_xlabel(param)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{metric} by parameter")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def learning_curves(
    curves: dict[str, list[dict[str, Any]]], metric: str, path: Path
) -> Path | None:
    """`metric` against `step` for every trial that reported steps."""
    series = {
        name: [p for p in points if "step" in p and metric in p] for name, points in curves.items()
    }
    series = {name: points for name, points in series.items() if points}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, points in series.items():
        ax.plot([p["step"] for p in points], [p[metric] for p in points], label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title("learning curves")
    if len(series) <= 12:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def spend_over_time(
    rows: Iterable[dict[str, Any]],
    path: Path,
    *,
    budget_micro: int | None = None,
    cap_micro_per_hour: int | None = None,
    title: str = "spend",
) -> Path | None:
    """Top: settled and settled-plus-reserved spend against the period budget.
    Bottom: the running rate against the hourly cap."""
    rows = [r for r in rows if r.get("admitted_at") is not None]
    if not rows:
        return None
    plt = _pyplot()
    t0 = min(r["admitted_at"] for r in rows)
    money, rate = [], []  # (time, settled delta, committed delta), (time, rate delta)
    for r in rows:
        money.append((r["admitted_at"], 0, r["reserved_micro"]))
        rate.append((r["started_at"] or r["admitted_at"], r["rate_micro_per_hour"]))
        if r["settled_at"]:
            actual = r["actual_micro"] or 0
            money.append((r["settled_at"], actual, actual - r["reserved_micro"]))
            rate.append((r["ended_at"] or r["settled_at"], -r["rate_micro_per_hour"]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    xs, settled, committed, s_total, c_total = [0.0], [0.0], [0.0], 0, 0
    for t, d_settled, d_committed in sorted(money):
        s_total, c_total = s_total + d_settled, c_total + d_committed
        xs.append((t - t0) / 60)
        settled.append(micro_to_usd(s_total))
        committed.append(micro_to_usd(c_total))
    top.step(xs, committed, where="post", color="tab:purple", alpha=0.6, label="settled + reserved")
    top.step(xs, settled, where="post", color="tab:blue", label="settled")
    if budget_micro is not None:
        top.axhline(
            micro_to_usd(budget_micro), color="tab:red", linestyle="--", label="period budget"
        )
    top.set_ylabel("USD")
    top.set_title(title)
    top.legend(fontsize=8, loc="upper left")
    rx, ry, total = [0.0], [0.0], 0
    for t, delta in sorted(rate):
        total += delta
        rx.append((t - t0) / 60)
        ry.append(micro_to_usd(total))
    bottom.step(rx, ry, where="post", color="tab:green", label="running rate")
    if cap_micro_per_hour is not None:
        bottom.axhline(
            micro_to_usd(cap_micro_per_hour), color="tab:orange", linestyle="--", label="hourly cap"
        )
    bottom.set_ylabel("USD per hour")
    bottom.set_xlabel("minutes since first admission")
    bottom.legend(fontsize=8, loc="upper left")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def embed(paths: Iterable[Path | None], heading: str = "Plots") -> str:
    """Markdown that shows PNG files inline (as data URIs) in the Prefect UI."""
    parts = [f"## {heading}"]
    for path in paths:
        if path is None:
            continue
        data = base64.b64encode(Path(path).read_bytes()).decode()
        parts.append(f"### {Path(path).stem}\n\n![{Path(path).stem}](data:image/png;base64,{data})")
    return "\n\n".join(parts)

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


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_scale(values: pd.Series) -> bool:
    """A positive numeric parameter spread over more than 1.5 decades reads best on a log axis."""
    return bool(
        pd.api.types.is_numeric_dtype(values)
        and len(values)
        and (values > 0).all()
        and values.max() / values.min() > 30
    )


def metric_vs_params(
    df: pd.DataFrame,
    params: list[str],
    metric: str,
    path: Path,
    *,
    log_params: Iterable[str] = (),
    goal: str = "min",
) -> Path | None:
    """One panel per swept parameter: the final metric of every finished trial, coloured by
    another parameter, the best trial marked; log-sampled parameters on log axes."""
    done = df[df["state"] == "Completed"] if "state" in df else df
    if done.empty or metric not in done or not params or done[metric].isna().all():
        return None
    done = done.dropna(subset=[metric])
    best = done[metric].idxmin() if goal == "min" else done[metric].idxmax()
    log_params = set(log_params)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(params), figsize=(4.4 * len(params), 3.8), squeeze=False)
    for ax, param in zip(axes[0], params, strict=True):
        other = next((p for p in params if p != param), None)
        _param_panel(fig, ax, done, param, other, metric, log_params)
        _mark_best(ax, done, best, param, metric)
        if param in log_params or _log_scale(done[param]):
            ax.set_xscale("log")
        ax.set_xlabel(param + (" (log)" if ax.get_xscale() == "log" else ""))
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{metric} by parameter ({goal}imum is best)")
    return save_png(plt, fig, path)


def _param_panel(
    fig: Any,
    ax: Any,
    done: pd.DataFrame,
    param: str,
    other: str | None,
    metric: str,
    log_params: set[str],
) -> None:
    """The trials' `metric` against `param`, coloured by `other` where it is numeric."""
    colour = done[other] if other and pd.api.types.is_numeric_dtype(done[other]) else None
    if colour is None:
        ax.scatter(done[param], done[metric], color="tab:blue", zorder=2)
        return
    log_colour = other in log_params or _log_scale(colour)
    points = ax.scatter(
        done[param],
        done[metric],
        c=colour,
        cmap="viridis",
        norm="log" if log_colour else None,
        zorder=2,
    )
    fig.colorbar(points, ax=ax, label=other, pad=0.02)


def _mark_best(ax: Any, done: pd.DataFrame, best: Any, param: str, metric: str) -> None:
    ax.scatter(
        [done.at[best, param]],
        [done.at[best, metric]],
        marker="*",
        s=260,
        facecolor="none",
        edgecolor="tab:red",
        linewidth=1.6,
        zorder=3,
        label=f"best: {metric} {done.at[best, metric]:.4g}",
    )


def save_png(plt: Any, fig: Any, path: Path) -> Path:
    """Lay the figure out, write it to `path` as a PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def learning_curves(
    curves: dict[str, list[dict[str, Any]]],
    metric: str,
    path: Path,
    labels: dict[str, str] | None = None,
) -> Path | None:
    """`metric` against `step` for every trial that reported steps; the legend, beside the
    axes, names each trial by its parameters (`labels`)."""
    series = {
        name: [p for p in points if "step" in p and metric in p] for name, points in curves.items()
    }
    series = {name: points for name, points in series.items() if points}
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.2))
    for name, points in series.items():
        label = (labels or {}).get(name, name)
        ax.plot([p["step"] for p in points], [p[metric] for p in points], label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title("learning curves")
    if len(series) <= 16:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    return save_png(plt, fig, path)


def _time_axis(seconds: float) -> tuple[float, str]:
    """Divisor and label for a span: minutes up to 3 h, hours up to 3 days, else days."""
    if seconds <= 3 * 3600:
        return 60.0, "minutes"
    if seconds <= 3 * 86400:
        return 3600.0, "hours"
    return 86400.0, "days"


def _limit_line(ax: Any, value: float, top: float, colour: str, label: str, unit: str) -> None:
    """A limit as a dashed line when it is near the data; far above it (the axis would flatten
    the data), as a note at the top of the axes instead."""
    if value <= 3 * max(top, 1e-9):
        ax.axhline(value, color=colour, linestyle="--", label=label)
    else:
        share = 100 * top / value if value else 0.0
        ax.annotate(
            f"{label} ${value:,.2f}{unit}, off the axis (peak {share:.2g}% of it)",
            xy=(0.99, 0.96),
            xycoords="axes fraction",
            ha="right",
            va="top",
            fontsize=8,
            color=colour,
        )


OWN_SCALE_RATIO = 8
"""Reservations this many times the spend, or more, would flatten the spend line: it is then
drawn on a scale of its own (the right axis)."""


def spend_over_time(
    rows: Iterable[dict[str, Any]],
    path: Path,
    *,
    budget_micro: int | None = None,
    cap_micro_per_hour: int | None = None,
    title: str = "spend",
    resets: Iterable[float] = (),
    forecast: bool = False,
) -> Path | None:
    """Top: spend (settled) as a line, reserved money as a band above it (held, not spent),
    against the period budget; `forecast`: the line is the expected cost and the band the
    reservations the gate would hold, the most held at once named (what meets the budget).
    Bottom: the running rate against the hourly cap. Axes fit the data, so the plot reads at
    any budget; a limit far above the data is named rather than drawn; a spend far below the
    reservations gets a scale of its own (right axis, OWN_SCALE_RATIO). `resets` are the instants
    at which the period budget starts again: the spend shown starts from zero there, as the
    budget does."""
    rows = [r for r in rows if r.get("admitted_at") is not None]
    if not rows:
        return None
    plt = pyplot()
    t0 = min(r["admitted_at"] for r in rows)
    money, rate = _money_and_rate(rows)  # 1. the events
    span = max(t for t, *_ in money + rate) - t0
    unit_s, unit = _time_axis(span)
    at = _Axis(t0, unit_s)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.6, 5.8), sharex=True)
    xs, settled, committed = _spend_series(money, sorted(resets), at)  # 2. the money
    spend_ax, own_scale = _draw_spend(top, xs, settled, committed, forecast)  # 3. its plot
    if budget_micro is not None:
        _limit_line(top, micro_to_usd(budget_micro), max(committed), "tab:red", "period budget", "")
    top.set_ylabel("USD")
    top.set_title(title)
    _draw_rate(bottom, rate, at, cap_micro_per_hour)  # 4. the running rate
    bottom.set_xlabel(f"{unit} since first admission")
    for i, reset in enumerate(t for t in sorted(resets) if t0 < t <= t0 + span):  # 5. resets
        top.axvline(at(reset), color="grey", linestyle=":", label=None if i else "budget resets")
    _legends(top, bottom, spend_ax if own_scale else None)  # 6. the legends
    return save_png(plt, fig, path)


class _Axis:
    """The time axis: an instant as the units since the first admission."""

    def __init__(self, t0: float, unit_s: float) -> None:
        self.t0, self.unit_s = t0, unit_s

    def __call__(self, t: float) -> float:
        return (t - self.t0) / self.unit_s


def _money_and_rate(
    rows: list[dict[str, Any]],
) -> tuple[list[tuple[float, int, int, int]], list[tuple[float, int]]]:
    """Each job's money events (time, order, settled delta, committed delta) and rate events
    (time, rate delta): admitted, it holds its reservation and runs at its rate; settled, its
    actual cost replaces the reservation and its rate stops."""
    money, rate = [], []
    for r in rows:
        money.append((r["admitted_at"], 1, 0, r["reserved_micro"]))
        rate.append((r["started_at"] or r["admitted_at"], r["rate_micro_per_hour"]))
        if r["settled_at"]:
            actual = r["actual_micro"] or 0
            money.append((r["settled_at"], 0, actual, actual - r["reserved_micro"]))
            rate.append((r["ended_at"] or r["settled_at"], -r["rate_micro_per_hour"]))
    return money, rate


def _spend_series(
    money: list[tuple[float, int, int, int]], pending: list[float], at: _Axis
) -> tuple[list[float], list[float], list[float]]:
    """The spend and the spend + reservations, in USD, at each event; each period of `pending`
    (the budget's resets, in order) starting from zero."""
    xs, settled, committed, s_total, c_total = [0.0], [0.0], [0.0], 0, 0
    # at one instant settlements first: the money they free is what admits the next job
    for t, _, d_settled, d_committed in sorted(money):
        while pending and pending[0] <= t:  # a new period: its budget counts from zero
            xs.append(at(pending.pop(0)))
            s_total, c_total = 0, c_total - s_total
            settled.append(0.0)
            committed.append(micro_to_usd(c_total))
        s_total, c_total = s_total + d_settled, c_total + d_committed
        xs.append(at(t))
        settled.append(micro_to_usd(s_total))
        committed.append(micro_to_usd(c_total))
    return xs, settled, committed


def _draw_spend(
    top: Any, xs: list[float], settled: list[float], committed: list[float], forecast: bool
) -> tuple[Any, bool]:
    """The spend as a line and the reservations as a band above it; the axes the spend is on,
    and whether it is a scale of its own (the right axis)."""
    # reserved money is held, not spent: a band above the spend, never a line read as spend
    top.fill_between(
        xs,
        settled,
        committed,
        step="post",
        color="tab:purple",
        alpha=0.18,
        linewidth=0,
        label="reserved: worst case held against the budget"
        if forecast
        else "reserved (held until settled)",
    )
    # reservations far above the spend would flatten it to the axis: it gets a scale of its own
    own_scale = 0 < max(settled) * OWN_SCALE_RATIO < max(committed)
    spend_ax = top.twinx() if own_scale else top
    spend_ax.step(
        xs,
        settled,
        where="post",
        color="tab:blue",
        linewidth=2,
        label=("expected spend (expected runtime)" if forecast else "spent (settled)")
        + (", right axis" if own_scale else ""),
    )
    if own_scale:
        spend_ax.set_ylim(0, max(settled) * 1.3)
        spend_ax.set_ylabel("USD spent (its own scale)", color="tab:blue")
        spend_ax.tick_params(axis="y", colors="tab:blue")
    if forecast:
        _mark_peak(top, xs, committed)
    spend_ax.annotate(
        f"{'expected spend' if forecast else 'spent'} ${settled[-1]:,.4g}",
        (xs[-1], settled[-1]),
        textcoords="offset points",
        xytext=(-4, 6),
        ha="right",
        fontsize=8,
        color="tab:blue",
    )
    return spend_ax, own_scale


def _mark_peak(top: Any, xs: list[float], committed: list[float]) -> None:
    """Name the most a forecast's trials hold at once (spent + reserved): what meets the budget."""
    peak = max(range(len(xs)), key=lambda i: committed[i])
    top.annotate(
        f"spent + reserved at most ${committed[peak]:,.4g}",
        (xs[peak], committed[peak]),
        textcoords="offset points",
        xytext=(4, -12),  # inside the band, under the budget line it may touch
        fontsize=8,
        color="tab:purple",
    )


def _draw_rate(
    bottom: Any, rate: list[tuple[float, int]], at: _Axis, cap_micro_per_hour: int | None
) -> None:
    """The running rate, in USD per hour, against the hourly cap."""
    rx, ry, total = [0.0], [0.0], 0
    for t, delta in sorted(rate):
        total += delta
        rx.append(at(t))
        ry.append(micro_to_usd(total))
    bottom.step(rx, ry, where="post", color="tab:green", label="running rate")
    if cap_micro_per_hour is not None:
        _limit_line(
            bottom, micro_to_usd(cap_micro_per_hour), max(ry), "tab:orange", "hourly cap", "/h"
        )
    bottom.set_ylabel("USD per hour")


def _legends(top: Any, bottom: Any, spend_ax: Any | None) -> None:
    """Each panel's legend beside it (the spend's own axes, if any, in the top one's)."""
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        own = ax is top and spend_ax is not None
        if own:
            more = spend_ax.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(
            handles,
            labels,
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.2 if own else 1.01, 1.0),
            frameon=False,
        )


def settled_vs_billed(
    scopes: dict[str, dict[str, int]], path: Path, *, unowned_micro: int = 0
) -> Path | None:
    """Per scope, what the ledger settled beside what the cloud billed for the jobs a bill
    names (`Bills.drift`'s `scopes`), the drift written at the end of each pair; scopes with a
    provisional figure marked so. `unowned_micro`: the bill's lines no job owns, named under
    the plot, never spread over the scopes."""
    if not scopes:
        return None
    plt = pyplot()
    names = sorted(scopes)
    fig, ax = plt.subplots(figsize=(7.6, 1.2 + 0.55 * len(names)))
    ys = range(len(names))
    settled = [micro_to_usd(scopes[n]["settled_micro"]) for n in names]
    billed = [micro_to_usd(scopes[n]["billed_micro"]) for n in names]
    ax.barh([y + 0.2 for y in ys], settled, height=0.38, color="tab:blue", label="settled (ledger)")
    ax.barh([y - 0.2 for y in ys], billed, height=0.38, color="tab:orange", label="billed (cloud)")
    top = max([*settled, *billed, 0.0]) or 1.0
    for y, name in zip(ys, names, strict=True):
        drift = micro_to_usd(scopes[name]["drift_micro"])
        note = f"{drift:+,.4g} USD" + (" (provisional)" if scopes[name]["provisional"] else "")
        ax.annotate(
            note,
            (max(settled[y], billed[y]), y),
            textcoords="offset points",
            xytext=(4, -3),
            fontsize=8,
            color="tab:red" if drift > 0 else "tab:green",
        )
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.set_xlim(0, top * 1.35)
    ax.set_xlabel("USD")
    title = "settled vs billed, per scope"
    if unowned_micro:
        title += f"\n(the bill's lines no job owns: {micro_to_usd(unowned_micro):,.4g} USD, apart)"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return save_png(plt, fig, path)


def embed(paths: Iterable[Path | None], heading: str = "Plots") -> str:
    """Markdown that shows PNG files inline (as data URIs) in the Prefect UI."""
    parts = [f"## {heading}"]
    for path in paths:
        if path is None:
            continue
        data = base64.b64encode(Path(path).read_bytes()).decode()
        parts.append(f"### {Path(path).stem}\n\n![{Path(path).stem}](data:image/png;base64,{data})")
    return "\n\n".join(parts)

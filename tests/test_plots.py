"""Plots a researcher would show: log axes where the sweep sampled on a log scale, the best
trial marked, limits far above the data named instead of flattening it, time in fitting units."""

from __future__ import annotations

import pandas as pd

from prefect_gpu_budget import plots


def _trials() -> pd.DataFrame:
    rows = [
        {"trial": i, "lr": lr, "width": w, "state": "Completed", "loss": 1.0 / (i + 1)}
        for i, (lr, w) in enumerate([(1e-4, 64), (1e-3, 256), (3e-3, 64), (2e-2, 256)])
    ]
    return pd.DataFrame(rows)


def test_metric_plot_marks_the_best_and_logs_log_sampled_axes(tmp_path, monkeypatch):
    figures = []
    plt = plots._pyplot()
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    path = plots.metric_vs_params(
        _trials(), ["lr", "width"], "loss", tmp_path / "m.png", log_params=["lr"], goal="min"
    )
    assert path is not None and path.stat().st_size > 1000
    lr_axes, width_axes = figures[0].axes[0], figures[0].axes[2]  # each panel has a colour bar
    assert lr_axes.get_xscale() == "log" and width_axes.get_xscale() == "linear"
    labels = [t.get_text() for t in lr_axes.get_legend().get_texts()]
    assert labels == ["best: loss 0.25"]  # trial 3 has the least loss


def test_no_metric_reported_means_no_metric_plot(tmp_path):
    df = _trials().drop(columns=["loss"]).assign(loss=float("nan"))
    assert plots.metric_vs_params(df, ["lr"], "loss", tmp_path / "m.png") is None
    assert plots.metric_vs_params(df, ["lr"], "accuracy", tmp_path / "m.png") is None


def test_a_limit_far_above_the_data_is_named_not_drawn():
    plt = plots._pyplot()
    fig, ax = plt.subplots()
    plots._limit_line(ax, 2000.0, 40.0, "tab:red", "period budget", "")
    assert ax.get_lines() == [] and "off the axis" in ax.texts[0].get_text()
    plots._limit_line(ax, 50.0, 40.0, "tab:red", "period budget", "")
    assert len(ax.get_lines()) == 1
    plt.close(fig)


def test_time_axis_uses_minutes_hours_or_days():
    assert plots._time_axis(600) == (60.0, "minutes")
    assert plots._time_axis(20 * 3600) == (3600.0, "hours")
    assert plots._time_axis(50 * 3600 * 24) == (86400.0, "days")


def test_spend_plot_draws_period_resets_and_counts_each_period_from_zero(tmp_path, monkeypatch):
    figures = []
    plt = plots._pyplot()
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    day = 86400.0
    rows = [  # one $10 job a day for three days
        {
            "admitted_at": i * day + 3600,
            "started_at": i * day + 3600,
            "ended_at": i * day + 7200,
            "settled_at": i * day + 7200,
            "reserved_micro": 10_000_000,
            "actual_micro": 10_000_000,
            "rate_micro_per_hour": 10_000_000,
        }
        for i in range(3)
    ]
    path = plots.spend_over_time(
        rows, tmp_path / "s.png", budget_micro=15_000_000, resets=[day, 2 * day]
    )
    assert path is not None
    top = figures[0].axes[0]
    dotted = [line for line in top.get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 2
    settled = next(line for line in top.get_lines() if line.get_label() == "spent (settled)")
    assert max(settled.get_ydata()) == 10.0  # never the $30 of all three days
    assert figures[0].axes[1].get_xlabel() == "hours since first admission"  # 50 h

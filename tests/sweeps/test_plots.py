"""Plots a researcher would show: log axes where the sweep sampled on a log scale, the best
trial marked, limits far above the data named instead of flattening it, time in fitting units."""

from __future__ import annotations

import pandas as pd

from prefect_gpu_budget.sweeps import plots


def _trials() -> pd.DataFrame:
    rows = [
        {"trial": i, "lr": lr, "width": w, "state": "Completed", "loss": 1.0 / (i + 1)}
        for i, (lr, w) in enumerate([(1e-4, 64), (1e-3, 256), (3e-3, 64), (2e-2, 256)])
    ]
    return pd.DataFrame(rows)


def test_metric_plot_marks_the_best_and_logs_log_sampled_axes(tmp_path, monkeypatch):
    figures = []
    plt = plots.pyplot()
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
    plt = plots.pyplot()
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
    plt = plots.pyplot()
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


def test_a_spend_far_below_its_reservations_gets_a_scale_of_its_own(tmp_path, monkeypatch):
    """$0.02 spent against $40 reserved: on the reservations' axis the spend line would lie
    flat on zero; it is drawn on the right axis, scaled to itself."""
    figures = []
    plt = plots.pyplot()
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    rows = [
        {
            "admitted_at": 60.0 * i,
            "started_at": 60.0 * i,
            "ended_at": 60.0 * i + 20 if i < 2 else None,
            "settled_at": 60.0 * i + 20 if i < 2 else None,
            "reserved_micro": 10_000_000,
            "actual_micro": 10_000 if i < 2 else None,
            "rate_micro_per_hour": 1_800_000,
        }
        for i in range(6)
    ]
    assert plots.spend_over_time(rows, tmp_path / "s.png", budget_micro=50_000_000) is not None
    top, spend = figures[0].axes[0], figures[0].axes[-1]
    [line] = [x for x in spend.get_lines() if x.get_label().startswith("spent (settled)")]
    assert spend is not top and max(line.get_ydata()) == 0.02
    assert spend.get_ylim()[1] < 0.1 and top.get_ylim()[1] > 40  # each read on its own scale
    even = [{**r, "reserved_micro": 10_000} for r in rows[:2]]  # held what it spent
    plots.spend_over_time(even, tmp_path / "t.png")  # one scale reads both
    assert len(figures[1].axes) == 2

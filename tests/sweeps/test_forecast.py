"""A forecast of a small sweep against the same sweep run for real."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from prefect_gpu_budget import GpuBudget, SpendLedger
from prefect_gpu_budget.admission.ledger import Ledger, wait_spans
from prefect_gpu_budget.admission.ledger.rows import STARTING
from prefect_gpu_budget.sweeps.flow import gpu_sweep
from prefect_gpu_budget.sweeps.forecast import LOCAL_START_S, forecast
from prefect_gpu_budget.sweeps.spec import SweepSpec

TOLERANCE = 0.4
"""Spend may differ by this fraction: real trials also pay their interpreter's start-up."""


def _spec(tmp_path, trials: int) -> SweepSpec:
    return SweepSpec(
        name="fc",
        scope="fc/team/agent",
        job={
            "instance_type": "local:box",
            "max_runtime": "30s",
            "expected_runtime": "1.5s",
            "kill_grace": "1s",
            "max_wait": "20s",
        },
        command=[sys.executable, "-c", "import time; time.sleep(1.5)", "{i}"],
        grid={"i": list(range(trials))},
        parallelism=3,
        results_dir=str(tmp_path / "results"),
    )


def test_forecast_matches_the_real_sweep(prefect_api, prices, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="fc", hourly_cap_usd=100, period_budget_usd=100).apply(ledger)
    GpuBudget(scope="fc/team", hourly_cap_usd="7.2").apply(ledger)  # two trials at a time
    spec = _spec(tmp_path, 6)
    predicted = forecast(spec, ledger)

    df = gpu_sweep(spec, ledger=SpendLedger(database_url=url))
    assert predicted.trials == 6
    assert predicted.admitted == (df["state"] == "Completed").sum() == 6
    assert predicted.waiting == 2 and (df["waited_s"] > 0.5).sum() >= 2  # real threads add jitter
    # the two that waited a whole trial, for the cap or behind a trial it held; not counting
    # their launch (`starting`), which on a busy machine can be the longest part of a wait
    spans = [wait_spans(r) for r in ledger.views.jobs("fc")]
    held = [s for s in spans if sum(v for k, v in s.items() if k != STARTING) > 0.5]
    assert len(held) >= 2, spans
    assert predicted.stopped_by is None
    actual = sum(r["actual_micro"] for r in ledger.views.jobs("fc"))
    assert abs(actual - predicted.spend_micro) <= TOLERANCE * predicted.spend_micro


def _team(ledger: Ledger, **kw: str) -> None:
    """The sweeps' team, `fc/team`, with no limits of its own (and, `kw`, the org's manner of
    waiting: the deepest budget's applies): the gate refuses a scope whose team nobody
    created (`Ledger.views.unknown_scope`), and so does the forecast."""
    GpuBudget(scope="fc/team", **kw).apply(ledger)


def test_forecast_says_when_the_period_budget_stops_a_sweep(prices, tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", period_budget_usd="0.0085", period="day").apply(ledger)
    _team(ledger)
    spec = SweepSpec.model_validate(
        {
            **_spec(tmp_path, 6).model_dump(),
            "job": {
                "instance_type": "local:box",
                "max_runtime": "2s",
                "expected_runtime": "2s",
                "kill_grace": "1s",
            },
        }
    )
    # $0.003 reserved per trial, $0.002 spent: two at once, then one, then the budget is spent
    predicted = forecast(spec, ledger)
    assert "day budget of fc ($0.0085): 3 trials wait until it resets" in predicted.stopped_by
    assert predicted.admitted == 6  # the last three on the next day


def test_trials_whose_max_wait_runs_out_first_are_not_said_to_wait_for_the_reset(prices, tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", period_budget_usd="0.0085", period="day").apply(ledger)
    _team(ledger)
    spec = SweepSpec.model_validate(
        {
            **_spec(tmp_path, 6).model_dump(),
            "job": {
                "instance_type": "local:box",
                "max_runtime": "2s",
                "expected_runtime": "2s",
                "kill_grace": "1s",
                "max_wait": "30s",
            },
        }
    )
    predicted = forecast(spec, ledger)
    assert predicted.timed_out == 3, predicted.summary()
    assert "3 trials end unrun first (their max wait runs out)" in predicted.stopped_by
    assert "wait until it resets" not in predicted.stopped_by


def test_forecast_command(tmp_path, prices):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    GpuBudget(scope="fc", hourly_cap_usd="7.2", period_budget_usd=100).apply(Ledger(url))
    _team(Ledger(url))
    path = tmp_path / "sweep.yaml"
    path.write_text(_spec(tmp_path, 4).model_dump_json())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_gpu_budget.cli",
            "--ledger-url",
            url,
            "forecast",
            str(path),
            "--json",
            "--plot",
            str(tmp_path / "forecast.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["admitted"] == 4 and out["waiting"] == 1 and out["stopped_by"] is None
    assert out["spend_usd"] == pytest.approx(4 * 3.6 * 1.5 / 3600, rel=1e-3)
    # the top-level figures are the likely ones; the bound runs every trial 30 s + 1 s grace
    assert {k: out["likely"][k] for k in ("admitted", "spend_usd")} == {
        "admitted": 4,
        "spend_usd": out["spend_usd"],
    }
    assert out["likely"]["runtime_s"] == 1.5 and out["bound"]["runtime_s"] == 31.0
    # two at a time: the third waits past its max_wait (20 s) for the first to end at 31 s
    assert (out["bound"]["admitted"], out["bound"]["timed_out"]) == (3, 1)
    assert out["bound"]["spend_usd"] == pytest.approx(3 * 3.6 * 31 / 3600, rel=1e-3)
    assert out["runtime_from"] == "its expected_runtime" and out["reserve_s"] == 31.0
    assert (tmp_path / "forecast.png").stat().st_size > 1000


def test_forecast_counts_the_trials_max_wait_will_time_out(prefect_api, prices, tmp_path):
    """A job elsewhere holds the team's whole cap for an hour: every trial waits its max_wait
    out, in the forecast as in the run."""
    from tests.support.jobs import new_job

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="fc", hourly_cap_usd="3.6", period_budget_usd=100).apply(ledger)
    _team(ledger)
    _, held = ledger.queue.request(new_job("fc/other", max_runtime_s=3600.0))
    assert held.verdict == "admit"
    fields = _spec(tmp_path, 4).model_dump()
    spec = SweepSpec.model_validate({**fields, "job": {**fields["job"], "max_wait": "2s"}})
    predicted = forecast(spec, ledger)
    assert predicted.admitted == 0 and predicted.timed_out == 4
    assert "0 of 4 trials admitted within 7d, 4 time out after 2s (max_wait)" in (
        predicted.describe()
    )

    df = gpu_sweep(spec, ledger=SpendLedger(database_url=url))
    assert (df["state"] == "AdmissionTimeout").sum() == predicted.timed_out


def test_forecast_counts_rejections(prices, tmp_path):
    from tests.support.jobs import new_job

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", hourly_cap_usd="7.2", on_limit="reject").apply(ledger)
    _team(ledger, on_limit="reject")
    _, held = ledger.queue.request(new_job("fc/other", max_runtime_s=3600.0))
    assert held.verdict == "admit"
    predicted = forecast(_spec(tmp_path, 5), ledger)  # room for one trial at a time
    assert predicted.rejected >= 1 and predicted.admitted + predicted.rejected == 5
    assert f"{predicted.rejected} rejected (on_limit: reject)" in predicted.describe()


def _short_trials(tmp_path, **job: str) -> SweepSpec:
    """Six trials at $3.60/h ($0.001 a second) that may run 9 s (10 s with their grace)."""
    fields = _spec(tmp_path, 6).model_dump()
    base = {"instance_type": "local:box", "max_runtime": "9s", "kill_grace": "1s"}
    return SweepSpec.model_validate({**fields, "job": {**base, "max_wait": "30s", **job}})


def test_the_likely_outcome_and_the_bound_are_two_runs_told_apart(prices, tmp_path):
    """Trials expected to run 1 s of their 9 s max_runtime, under a day budget that holds two
    reservations ($0.01 each, what the gate holds for 10 s): likely, all six run, two at a time;
    the bound, every trial running its whole reservation, spends the budget on the first two
    and the other four time out. Both are given, each named; the bare figures are the likely.
    Nothing has finished yet: each trial takes a local process's typical start to start."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", period_budget_usd="0.025", period="day").apply(ledger)
    _team(ledger)
    predicted = forecast(_short_trials(tmp_path, expected_runtime="1s"), ledger, now=1e9)

    likely, bound = predicted.likely, predicted.bound
    assert predicted.start_s == LOCAL_START_S == 0.2
    assert (likely.runtime_s, bound.runtime_s) == (1.0, 10.0)
    assert (likely.admitted, likely.timed_out, likely.spend_micro) == (6, 0, 6_000)
    assert likely.makespan_s == likely.end_s == pytest.approx(3 * 1.2)  # three rounds
    assert (bound.admitted, bound.timed_out, bound.spend_micro) == (2, 4, 20_000)
    assert bound.makespan_s == pytest.approx(10.2)
    # the other four wait their 30 s max_wait out, three trials asked at a time: one from the
    # start (out at 30 s), two when the first two end (out at 40.2 s), one at 30 s (out at 60 s)
    assert bound.end_s == pytest.approx(60.0)
    assert (predicted.admitted, predicted.spend_micro) == (6, 6_000)

    lines = predicted.describe().splitlines()
    assert lines[0] == (
        "likely, each trial 1s (its expected_runtime): 6 of 6 trials admitted within 7d; "
        "spend $0.006; makespan 4s to the last end"
    )
    assert lines[1] == (
        "each trial starts 0.2s after its admission (a local process's typical start: nothing "
        "finished on it yet); the makespan runs from the first request to the last admitted "
        "trial's end, and the sweep is over when its last trial ends or times out"
    )
    assert lines[-1] == (
        "bound, if every trial ran to its max_runtime (10s with kill grace, what the gate "
        "reserves for it): 2 of 6 trials admitted within 7d, 4 time out after 30s (max_wait); "
        "spend $0.02; makespan 10s to the last end, 1m with time-outs"
    )
    out = predicted.as_dict()
    assert (out["admitted"], out["timed_out"]) == (6, 0)  # the likely, as `likely` has them
    assert out["end_s"] == out["likely"]["end_s"] == 3.6
    assert out["likely"]["admitted"] == 6 and out["likely"]["spend_usd"] == 0.006
    assert out["bound"]["admitted"] == 2 and out["bound"]["timed_out"] == 4
    assert out["bound"]["spend_usd"] == 0.02 and out["bound"]["makespan_s"] == 10.2
    assert out["bound"]["end_s"] == 60.0
    assert out["start_from"] == "a local process's typical start: nothing finished on it yet"


def test_a_sweep_that_never_runs_a_trial_says_when_it_is_over(prices, tmp_path):
    """Every trial times out: no makespan to give, and the sweep is over when the last of them
    has waited its max wait; on a launcher other than the local one no start is known."""
    from tests.support.jobs import new_job

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", hourly_cap_usd="3.6", period_budget_usd=100).apply(ledger)
    _team(ledger)
    _, held = ledger.queue.request(new_job("fc/other", max_runtime_s=3600.0))
    assert held.verdict == "admit"
    fields = _short_trials(tmp_path, expected_runtime="1s", max_wait="5s").model_dump()
    spec = SweepSpec.model_validate({**fields, "launcher": "vertex:lab", "parallelism": 2})
    predicted = forecast(spec, ledger, now=1e9)
    assert (predicted.admitted, predicted.timed_out) == (0, 6)
    assert predicted.makespan_s == 0.0
    assert predicted.end_s == pytest.approx(15.0)  # two at a time, three rounds of 5 s waits
    assert predicted.likely.headline(6, 5.0).endswith("spend $0.00; over after 15s (time-outs)")
    assert (predicted.start_s, predicted.start_from) == (
        0.0,
        "none known on this launcher: nothing finished on it yet",
    )


def test_forecast_waits_for_the_teams_quota_in_a_capacity_pool(prices, tmp_path):
    """Six one-machine trials, their team's quota two machines of four: two at a time, likely
    three rounds of 1 s, at worst three of 10 s, as the gate places them."""
    from prefect_gpu_budget.blocks.capacity import CapacityPool, TeamShare

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", period_budget_usd=100).apply(ledger)
    CapacityPool(
        org="fc",
        name="lab",
        nodes=4,
        gpus_per_node=1,
        instance_types=["local:box"],
        teams=[TeamShare(team="fc/team", gpus=2, borrow_pct=0)],
    ).apply(ledger)
    predicted = forecast(_short_trials(tmp_path, expected_runtime="1s"), ledger, now=1e9)
    assert predicted.likely.admitted == predicted.bound.admitted == 6
    assert predicted.likely.makespan_s == pytest.approx(3 * 1.2)  # each after 0.2 s to start
    assert predicted.bound.makespan_s == pytest.approx(3 * 10.2)


def _finished(ledger: Ledger, scope: str, name: str, seconds: float, outcome: str) -> None:
    """A trial that ran `seconds` and ended `outcome`, in the ledger as its sweep leaves it."""
    from tests.support.jobs import new_job

    now = time.time()
    job_id, decision = ledger.queue.request(new_job(scope, name=name), now=now - seconds - 1)
    assert decision.verdict == "admit"
    assert ledger.settlements.mark_started(job_id, now - seconds)
    assert ledger.settlements.settle(job_id, ended_at=now, outcome=outcome) is not None


def test_the_likely_runtime_is_what_the_sweeps_finished_trials_took(prices, tmp_path):
    """Asked again mid-sweep (or after a run), a sweep without an expected_runtime is likely to
    run as its finished trials ran (completed or failed), not to its max_runtime; a cancelled
    trial, another sweep's and the same name in another scope are not its."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", hourly_cap_usd="7.2", period_budget_usd=100).apply(ledger)
    _team(ledger)
    spec = _short_trials(tmp_path)  # no expected_runtime
    before = forecast(spec, ledger)
    assert before.likely.runtime_s == 9.0
    assert before.runtime_from == "its max_runtime: no expected_runtime and no finished trial"

    _finished(ledger, spec.scope, "fc/0000", 2.0, "completed")
    _finished(ledger, spec.scope, "fc/0001", 4.0, "failed")
    _finished(ledger, spec.scope, "fc/0002", 8.0, "cancelled")
    _finished(ledger, spec.scope, "other/0000", 8.0, "completed")
    _finished(ledger, "fc/team/else", "fc/0003", 8.0, "completed")
    during = forecast(spec, ledger)
    assert during.likely.runtime_s == pytest.approx(3.0, abs=0.01)
    assert during.runtime_from == "2 as each last ran, the rest as its 2 finished trials ran"
    assert during.start_s == pytest.approx(1.0, abs=0.01)  # each started 1 s after admission
    # two at a time under the cap, each after a 1 s start that holds the cap but is not billed:
    # trials 0 and 1 as they ran (2 s and 4 s), the other four 3 s, the mean; 10 s at worst
    records = {r.job.job_id: r for r in during.likely.result.records}
    assert [records[f"{i:04d}"].job.true_s for i in range(6)] == pytest.approx(
        [2.0, 4.0, 3.0, 3.0, 3.0, 3.0], abs=0.01
    )
    # 0: 1-3, 1: 1-5, 2: 4-7, 3: 6-9, 4: 8-11, 5: 10-13 (all at 3 s: three rounds, 12 s)
    assert during.likely.makespan_s == pytest.approx(13.0, abs=0.1)
    assert during.likely.spend_micro == pytest.approx(6 * 3_000, rel=0.01)
    assert during.bound.makespan_s == pytest.approx(33.0, abs=0.1)
    assert during.bound.spend_micro == 6 * 10_000
    said = during.describe()
    assert "likely, each trial 3s (2 as each last ran, the rest as its 2 finished" in said
    assert "each trial starts 1s after its admission (as its 2 finished trials took)" in said
    assert during.as_dict()["start_s"] == 1.0


def test_a_sessions_other_work_does_not_crowd_the_sweeps_trials_out(prices, tmp_path, monkeypatch):
    """The sweep's history is its own latest trials, chosen by name in the ledger: a session
    that has run much else since (a year of other sweeps) neither hides them nor is read."""
    from prefect_gpu_budget.sweeps import forecast as forecasting

    monkeypatch.setattr(forecasting, "HISTORY_ROWS", 2)
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", hourly_cap_usd="7.2", period_budget_usd=100).apply(ledger)
    _team(ledger)
    spec = _short_trials(tmp_path)
    _finished(ledger, spec.scope, "fc/0000", 2.0, "completed")
    _finished(ledger, spec.scope, "fc/0001", 4.0, "completed")
    for name in ("other/0000", "fcx/0000", "other/0001"):  # newer, and not the sweep's
        _finished(ledger, spec.scope, name, 1.0, "completed")
    found = forecasting.finished_trials(spec, ledger, latest=None)
    assert sorted(row["name"] for row in found) == ["fc/0000", "fc/0001"]
    assert forecast(spec, ledger).likely.runtime_s == pytest.approx(3.0, abs=0.01)


def test_before_its_trials_finish_a_sweep_starts_as_its_launchers_latest_jobs_did(prices, tmp_path):
    """None of the sweep's trials has finished, but other jobs of its org on the local launcher
    have: each trial takes as long to start as they took (on a busy machine, longer than a
    local process's typical start); a sweep on another launcher learns nothing from them."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    GpuBudget(scope="fc", hourly_cap_usd="7.2", period_budget_usd=100).apply(ledger)
    _team(ledger)
    _finished(ledger, "fc/team/else", "other/0000", 2.0, "completed")  # each started 1 s after
    _finished(ledger, "fc/team/agent", "another/0003", 4.0, "failed")
    _finished(ledger, "fc/team/else", "other/0001", 8.0, "cancelled")  # taught nothing
    spec = _short_trials(tmp_path, expected_runtime="1s")
    predicted = forecast(spec, ledger, now=1e9)
    assert predicted.start_s == pytest.approx(1.0, abs=0.01)
    assert predicted.start_from == "as its launcher's latest 2 jobs took"
    assert predicted.runtime_from == "its expected_runtime"  # their runtimes are not its
    # two at a time under the cap: three rounds of a 1 s start and 1 s
    assert predicted.likely.makespan_s == pytest.approx(6.0, abs=0.1)

    elsewhere = SweepSpec.model_validate({**spec.model_dump(), "launcher": "vertex:lab"})
    assert forecast(elsewhere, ledger, now=1e9).start_s == 0.0


def test_forecast_refuses_a_scope_the_gate_would_refuse(prices, tmp_path):
    """A typo in the team: the forecast says what the gate will say of every trial, and the
    command exits 2 with that one line."""
    from prefect_gpu_budget.units import BudgetInputError

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="fc", hourly_cap_usd="7.2", period_budget_usd=100).apply(ledger)
    GpuBudget(scope="fc/team", hourly_cap_usd="3.6").apply(ledger)
    spec = _spec(tmp_path, 3)
    typo = SweepSpec.model_validate({**spec.model_dump(), "scope": "fc/taem/agent"})
    reason = ledger.views.unknown_scope("fc/taem/agent")
    assert reason is not None and reason.endswith("did you mean fc/team?")
    with pytest.raises(BudgetInputError) as refused:
        forecast(typo, ledger)
    assert str(refused.value) == f"scope: {reason}"

    path = tmp_path / "sweep.yaml"
    path.write_text(spec.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "--ledger-url", url, "forecast"]
        + [str(path), "--scope", "fc/taem/agent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: scope: {reason}"
    assert ledger.views.jobs() == []


def test_forecast_plot_draws_the_reservations_that_bind(prices, tmp_path, monkeypatch):
    """The band is what the gate holds (guaranteed: rate x (max_runtime + kill grace)) and its
    top meets the budget where trials wait; the line is the expected cost, told apart."""
    from prefect_gpu_budget.sweeps import plots
    from prefect_gpu_budget.sweeps.forecast import plot, plot_rows

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    # $3.60/h: each trial holds $0.003 (2 s + 1 s grace) and is expected to cost $0.001 (1 s)
    GpuBudget(scope="fc", period_budget_usd="0.0085", period="day").apply(ledger)
    _team(ledger)
    spec = SweepSpec.model_validate(
        {
            **_spec(tmp_path, 4).model_dump(),
            "job": {
                "instance_type": "local:box",
                "max_runtime": "2s",
                "expected_runtime": "1s",
                "kill_grace": "1s",
            },
        }
    )
    predicted = forecast(spec, ledger)
    rows = plot_rows(predicted)
    assert len(rows) == 4
    assert all(r["reserved_micro"] == 3_000 and r["actual_micro"] == 1_000 for r in rows), rows

    figures = []
    monkeypatch.setattr(plots.pyplot(), "close", lambda fig: figures.append(fig))
    [budget] = [r for r in ledger.config.path_budgets(spec.scope) if r.period_budget_micro]
    assert plot(predicted, tmp_path / "forecast.png", budget) is not None
    top = figures[0].axes[0]
    [band] = top.collections
    held = band.get_paths()[0].vertices[:, 1]
    # what the gate counts against the budget: two trials at once hold $0.006; after they
    # settle ($0.002 spent) two more: $0.008; a third at once would be $0.009, over $0.0085
    assert max(held) == pytest.approx(0.008)
    assert band.get_label().startswith("reserved: worst case")
    [line] = [x for x in top.get_lines() if x.get_label().startswith("expected spend")]
    assert max(line.get_ydata()) == pytest.approx(4 * 0.001)
    assert any(t.get_text() == "spent + reserved at most $0.008" for t in top.texts)

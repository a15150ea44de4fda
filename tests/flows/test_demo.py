"""The README's main job, reduced: the demo command on a temporary Prefect server."""

from __future__ import annotations

import os
import shlex
import sqlite3
import subprocess
import sys

import pandas as pd
import pytest

from prefect_gpu_budget.admission.ledger import Ledger


@pytest.mark.timeout(300)
def test_demo_command_runs_a_sweep_under_its_budget(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # Prefect's own wait for a temporary server; the demo must not depend on it, as a first
        # start on a busy machine takes longer than its 20 s default.
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1",
        COLUMNS="80",
    )
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    done = subprocess.run(
        [*cli, "demo", "--out", "out", "--trials", "5", "--seconds", "0.5"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.splitlines()
    assert max(map(len, said)) <= 80, done.stdout  # its table and closing lines fit
    assert "day budget of demo-lab/sweeps/agent-1" in done.stdout
    [run_dir] = out.glob("demo-*")
    assert f"results: out/{run_dir.name}/trials.csv" in said, done.stdout
    # its last lines say where its ledger is and the command that lists its jobs
    assert said[-2] == "ledger: out/ledger.db (the demo's own, not the default); its jobs:"
    command = shlex.split(said[-1])
    assert command[0] == "prefect-gpu-budget", said[-1]
    listed = subprocess.run(
        [*cli, *command[1:]], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0 and "demo-lab/sweeps/agent-1" in listed.stdout, listed
    # the product's own log lines say one thing each: no wait names two limits at length
    ours = [line for line in done.stderr.splitlines() if "GPU job" in line or "forecast" in line]
    assert ours and all("; blocked by" not in line for line in ours), ours
    assert all(len(line.split(" - ", 1)[-1]) <= 160 for line in ours), ours
    # nothing of the demo is left in the user's Prefect database
    prefect_db = sqlite3.connect(tmp_path / "home" / "prefect.db")
    left = prefect_db.execute(
        "SELECT name FROM concurrency_limit_v2 WHERE name LIKE 'gpu-budget:demo-lab%'"
    ).fetchall()
    prefect_db.close()
    assert left == []
    trials = pd.read_csv(run_dir / "trials.csv")
    assert len(trials) == 6 and (trials["state"] == "Completed").sum() >= 2
    assert "starting" not in set(trials["blocked_by"].fillna(""))  # its launch is no limit
    for plot in ("spend.png", "metric_vs_params.png", "learning_curves.png"):
        assert (run_dir / plot).stat().st_size > 1000
    ledger = Ledger(f"sqlite:///{out / 'ledger.db'}")
    charged = sum(r["actual_micro"] or 0 for r in ledger.views.jobs())
    assert charged == round(trials["cost_usd"].fillna(0).sum() * 1_000_000)


@pytest.mark.timeout(300)
def test_the_demos_first_forecast_says_what_its_run_does(prefect_api, tmp_path, monkeypatch):
    """The demo as it runs by default (12 trials of 2.5 s): the likely figures of the forecast
    its sweep publishes before its first trial are what the ledger then records, within one
    trial and 10% of spend, and the sweep is over when it says, its time-outs counted, within
    10% and the spread of its asks; the bound beside them, every trial running to its
    max_runtime, is not (it admits 2 where about 9 run)."""
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.flows.demo import DEMO_SCOPE, run_demo
    from prefect_gpu_budget.sweeps.flow import gpu_sweep
    from prefect_gpu_budget.sweeps.forecast import forecast

    monkeypatch.setenv("PREFECT_GPU_BUDGET_PRICES", "")  # the demo sets its own; put back after
    predicted = []

    def run(spec, ledger):  # what the sweep publishes first, from the same ledger, just before
        predicted.append(forecast(spec, ledger.ledger()))
        return gpu_sweep(spec, ledger=ledger)

    try:
        run_demo(str(tmp_path / "out"), run=run)
    finally:
        default_catalog.cache_clear()
    [said] = predicted
    jobs = Ledger(f"sqlite:///{tmp_path / 'out' / 'ledger.db'}").views.jobs(DEMO_SCOPE)
    admitted = sum(j["admitted_at"] is not None for j in jobs)
    timed_out = sum(j["state"] == "timed_out" for j in jobs)
    spent = sum(j["actual_micro"] or 0 for j in jobs)
    likely = said.likely
    assert said.runtime_from == "its expected_runtime" and likely.runtime_s == 2.5
    assert abs(likely.admitted - admitted) <= 1, (likely, jobs)
    assert abs(likely.timed_out - timed_out) <= 1, (likely, jobs)
    assert abs(likely.spend_micro - spent) <= 0.1 * spent, (likely.spend_micro, spent)
    # the trials that time out wait their 30 s first: the sweep is over then, long after the
    # makespan (its admitted trials' last end), and the forecast says both
    # The forecast takes every trial as asked for at once; a busy host spreads the asks over
    # seconds (each is a Prefect task run first), and a late ask times out that much later.
    first = min(j["requested_at"] for j in jobs)
    late = max(j["requested_at"] for j in jobs) - first
    over = max(j["ended_at"] for j in jobs) - first
    assert likely.end_s is not None, likely
    assert abs(likely.end_s - over) <= 0.1 * over + late, (likely, over, late)
    assert likely.end_s > likely.makespan_s + 10, likely
    assert said.bound.admitted == 2 and admitted - said.bound.admitted > 1
    with get_client(sync_client=True) as client:
        published = {a.key: a for a in client.read_artifacts() if a.key}["demo-forecast"].data
    assert said.describe().splitlines()[0] in published


def test_no_server_and_no_temporary_one_is_one_line_saying_what_to_run(tmp_path, prices):
    """A temporary server that cannot start in time (here: given one second, less than its
    import takes) ends the command with one line naming what to run, and no traceback."""
    from prefect_gpu_budget.settings import NO_SERVER

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1",
    )
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        "name: s\nscope: acme/t\njob: {instance_type: 'local:box', max_runtime: 1m}\n"
        "command: ['true']\ngrid: {lr: [0.1]}\n"
    )
    short_wait = (
        "import sys, prefect_gpu_budget.flows.demo as demo; demo.SERVER_START_TIMEOUT_S = 1; "
        "from prefect_gpu_budget.cli import main; sys.argv = ['prefect-gpu-budget', 'sweep', "
        f"{str(spec)!r}]; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", short_wait], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: {NO_SERVER}"
    assert "Traceback" not in done.stderr

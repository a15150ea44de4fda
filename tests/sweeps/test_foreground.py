"""Ctrl-C on a real `prefect-gpu-budget sweep`, `demo` and `serve` with running and queued
trials: back within the kill grace and a few seconds, the running trials stopped and settled for
what they ran, the queued ones cancelled, nothing admitted after, and the run `Cancelled` in
Prefect."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_gpu_budget.admission.ledger import FINAL, Ledger
from tests.support.prefect_server import wait_for

GRACE_S = 2.0


def test_ctrl_c_stops_a_sweep_and_settles_what_ran(prefect_api, prices, tmp_path):
    scope = "ctrlc/team/a"
    spec = {
        "name": "ctrlc",
        "scope": scope,
        "job": {"instance_type": "local:box", "max_runtime": "2m", "kill_grace": f"{GRACE_S}s"},
        "command": ["sleep", "60"],
        "grid": {"lr": [1, 2, 3, 4]},
        "parallelism": 2,
        "results_dir": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(spec))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    # one trial at a time: the second waits at the cap, the last two are not even asked for
    subprocess.run([*cli, "budget", "set", "ctrlc", "--hourly-cap", "100"], env=env, check=True)
    subprocess.run(
        [*cli, "budget", "set", "ctrlc/team", "--hourly-cap", "3.6", "--new"], env=env, check=True
    )
    ledger = Ledger(url)
    sweep = subprocess.Popen(
        [*cli, "sweep", str(tmp_path / "sweep.yaml")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            wait_for(
                lambda: (
                    sorted(j["state"] for j in ledger.views.jobs(scope)) == ["queued", "running"]
                ),
                300,
                "one running and one queued trial",
            )
        except AssertionError:
            sweep.kill()
            raise AssertionError(sweep.communicate()[1][-3000:]) from None
        time.sleep(1.0)  # it runs a little: billed above zero
        interrupted = time.time()
        sweep.send_signal(signal.SIGINT)
        out, err = sweep.communicate(timeout=GRACE_S + 60)
        took = time.time() - interrupted
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 130, err[-3000:]
    assert took < GRACE_S + 30, f"Ctrl-C took {took:.1f}s to come back"
    assert "can't register atexit" not in err and "Traceback" not in err, err[-3000:]
    [said] = [line for line in err.splitlines() if line.startswith("sweep ctrlc stopped:")]
    assert "1 running trial stopped, 1 queued cancelled" in said, said

    jobs = ledger.views.jobs(scope)
    assert len(jobs) == 2, "a trial was asked for after Ctrl-C"
    assert all(j["state"] in FINAL for j in jobs), [(j["state"], j["reason"]) for j in jobs] + [
        err[-4000:]
    ]
    ran = [j for j in jobs if j["started_at"]]
    assert len(ran) == 1 and ran[0]["started_at"] < interrupted
    [stopped] = ran
    assert stopped["outcome"] == "cancelled" and 0 < stopped["billed_seconds"] < 30, stopped
    assert 0 < stopped["actual_micro"] < stopped["reserved_micro"]
    [queued] = [j for j in jobs if not j["started_at"]]
    assert queued["state"] == "cancelled"

    run_id = ledger.sweeps.latest(scope, "ctrlc", 0)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    assert run.state.type.value == "CANCELLED", run.state
    trials = _trials_ended(run.id, ("CANCELLED", "FAILED"))
    assert any(t.state.type.value == "CANCELLED" for t in trials)
    ledger.db.dispose()


def _trials_ended(run_id, states: tuple[str, ...]) -> list:
    """The run's trials once each is in one of `states`: the server records a task run's
    state from its events, a moment after the command ended."""
    from prefect.client.orchestration import get_client

    seen: list = []

    def ended() -> list | None:
        with get_client(sync_client=True) as client:
            seen[:] = [
                t
                for t in client.read_task_runs()
                if t.flow_run_id == run_id and t.name.startswith("trial ")
            ]
        return seen if seen and all(t.state.type.value in states for t in seen) else None

    try:
        return wait_for(ended, 60, "the trials' final states")
    except AssertionError as late:
        raise AssertionError(f"{late}: {[(t.name, t.state.name) for t in seen]}") from None


def _stopped_line(err: str, what: str) -> tuple[int, int]:
    """(running trials stopped, queued cancelled) from the command's one line."""
    [said] = [line for line in err.splitlines() if line.startswith(f"{what} stopped:")]
    found = re.search(r"(\d+) running trials? stopped, (\d+) queued cancelled; it cost \$", said)
    assert found, said
    return int(found[1]), int(found[2])


def _assert_settled_for_what_ran(jobs: list[dict], interrupted: float, grace: float) -> None:
    """Every job ended; those that ran started before Ctrl-C and were stopped and billed for
    what they ran; the others were cancelled unstarted."""
    assert all(j["state"] in FINAL for j in jobs), [(j["state"], j["reason"]) for j in jobs]
    ran = [j for j in jobs if j["started_at"]]
    assert ran and all(j["started_at"] < interrupted for j in ran), "a trial started after Ctrl-C"
    for job in ran:
        assert job["outcome"] == "cancelled", job
        assert 0 < job["billed_seconds"] < time.time() - job["started_at"] + grace, job
        assert 0 < job["actual_micro"] < job["reserved_micro"], job
    assert all(j["state"] == "cancelled" for j in jobs if not j["started_at"])


def _wait_or_show(condition, what: str, proc: subprocess.Popen, log: Path) -> None:
    try:
        wait_for(condition, 300, what)
    except AssertionError:
        proc.kill()
        raise AssertionError(log.read_text()[-3000:]) from None


@pytest.mark.timeout(400)
def test_ctrl_c_stops_the_demo_and_settles_what_ran(tmp_path):
    """The demo on its temporary server: two trials run at the hourly cap, two wait; Ctrl-C
    stops both kinds, removes the demo's limits, and stops the temporary server too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(
        PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="200"
    )
    out, log = tmp_path / "out", tmp_path / "demo.log"
    demo = subprocess.Popen(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "demo", "--out", str(out)]
        + ["--trials", "4", "--seconds", "9"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        # printed once the demo's ledger is ready, before the server starts
        _wait_or_show(lambda: "temporary Prefect server" in log.read_text(), "start", demo, log)
        ledger = Ledger(f"sqlite:///{out / 'ledger.db'}")
        _wait_or_show(
            lambda: (
                [j["state"] for j in ledger.views.jobs()].count("running") == 2
                and "queued" in [j["state"] for j in ledger.views.jobs()]
            ),
            "two running trials and one waiting",
            demo,
            log,
        )
        time.sleep(1.0)  # they run a little: billed above zero
        interrupted = time.time()
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=60)
        took = time.time() - interrupted
    finally:
        if demo.poll() is None:
            demo.kill()
    said = log.read_text()
    assert demo.returncode == 130, said[-3000:]
    assert took < 1.0 + 30, f"Ctrl-C took {took:.1f}s to come back"
    assert "Traceback" not in said and "can't register atexit" not in said, said[-3000:]
    stopped, cancelled = _stopped_line(said, "sweep demo")
    assert stopped >= 1 and cancelled >= 1, said[-1000:]
    jobs = ledger.views.jobs()
    assert len(jobs) == 4
    _assert_settled_for_what_ran(jobs, interrupted, 1.0)
    ledger.db.dispose()

    prefect_db = sqlite3.connect(tmp_path / "home" / "prefect.db")
    [(run_state,)] = prefect_db.execute("SELECT state_type FROM flow_run").fetchall()
    trials = prefect_db.execute(
        "SELECT name, state_type FROM task_run WHERE name LIKE 'trial %'"
    ).fetchall()
    left = prefect_db.execute(
        "SELECT name FROM concurrency_limit_v2 WHERE name LIKE 'gpu-budget:demo-lab%'"
    ).fetchall()
    prefect_db.close()
    assert run_state == "CANCELLED"
    assert len(trials) == 4 and all(s == "CANCELLED" for _, s in trials), trials
    assert left == [], "the demo left its limits behind"
    # the temporary server went with the command
    assert "temporary Prefect server" in said
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "home") not in ps


@pytest.mark.timeout(400)
def test_ctrl_c_stops_a_served_sweep_then_the_runner(prefect_api, prices, tmp_path):
    """`serve` runs a sweep in a process of its own; Ctrl-C on `serve` stops that sweep as it
    stops `sweep`, then the runner."""
    scope = "served/team/a"
    spec = {
        "name": "served",
        "scope": scope,
        "job": {"instance_type": "local:box", "max_runtime": "2m", "kill_grace": f"{GRACE_S}s"},
        "command": ["sleep", "60"],
        "grid": {"lr": [1, 2, 3, 4]},
        "parallelism": 2,
        "results_dir": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(spec))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    subprocess.run([*cli, "budget", "set", "served", "--hourly-cap", "100"], env=env, check=True)
    subprocess.run(
        [*cli, "budget", "set", "served/team", "--hourly-cap", "3.6", "--new"], env=env, check=True
    )
    ledger = Ledger(url)
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [*cli, "serve", "--sweep", str(tmp_path / "sweep.yaml")],
        env=env,
        cwd=tmp_path,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    from prefect.client.orchestration import get_client

    try:
        _wait_or_show(lambda: "serving gpu-sweep/sweep" in log.read_text(), "serve", serve, log)
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("gpu-sweep/sweep")
            run = client.create_flow_run_from_deployment(deployment.id)
        _wait_or_show(
            lambda: sorted(j["state"] for j in ledger.views.jobs(scope)) == ["queued", "running"],
            "one running and one queued trial",
            serve,
            log,
        )
        time.sleep(1.0)  # it runs a little: billed above zero
        interrupted = time.time()
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=GRACE_S + 90)
        took = time.time() - interrupted
    finally:
        if serve.poll() is None:
            serve.kill()
    said = log.read_text()
    assert serve.returncode == 130, said[-3000:]
    assert took < GRACE_S + 30, f"Ctrl-C took {took:.1f}s to come back"
    assert _stopped_line(said, "serve") == (1, 1), said[-3000:]
    jobs = ledger.views.jobs(scope)
    assert len(jobs) == 2, "a trial was asked for after Ctrl-C"
    _assert_settled_for_what_ran(jobs, interrupted, GRACE_S)
    assert {j["flow_run_id"] for j in jobs} == {str(run.id)}
    ledger.db.dispose()

    with get_client(sync_client=True) as client:
        ended = client.read_flow_run(run.id)
    assert ended.state.type.value == "CANCELLED", ended.state
    assert len(_trials_ended(run.id, ("CANCELLED",))) == 2


@pytest.mark.timeout(400)
def test_a_second_ctrl_c_leaves_at_once_and_reconcile_settles_the_rest(
    prefect_api, prices, tmp_path
):
    """A trial that ignores SIGTERM holds the first stop for its kill grace (a minute); a second
    Ctrl-C leaves at once, and `reconcile` settles what the command left."""
    scope = "twice/team/a"
    spec = {
        "name": "twice",
        "scope": scope,
        "job": {"instance_type": "local:box", "max_runtime": "5m", "kill_grace": "60s"},
        "command": ["sh", "-c", "trap '' TERM; sleep 120"],
        "grid": {"lr": [1]},
        "results_dir": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(spec))
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    subprocess.run([*cli, "budget", "set", "twice", "--hourly-cap", "100"], env=env, check=True)
    subprocess.run(
        [*cli, "budget", "set", "twice/team", "--hourly-cap", "100", "--new"], env=env, check=True
    )
    ledger = Ledger(url)
    log = tmp_path / "sweep.log"
    sweep = subprocess.Popen(
        [*cli, "sweep", str(tmp_path / "sweep.yaml")],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_or_show(
            lambda: [j["state"] for j in ledger.views.jobs(scope)] == ["running"],
            "the trial running",
            sweep,
            log,
        )
        sweep.send_signal(signal.SIGINT)
        _wait_or_show(
            lambda: ledger.views.jobs(scope)[0]["stop_asked_at"] is not None, "the stop", sweep, log
        )
        assert sweep.poll() is None, "the first Ctrl-C did not wait for the kill grace"
        again = time.time()
        sweep.send_signal(signal.SIGINT)
        sweep.wait(timeout=60)
        took = time.time() - again
    finally:
        if sweep.poll() is None:
            sweep.kill()
    said = log.read_text()
    assert sweep.returncode == 130, said[-3000:]
    assert took < 30, f"the second Ctrl-C took {took:.1f}s"
    assert "left at once: `prefect-gpu-budget reconcile` settles" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]

    def settled() -> bool:
        subprocess.run([*cli, "reconcile"], env=env, check=True, capture_output=True)
        return all(j["state"] in FINAL for j in ledger.views.jobs(scope))

    wait_for(settled, 120, "reconcile to settle the trial the command left")
    [job] = ledger.views.jobs(scope)
    assert 0 < job["actual_micro"] < job["reserved_micro"], job
    ledger.db.dispose()

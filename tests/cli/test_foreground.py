"""Ctrl-C on a real `prefect-gpu-budget sweep` with running and queued trials: back within the
kill grace and a few seconds, the running trial stopped and settled for what it ran, the queued
ones cancelled, nothing admitted after, and the run `Cancelled` in Prefect."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from prefect_gpu_budget.admission.ledger import FINAL, Ledger
from prefect_gpu_budget.admission.ledger.results import SweepRecords
from tests.prefect_server import wait_for

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
                lambda: sorted(j["state"] for j in ledger.jobs(scope)) == ["queued", "running"],
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
    assert "1 running trials stopped, 1 queued cancelled" in said, said

    jobs = ledger.jobs(scope)
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

    run_id = SweepRecords(ledger).latest(scope, "ctrlc", 0)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        tasks = client.read_task_runs()
    assert run.state.type.value == "CANCELLED", run.state
    trials = [t for t in tasks if t.flow_run_id == run.id and t.name.startswith("trial ")]
    assert trials and all(t.state.type.value in ("CANCELLED", "FAILED") for t in trials), [
        (t.name, t.state.name) for t in trials
    ]
    assert any(t.state.type.value == "CANCELLED" for t in trials)
    ledger.dispose()

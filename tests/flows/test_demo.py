"""The README's main job, reduced: the demo command on a temporary Prefect server."""

from __future__ import annotations

import os
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
    )
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_gpu_budget.cli",
            "demo",
            "--out",
            str(out),
            "--trials",
            "5",
            "--seconds",
            "0.5",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "day budget of demo-lab/sweeps/agent-1" in done.stdout
    [run_dir] = out.glob("demo-*")
    assert f"results: {run_dir.resolve()}/trials.csv" in done.stdout
    # nothing of the demo is left in the user's Prefect database
    prefect_db = sqlite3.connect(tmp_path / "home" / "prefect.db")
    left = prefect_db.execute(
        "SELECT name FROM concurrency_limit_v2 WHERE name LIKE 'gpu-budget:demo-lab%'"
    ).fetchall()
    prefect_db.close()
    assert left == []
    trials = pd.read_csv(run_dir / "trials.csv")
    assert len(trials) == 6 and (trials["state"] == "Completed").sum() >= 2
    for plot in ("spend.png", "metric_vs_params.png", "learning_curves.png"):
        assert (run_dir / plot).stat().st_size > 1000
    ledger = Ledger(f"sqlite:///{out / 'ledger.db'}")
    charged = sum(r["actual_micro"] or 0 for r in ledger.jobs())
    assert charged == round(trials["cost_usd"].fillna(0).sum() * 1_000_000)

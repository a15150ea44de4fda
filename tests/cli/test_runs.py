"""The sweep table fits the terminal; `--version` answers; `sweep` runs a YAML sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from prefect_gpu_budget.cli.runs import _trials_table


def test_the_reason_column_is_cut_to_fit_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    long = "blocked by hourly cap of acme/vision: running $3.60/h + this job " * 5
    df = pd.DataFrame(
        [
            {"trial": 0, "lr": 0.1, "loss": 0.5, "state": "Completed", "reason": ""},
            {"trial": 1, "lr": 0.2, "loss": None, "state": "OverBudget", "reason": long},
        ]
    )
    lines = _trials_table(df).splitlines()
    assert max(len(line) for line in lines) <= 100, lines
    assert lines[2].rstrip().endswith("…") and "blocked by hourly cap" in lines[2]
    assert df.loc[1, "reason"] == long  # the table's copy is cut, not the results


def test_the_sweep_table_keeps_state_and_cost_at_80_columns(monkeypatch):
    """A sweep's trials as `sweep` ends with them (108 columns wide before): at 80 the reason is
    cut, then times and counts are left out and named; the state and the cost stay."""
    from types import SimpleNamespace

    monkeypatch.setenv("COLUMNS", "80")
    why = "max wait 30s ran out: blocked by day budget of demo-lab/sweeps/agent-1: settled"
    row = {
        "trial": 9,
        "lr": 1.0,
        "width": 64,
        "loss": None,
        "accuracy": None,
        "non_finite_dropped": 0,
        "state": "AdmissionTimeout",
        "reason": why,
        "cost_usd": 0.0,
        "waited_s": 30.05,
        "blocked_by": "period_budget demo-lab/sweeps/agent-1",
        "blocked_s": 30.05,
        "runtime_s": 0.0,
        "job_id": "41e58afc-0000",
    }
    done = {**row, "trial": 0, "loss": 0.6455, "accuracy": 0.66, "state": "Completed"}
    df = pd.DataFrame([{**done, "reason": "", "cost_usd": 0.008637}, row])
    spec = SimpleNamespace(metric="loss", params=lambda: ["lr", "width"])
    lines = _trials_table(df, spec).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    header = lines[0].split()
    assert {"trial", "lr", "width", "loss", "state", "cost_usd"} <= set(header), lines
    assert "AdmissionTimeout" in lines[2] and "0.008637" in lines[1], lines
    note = " ".join(lines[lines.index(next(x for x in lines if x.startswith("not shown"))) :])
    assert note.startswith("not shown at 80 columns: non_finite_dropped, blocked_s"), lines


def test_version():
    done = subprocess.run(
        [sys.executable, "-m", "prefect_gpu_budget.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("prefect-gpu-budget 0."), done


def test_sweep_refuses_before_starting_what_forecast_refuses(prices, tmp_path):
    """A typo in the instance type, or a cloud's type on the local launcher: exit 2, one line,
    before any server starts or any trial is asked for."""
    import json
    import os

    ledger = tmp_path / "ledger.db"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{ledger}"}
    env.pop("PREFECT_API_URL", None)  # nothing may need a server before the refusal
    for instance_type, said in (
        ("local:boxx", "error: instance_type: no on-demand price for 'local:boxx'"),
        ("aws:g5.xlarge", "error: job.instance_type: the local launcher runs jobs on this"),
    ):
        spec = {
            "name": "typo",
            "scope": "acme/team/a",
            "job": {"instance_type": instance_type, "max_runtime": "1m"},
            "command": ["true"],
            "grid": {"lr": [0.1]},
        }
        path = tmp_path / "sweep.yaml"
        path.write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "prefect_gpu_budget.cli", "sweep", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(said), line
    assert not ledger.exists() or "typo" not in ledger.read_bytes().decode(errors="replace")


def test_a_failed_trial_says_its_reason_once(prefect_api, prices, tmp_path):
    """Two trials at once where the team's cap fits one and refuses the other (`on_limit:
    reject`); the one admitted exits 0 or 3. Each trial that did not complete says its reason
    once in the run's logs, and no `NoneType: None` line comes with it."""
    import json
    import os

    spec = {
        "name": "fails",
        "scope": "failing/team",
        "job": {"instance_type": "local:box", "max_runtime": "1m"},
        "command": ["sh", "-c", "sleep 10; exit $(( {lr} ))"],  # running when the other asks
        "grid": {"lr": [0, 3]},
        "parallelism": 2,
        "results_dir": str(tmp_path / "results"),
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": f"sqlite:///{tmp_path / 'l.db'}"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    subprocess.run([*cli, "budget", "set", "failing", "--hourly-cap", "100"], env=env, check=True)
    subprocess.run(
        [*cli, "budget", "set", "failing/team", "--hourly-cap", "3.6", "--on-limit", "reject"]
        + ["--new"],
        env=env,
        check=True,
    )
    done = subprocess.run(
        [*cli, "sweep", str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [csv] = (tmp_path / "results").glob("fails-*/trials.csv")
    trials = pd.read_csv(csv)
    ended = trials[trials["state"] != "Completed"]
    assert "OverBudget" in set(ended["state"]), trials[["state", "reason"]]
    logs = done.stderr
    assert "NoneType: None" not in logs, logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]
    for reason in ended["reason"]:
        assert logs.count(reason[:60]) == 1, (reason, logs[-3000:])


_TRIAL = """
import json, os, sys, time
time.sleep(0.2)
with open(os.environ["GPU_BUDGET_METRICS_FILE"], "a") as out:
    out.write(json.dumps({"summary": True, "loss": float(sys.argv[1])}) + "\\n")
"""


def test_sweep_command_runs_a_yaml_sweep_and_prints_its_table(prefect_api, prices, tmp_path):
    (tmp_path / "trial.py").write_text(_TRIAL)
    spec = {
        "name": "cli",
        "scope": "clisweep/team/a",
        "job": {"instance_type": "local:box", "max_runtime": "30s", "kill_grace": "1s"},
        "command": [sys.executable, str(tmp_path / "trial.py"), "{lr}"],
        "grid": {"lr": [0.5, 0.25, 0.125]},
        "parallelism": 3,
        "results_dir": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(spec))  # JSON is YAML
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**os.environ, "PREFECT_GPU_BUDGET_LEDGER_URL": url, "COLUMNS": "200"}
    cli = [sys.executable, "-m", "prefect_gpu_budget.cli"]
    subprocess.run([*cli, "budget", "set", "clisweep", "--hourly-cap", "100"], env=env, check=True)
    subprocess.run(
        [*cli, "budget", "set", "clisweep/team", "--hourly-cap", "100", "--new"],
        env=env,
        check=True,
    )
    done = subprocess.run(
        [*cli, "sweep", str(tmp_path / "sweep.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["trial", "lr"])
    assert "state" in header and "cost_usd" in header
    rows = [line.split() for line in lines[lines.index(header) + 1 :] if line[:1] == " "]
    assert [r[0] for r in rows] == ["0", "1", "2"] and all("Completed" in r for r in rows), lines
    [results] = [line for line in lines if line.startswith("results: ")]
    assert (Path(results.split(": ", 1)[1]) / "trials.csv").is_file()

    listed = subprocess.run(
        [*cli, "ledger", "--json"], env=env, capture_output=True, text=True, check=True
    )
    jobs = json.loads(listed.stdout)
    assert sorted(j["name"] for j in jobs) == [f"{spec['name']}/000{i}" for i in range(3)]
    assert {j["outcome"] for j in jobs} == {"completed"} and all(j["flow_run_id"] for j in jobs)
    assert sorted((j["sweep"], j["trial"]) for j in jobs) == [(spec["name"], i) for i in range(3)]
    table = subprocess.run([*cli, "ledger"], env=env, capture_output=True, text=True, check=True)
    assert table.stdout.count("settled (completed)") == 3, table.stdout

    typo = tmp_path / "typo.yaml"
    typo.write_text(json.dumps({**spec, "paralelism": 2}))
    bad = subprocess.run([*cli, "sweep", str(typo)], env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: paralelism: unknown field; did you mean parallelism?"

    bad = subprocess.run(
        [*cli, "sweep", str(tmp_path / "missing.yaml")], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        f"error: spec: cannot read {tmp_path / 'missing.yaml'}: No such file or directory"
    ]

"""`gpu_sweep` end to end on a real Prefect server: trials, metrics, artifacts, failures as rows."""

from __future__ import annotations

import json
import sys

import pytest
from prefect.client.orchestration import get_client

from prefect_gpu_budget import GpuBudget, SpendLedger
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.sweeps.flow import gpu_sweep
from prefect_gpu_budget.sweeps.spec import SweepSpec

TRIAL = (
    "import json, os, sys\n"
    "lr, width = float(sys.argv[1]), int(sys.argv[2])\n"
    "if lr > 1: sys.exit(3)\n"
    "out = open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a')\n"
    "for step in (1, 2, 3): out.write(json.dumps({'step': step, 'loss': lr * width / step}) + '\\n')\n"
    "out.write(json.dumps({'summary': True, 'loss': lr * width / 3, 'accuracy': 0.5}) + '\\n')\n"
)


def _spec(tmp_path, **overrides) -> SweepSpec:
    script = tmp_path / "trial.py"
    script.write_text(TRIAL)
    fields = {
        "name": "unit",
        "scope": "lab/sweeps/agent-1",
        "job": {"instance_type": "local:box", "max_runtime": "30s", "kill_grace": "1s"},
        "command": [sys.executable, str(script), "{lr}", "{width}"],
        "grid": {"lr": [0.1, 0.5, 2.0], "width": [4, 8]},
        "parallelism": 3,
        "results_dir": str(tmp_path / "results"),
    }
    fields.update(overrides)
    return SweepSpec.model_validate(fields)


def test_sweep_end_to_end(prefect_api, prices, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd="7.2", period_budget_usd=10, period="day").apply(ledger)
    GpuBudget(scope="lab/sweeps").apply(ledger)  # the team the sweep's scope names
    df = gpu_sweep(_spec(tmp_path), ledger=SpendLedger(database_url=url))

    assert len(df) == 6
    done = df[df["state"] == "Completed"]
    failed = df[df["state"] != "Completed"]
    assert len(done) == 4 and set(failed["lr"]) == {2.0}
    assert all("exit code 3" in reason for reason in failed["reason"])
    assert done.set_index(["lr", "width"])["loss"].to_dict()[(0.5, 8)] == pytest.approx(0.5 * 8 / 3)
    # the ledger charged exactly what the trials report
    charged = sum(r["actual_micro"] for r in ledger.views.jobs("lab"))
    assert charged == round(df["cost_usd"].sum() * 1_000_000)
    run_dir = next((tmp_path / "results").glob("unit-*"))
    for name in (
        "trials.csv",
        "trials.parquet",
        "metric_vs_params.png",
        "learning_curves.png",
        "spend.png",
        "forecast.png",
    ):
        assert (run_dir / name).stat().st_size > 0, name

    with get_client(sync_client=True) as client:
        keys = {a.key: a for a in client.read_artifacts() if a.key}
    assert len(json.loads(keys["unit-trials"].data)) == 6
    summary = keys["unit-summary"].data
    assert "best trial" in summary and "data:image/png;base64," in summary
    assert keys["unit-progress"].data == 100.0
    assert "trials admitted" in keys["unit-forecast"].data


def test_a_sweep_asking_for_accelerators_shows_where_each_trial_ran(prefect_api, prices, tmp_path):
    """Trials asking for `H100:8` are placed on the team's pool; the table lists each trial's
    places and their cost, and the ledger row keeps why (`choice`)."""
    from prefect_gpu_budget.admission.prices import default_catalog
    from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota
    from prefect_gpu_budget.pricing.catalog import set_local_price

    set_local_price("h100a", "7.2", gpus=8, path=prices)
    default_catalog.cache_clear()
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", period_budget_usd=10, period="day").apply(ledger)
    GpuBudget(scope="lab/sweeps").apply(ledger)
    node = (8, 192, 2048)
    ledger.config.set_pool(
        Pool("lab", "lab-a", 2, node, ("local:h100a",), "H100"),
        [TeamQuota("lab-a", "lab/sweeps", (16, 384, 4096), borrow_pct=0)],
    )
    job = {"accelerators": "H100:8", "max_runtime": "30s", "kill_grace": "1s"}
    spec = _spec(tmp_path, job=job, grid={"lr": [0.1], "width": [4, 8]})
    df = gpu_sweep(spec, ledger=SpendLedger(database_url=url))

    assert list(df["state"]) == ["Completed", "Completed"]
    for cell, cost in zip(df["placements"], df["cost_usd"], strict=True):
        assert cell.startswith("local:h100a on-demand: completed, $"), cell
        assert cost > 0
    rows = ledger.views.jobs("lab")
    assert len(rows) == 2 and all('"accelerators": "H100:8"' in r["choice"] for r in rows)


def test_a_cancelled_sweeps_state_raises_as_prefect_does_and_keeps_its_table():
    """What a stopped sweep's run ends with: asked for its result it raises Prefect's
    `CancelledRun` (never a TypeError about a DataFrame); the table stays on the exception."""
    import pickle

    import pandas as pd
    from prefect.exceptions import CancelledRun
    from prefect.states import Cancelled

    from prefect_gpu_budget.sweeps.flow import SweepCancelled

    df = pd.DataFrame([{"trial": 0, "state": "Cancelled", "reason": "stopped by Ctrl-C"}])
    state = Cancelled(message="0 of 1 trials completed", data=SweepCancelled("stopped", df))
    with pytest.raises(CancelledRun, match="stopped"):
        state.result()
    kept = state.result(raise_on_failure=False)
    assert kept.trials.equals(df)
    assert pickle.loads(pickle.dumps(kept)).trials.equals(df)


def test_agent_artifact_keys_differ_for_names_that_read_alike(tmp_path):
    """`acme/ml/agent-x` + `y` and `acme/ml/agent` + `x-y` slug alike; their keys must not."""
    from prefect_gpu_budget.sweeps.flow import artifact_key

    one = _spec(tmp_path, scope="acme/ml/agent-x", name="y")
    two = _spec(tmp_path, scope="acme/ml/agent", name="x-y")
    three = _spec(tmp_path, scope="acme/ml/agent_x", name="y")
    keys = {artifact_key(s, agent=True) for s in (one, two, three)}
    assert len(keys) == 3, keys
    assert all(k.startswith("agent-acme-ml-agent-x-y-") for k in keys), keys
    assert artifact_key(one, agent=False) == "y"


NON_FINITE_TRIAL = (
    "import os, sys\n"
    "lr = float(sys.argv[1])\n"
    "out = open(os.environ['GPU_BUDGET_METRICS_FILE'], 'a')\n"
    'out.write(\'{"step": 0, "loss": %r}\\n\' % lr)\n'
    "for bad in ('NaN', '1e999', '-Infinity'): out.write('{\"step\": 1, \"loss\": %s}\\n' % bad)\n"
)
"""A trial that reports a finite loss, then NaN, 1e999 (parsed as infinity) and -Infinity."""


def test_a_trial_cannot_erase_its_metric_with_nan_or_infinities(prefect_api, prices, tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", hourly_cap_usd="7.2", period_budget_usd=10, period="day").apply(ledger)
    GpuBudget(scope="lab/sweeps").apply(ledger)
    script = tmp_path / "nan.py"
    script.write_text(NON_FINITE_TRIAL)
    spec = _spec(
        tmp_path,
        name="nonfinite",
        command=[sys.executable, str(script), "{lr}"],
        grid={"lr": [0.25, 0.5]},
    )
    df = gpu_sweep(spec, ledger=SpendLedger(database_url=url))

    assert list(df["state"]) == ["Completed", "Completed"]
    assert list(df["loss"]) == [0.25, 0.5]
    assert list(df["non_finite_dropped"]) == [3, 3]
    [run_id] = {r["flow_run_id"] for r in ledger.views.jobs("lab/sweeps/agent-1")}
    store = ledger.sweeps
    assert [(t["metrics"], t["non_finite_dropped"]) for t in store.trials(run_id)] == [
        ({"loss": 0.25}, 3),
        ({"loss": 0.5}, 3),
    ]
    assert store.records(run_id, 0, 0, 10) == [{"step": 0, "loss": 0.25}, *[{"step": 1}] * 3]
    assert "best trial 0: loss 0.25" in store.output(run_id, "summary.md")[1].decode()
    assert "best loss 0.25 (trial 0)" in store.sweep(run_id)["message"]
    assert "learning_curves.png" in store.outputs(run_id)

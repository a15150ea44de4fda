"""A sweep's plots are one registered function each (`sweeps/pictures.py`): a plot added there is
drawn by every sweep, shown on its summary artifact and kept with its outputs."""

from __future__ import annotations

from prefect.client.orchestration import get_client

from prefect_gpu_budget import GpuBudget, SpendLedger
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.sweeps import pictures
from prefect_gpu_budget.sweeps.flow import gpu_sweep
from tests.sweeps.test_flow import _spec


def test_a_registered_plot_is_drawn_shown_and_kept(prefect_api, prices, tmp_path, monkeypatch):
    seen = []

    def cost_per_trial(sweep: pictures.FinishedSweep):
        seen.append((len(sweep.trials), len(sweep.jobs), sweep.budget_micro))
        plt = pictures.plots.pyplot()
        fig, ax = plt.subplots()
        ax.bar(sweep.trials["trial"].astype(str), sweep.trials["cost_usd"])
        return pictures.plots.save_png(plt, fig, sweep.out / "cost_per_trial.png")

    monkeypatch.setattr(pictures, "SWEEP_PLOTS", list(pictures.SWEEP_PLOTS))
    pictures.sweep_plot(cost_per_trial)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    GpuBudget(scope="lab", period_budget_usd=10, period="day").apply(ledger)
    GpuBudget(scope="lab/sweeps").apply(ledger)
    spec = _spec(tmp_path, name="drawn", grid={"lr": [0.1], "width": [4, 8]})
    gpu_sweep(spec, ledger=SpendLedger(database_url=url))

    assert seen == [(2, 2, 10_000_000)]  # the finished sweep: its trials, jobs and budget
    run_dir = next((tmp_path / "results").glob("drawn-*"))
    assert (run_dir / "cost_per_trial.png").stat().st_size > 1000
    with get_client(sync_client=True) as client:
        summary = {a.key: a for a in client.read_artifacts() if a.key}["drawn-summary"].data
    assert "### cost_per_trial" in summary and "### spend" in summary
    run_id = ledger.sweeps.latest(spec.scope, spec.name, since=0)
    assert "cost_per_trial.png" in ledger.sweeps.outputs(run_id)  # what the agents' door serves

"""The spend report flow on a real Prefect server, over SQLite and PostgreSQL ledgers."""

from __future__ import annotations

import json
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.blocks import SpendLedger
from prefect_gpu_budget.flows.spend_report import STATUS_NAMES, spend_report
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import BudgetInputError, rate_cents
from tests.support.jobs import new_job


def _queued_job(ledger, scope: str, rate_micro: int) -> str:
    """A job that asks for admission once and stays queued, with the reason it waits."""
    job_id, decision = ledger.queue.request(
        new_job(
            scope,
            name="waiter",
            rate_micro_per_hour=rate_micro,
            rate_cents=rate_cents(rate_micro),
        )
    )
    assert decision.verdict == "wait"
    assert ledger.queue.try_admit(job_id, scope).verdict == "wait"
    return job_id


@pytest.mark.timeout(180)
def test_spend_report_publishes_tables_summary_and_plots(
    prefect_api, ledger, ledger_url, prices, tmp_path
):
    ledger.config.set_budget(
        BudgetRule("rep", hourly_cap_cents=1000, period_budget_micro=5_000_000, period="day")
    )
    ledger.config.set_budget(BudgetRule("rep/team"))  # the team the jobs' scopes name
    gate = Gate(ledger, catalog=Catalog.load(prices))
    job = GpuJob(instance_type="local:box", max_runtime="1m")
    done = gate.admit(job, "rep/team/s1")
    gate.holding.started(done, time.time() - 30)
    gate.holding.settle(done, ended_at=time.time(), outcome="completed")
    # two running jobs fill the $10/h cap ($7.20/h), so a third at $3.60/h must wait
    running = [gate.admit(job, f"rep/team/s{i}") for i in (2, 3)]
    try:
        for admission in running:
            gate.holding.started(admission, time.time() - 5)
        waiter = _queued_job(ledger, "rep/team/s4", done.quote.rate_micro_per_hour)
        reason = ledger.views.job(waiter)["reason"]
        assert reason

        out = tmp_path / "reports"
        state = spend_report(
            hours=1.0,
            ledger=SpendLedger(database_url=ledger_url),
            out_dir=str(out),
            return_state=True,
        )
        assert state.is_completed(), state.message
        df = state.result()
        flow_run_id = state.state_details.flow_run_id
    finally:
        for admission in running:
            gate.holding.settle(admission, ended_at=time.time(), outcome="completed")

    settled = [r for r in ledger.views.jobs() if r["state"] == "settled" and r["id"] == done.job_id]
    charged = sum(r["actual_micro"] for r in settled)
    assert charged > 0
    row = df.set_index("scope").loc["rep"]
    assert round(row["settled_in_period_usd"] * 1_000_000) == charged
    assert round(row["window_spend_usd"] * 1_000_000) == charged
    assert row["running"] == 2 and row["queued"] == 1 and row["window_jobs"] == 4
    assert row["hourly_cap_usd_per_h"] == 10.0 and row["running_rate_usd_per_h"] == 7.2
    for old_name, name in STATUS_NAMES.items():  # `status --json`'s names, beside the old ones
        assert row[name] == row[old_name], name
    assert row["period_budget_usd"] == 5.0 and row["remaining_usd"] < 5.0 - charged / 1e6
    assert row["mean_wait_s"] >= 0 and row["p95_wait_s"] >= row["mean_wait_s"] - 1e-9

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    by_key = {a.key: a for a in artifacts}
    assert set(by_key) == {
        "gpu-budget-spend-report",
        "gpu-budget-top-jobs",
        "gpu-budget-spend-summary",
    }
    table = json.loads(by_key["gpu-budget-spend-report"].data)
    assert [r["scope"] for r in table] == ["rep", "rep/team"]  # every budget, the team's too
    assert round(table[0]["settled_in_period_usd"] * 1_000_000) == charged
    assert round(table[0]["settled_usd"] * 1_000_000) == charged
    top = json.loads(by_key["gpu-budget-top-jobs"].data)
    assert len(top) == 4 and top[0]["id"] in {a.job_id[:8] for a in (done, *running)}
    assert max(r["actual_usd"] for r in top) == top[0]["actual_usd"]
    summary = by_key["gpu-budget-spend-summary"].data
    assert "Total spend in window" in summary and waiter[:8] in summary and reason in summary
    assert "data:image/png;base64," in summary

    assert (out / "spend-rep.png").stat().st_size > 1000
    assert (out / "queue-wait.png").stat().st_size > 1000


def test_spend_report_rejects_a_bad_window(prefect_api, tmp_path):
    with pytest.raises(BudgetInputError, match="hours"):
        spend_report(hours=-1.0, out_dir=str(tmp_path))


@pytest.mark.timeout(180)
def test_spend_report_shows_team_quotas_and_the_capacity_queue(prefect_api, tmp_path):
    from prefect_gpu_budget.admission.ledger import Ledger
    from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota, proportional

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(BudgetRule("cap", period_budget_micro=10**9))
    pool = Pool("cap", "lab-a", 2, (8, 192, 2048), ("local:box",), "H100")
    ledger.config.set_pool(
        pool,
        [
            TeamQuota("lab-a", "cap/a", proportional(pool, 8), borrow_pct=100),
            TeamQuota("lab-a", "cap/b", proportional(pool, 8), weight=20),
        ],
    )
    job = new_job("cap/a/s", rate_micro_per_hour=1_000_000, rate_cents=100, node_gpus=8)
    ledger.queue.request(job)
    ledger.queue.request(job)  # borrowed from b
    waiter, decision = ledger.queue.request(job)
    assert decision.verdict == "wait"

    state = spend_report(
        ledger=SpendLedger(database_url=url), out_dir=str(tmp_path / "r"), return_state=True
    )
    assert state.is_completed(), state.message
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    by_key = {a.key: json.loads(a.data) for a in artifacts if a.key.startswith("gpu-budget-c")}
    by_key.update({a.key: json.loads(a.data) for a in artifacts if a.key.endswith("quotas")})
    quotas = {r["team"]: r for r in by_key["gpu-budget-team-quotas"]}
    assert quotas["cap/a"]["used_gpus"] == 16 and quotas["cap/a"]["borrowed_gpus"] == 8
    assert quotas["cap/b"]["quota_vcpu"] == 192 and quotas["cap/b"]["lent_gpus"] == 8
    [queued] = by_key["gpu-budget-capacity-queue"]
    assert queued["job_id"] == waiter[:8] and "cap/a" in queued["reason"]


def test_spend_report_sets_the_bill_beside_the_settlements(
    prefect_api, ledger, ledger_url, tmp_path
):
    from prefect_gpu_budget.billing.lines import BillLine
    from prefect_gpu_budget.billing.trueup import month_of
    from tests.support.jobs import ran_job

    ledger.config.set_budget(BudgetRule("bil", period_budget_micro=100 * 10**6, period="month"))
    start = time.time() - 5 * 86400
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start))
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start + 3600))
    sagemaker = {"launcher": "sagemaker:lab", "instance_type": "sagemaker:ml.g5.xlarge"}
    jobs = [ran_job(ledger, f"bil/team/s{i}", at, end, 3.6, **sagemaker) for i in (1, 2)]

    def line(job: str | None, usd: float, kind: str = "Usage") -> BillLine:
        return BillLine(
            source="aws-cur2",
            billing_period=month_of(start),
            line_id=f"{job}-{usd}",
            line_type=kind,
            usage_start=start,
            usage_end=start + 3600,
            billed_micro=round(usd * 1_000_000),
            currency="USD",
            job_mark=job,
        )

    lines = [line(jobs[0], 2.9), line(jobs[1], 4.1), line(None, 0.7, "Tax")]
    ledger.bills.import_bill("aws-cur2", month_of(start), lines, provisional_hours=0)
    out = tmp_path / "reports"
    state = spend_report(
        hours=24 * 7,
        ledger=SpendLedger(database_url=ledger_url),
        out_dir=str(out),
        return_state=True,
    )
    assert state.is_completed(), state.message
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    [drift] = [a for a in artifacts if a.key == "gpu-budget-bill-drift"]
    rows = {r["scope"]: r for r in json.loads(drift.data)}
    assert rows["bil/team/s1"]["billed_usd"] == 2.9 and rows["bil/team/s1"]["settled_usd"] == 3.6
    assert rows["bil/team/s2"]["drift_usd"] == pytest.approx(0.5)
    assert (out / "settled-vs-billed.png").stat().st_size > 1000

"""The daily import of the cloud's bill (flows/bill_import.py) on a real Prefect server: it
reads the `BillingExport` block it is named, trues the ledger up, publishes the drift per scope
as a table artifact, and tells of a closed period over its budget by the bill with a Prefect
event; with no such block it says so and imports nothing."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from prefect.client.orchestration import get_client

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.blocks import BillingExport, SpendLedger
from prefect_gpu_budget.flows.bill_import import OVER_BY_BILL_EVENT, bill_import
from tests.billing import fixtures
from tests.support.jobs import ran_job
from tests.support.prefect_server import wait_for

NOV = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()


def test_the_daily_import_trues_up_and_tells_of_a_period_over_by_bill(
    prefect_api: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.config.set_budget(
        BudgetRule("acme", period_budget_micro=40 * 10**6, period="month"), now=NOV + 3600
    )
    job = ran_job(  # a SageMaker job: only a job of that cloud is on its bill
        ledger,
        "acme/nlp/a7",
        "2026-11-03T10:00:00Z",
        "2026-11-03T11:20:00Z",
        37.688,
        launcher="sagemaker:lab",
        instance_type="sagemaker:ml.p4d.24xlarge",
    )
    rows = fixtures.cur_rows()
    for row in rows:
        if row["resource_tags"]:
            row["resource_tags"] = {"user_gpu_budget_job": job}
    export = fixtures.write_parquet(tmp_path / "part-0.parquet", rows)
    name = f"lab-{int(time.time() * 1000)}"
    BillingExport(kind="file", paths=[str(export)], provisional_hours=0).save(name)

    [done] = bill_import(export=name, ledger=SpendLedger(database_url=url))
    assert (done["source"], done["billing_period"], done["jobs_final"]) == (
        "aws-cur2",
        "2026-11",
        1,
    )
    [over] = done["over_by_bill"]
    assert (over["scope"], over["spent_micro"]) == ("acme", 45_251_000)
    with get_client(sync_client=True) as client:
        artifact = client.read_latest_artifacts()
    assert any(a.key == "gpu-bill-drift" for a in artifact), artifact

    def told() -> list:
        body = {"filter": {"event": {"name": [OVER_BY_BILL_EVENT]}}, "limit": 10}
        found = httpx.post(f"{prefect_api}/events/filter", json=body, timeout=30).json()
        return [e for e in found["events"] if e["resource"]["gpu-budget.scope"] == "acme"]

    [event] = wait_for(told, 60, "the over-by-bill event")
    assert event["payload"]["spent_usd"] == 45.251 and event["payload"]["budget_usd"] == 40.0
    again = bill_import(export=name, ledger=SpendLedger(database_url=url))
    assert [d["changed"] for d in again] == [False] and again[0]["over_by_bill"] == []
    ledger.db.dispose()


def test_with_no_block_it_says_so_and_imports_nothing(prefect_api: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    assert bill_import(export="nothing-saved-here", ledger=SpendLedger(database_url=url)) == []

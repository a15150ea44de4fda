"""The ledger survives the database dropping its connections (as a PostgreSQL restart does)."""

from __future__ import annotations

import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.policy import BudgetRule
from tests.conftest import PG_URL, _fresh_pg


def _job() -> NewJob:
    return NewJob(
        scope="rc/t",
        name="j",
        instance_type="local:box",
        provisioning="on-demand",
        nodes=1,
        rate_micro_per_hour=3_600_000,
        rate_cents=360,
        priority=0,
        max_runtime_s=60.0,
        expected_runtime_s=None,
        holder="here:1:1",
    )


def test_calls_go_on_after_the_server_drops_every_connection():
    from prefect_gpu_budget.admission.ledger import Ledger, normalise_url

    _fresh_pg()
    ledger = Ledger(PG_URL)
    ledger.set_budget(BudgetRule("rc", hourly_cap_cents=10_000))
    job_id, decision = ledger.request(_job())
    assert decision.verdict == "admit"
    killer = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
    with killer.connect() as conn:
        killed = conn.execute(
            sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'prefect-gpu-budget' AND pid <> pg_backend_pid()"
            )
        ).scalar_one()
    killer.dispose()
    assert killed >= 1
    row = ledger.settle(
        job_id, ended_at=ledger.job(job_id)["admitted_at"] + 1, outcome="completed", scope="rc/t"
    )
    assert row is not None and row["state"] == "settled"
    assert ledger.request(_job())[1].verdict == "admit"
    ledger.dispose()

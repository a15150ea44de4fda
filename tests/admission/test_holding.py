"""What an admitted job holds and how it gives it back (admission/holding.py): its slots go back
while its row settles, and a settlement waits for both."""

from __future__ import annotations

import time

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog


class _ReleaseWatchingLimits:
    """Prefect limits whose release looks, for up to 5 s, for the job's row settled."""

    def __init__(self, ledger) -> None:
        self.ledger, self.job_id = ledger, ""
        self.saw_settled: list[bool] = []

    def ensure(self, caps) -> None:
        pass

    def acquire(self, scopes: list[str], slots: int) -> str:
        return "lease-1"

    def renew(self, lease_id: str) -> bool:
        return True

    def release(self, lease_id: str) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if self.ledger.views.job(self.job_id)["state"] == "settled":
                self.saw_settled.append(True)
                return
            time.sleep(0.02)
        self.saw_settled.append(False)


def test_the_slots_go_back_while_the_row_settles(ledger, prices):
    """One round trip's time, not two: the release is under way while the ledger settles (this
    release returns only once it has seen the row settled), and settle returns after both."""
    ledger.config.set_budget(BudgetRule("both", hourly_cap_cents=3600))
    limits = _ReleaseWatchingLimits(ledger)
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    admission = gate.admit(GpuJob(instance_type="local:box", max_runtime="1m"), "both/t")
    limits.job_id = admission.job_id
    row = gate.holding.settle(admission, ended_at=time.time(), outcome="completed")
    assert row["state"] == "settled"
    assert limits.saw_settled == [True]  # one after the other, it would have seen it open

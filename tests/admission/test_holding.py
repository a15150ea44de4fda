"""What an admitted job holds and how it gives it back (admission/holding.py): its slots go back
while its row settles, and a settlement waits for both."""

from __future__ import annotations

import time

from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.rules.policy import BudgetRule
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


def test_a_stop_read_as_the_admission_is_built_is_named_for_what_it_is(ledger, prices):
    """Its owner stops a pool job while its slots are being taken, and the early watcher's read
    of that stop is still on its way as the admission is built: the job's own thread then sees
    the stop, named `stopped` (not `preempted`, which would queue it again)."""
    import threading

    from prefect_gpu_budget.admission.rules.quota import Pool

    class SlowLimits(_ReleaseWatchingLimits):
        asked = threading.Event()

        def acquire(self, scopes: list[str], slots: int) -> str:
            self.asked.set()
            time.sleep(0.6)
            return "lease-1"

        def release(self, lease_id: str) -> None:
            pass

    ledger.config.set_budget(BudgetRule("q", hourly_cap_cents=3600))
    ledger.config.set_pool(Pool("q", "lab", 1, (1, 8, 32), ("local:box",), "X"))
    read = ledger.views.stop_asked

    def late_for_the_early_watcher(job_id: str) -> str | None:
        if threading.current_thread().name.startswith("gpu-budget-preempt-early"):
            time.sleep(0.3)  # answers after the slots were taken
        return read(job_id)

    ledger.views.stop_asked = late_for_the_early_watcher
    limits = SlowLimits(ledger)
    gate = Gate(ledger, limits, catalog=Catalog.load(prices), preempt_poll_s=0.5)
    got = {}
    job = GpuJob(instance_type="local:box", max_runtime="1m")
    admitting = threading.Thread(target=lambda: got.update(a=gate.admit(job, "q/t")), daemon=True)
    admitting.start()
    assert limits.asked.wait(30)
    [row] = ledger.views.jobs("q/t")
    assert ledger.settlements.ask_stop(row["id"], "stopped by its owner")
    admitting.join(timeout=30)
    admission = got["a"]
    assert admission.preempted.wait(10)
    assert admission.stop_reason == "stopped"
    gate.holding.settle(admission, ended_at=time.time(), outcome="cancelled")

"""The Prefect lease protocol of an admission (admission/leases.py): a job whose scope's last job
was admitted at once asks for its slots while the ledger decides, and what it asked for goes
back whenever the ledger does not admit it under those caps."""

from __future__ import annotations

import threading
import time

import pytest

from prefect_gpu_budget.admission.errors import AdmissionRefused
from prefect_gpu_budget.admission.gate import Gate
from prefect_gpu_budget.admission.holding import Admission
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.pricing.catalog import Catalog
from tests.support.limits import SlowLimits
from tests.support.prefect_server import wait_for

JOB = GpuJob(instance_type="local:box", max_runtime="1m")  # 360 cents an hour


class _Limits(SlowLimits):
    """Prefect limits that answer after a round trip and remember when they were asked."""

    def __init__(self) -> None:
        super().__init__(delay=0.05)
        self.asked_at: list[float] = []

    def acquire(self, scopes: list[str], slots: int) -> str:
        self.asked_at.append(time.monotonic())
        return super().acquire(scopes, slots)


def _asked_while_deciding(ledger, limits: _Limits) -> list[bool]:
    """Per request to the ledger, whether Prefect was asked for its slots before the request
    returned (it waits up to a second for the ask it expects: a thread may start late)."""
    seen: list[bool] = []
    ask = ledger.queue.ask

    def watched(new, job_id, lease=None):
        index = len(seen)
        out = ask(new, job_id, lease)
        deadline = time.monotonic() + 1.0
        while len(limits.asked_at) <= index and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(len(limits.asked_at) > index)
        return out

    ledger.queue.ask = watched
    return seen


def test_a_job_after_one_admitted_at_once_asks_for_its_slots_while_the_ledger_decides(
    ledger, prices
):
    ledger.config.set_budget(BudgetRule("early", hourly_cap_cents=3600))
    limits = _Limits()
    seen = _asked_while_deciding(ledger, limits)
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    first = gate.admit(JOB, "early/t")  # nothing known yet: asked after the ledger admitted
    gate.holding.settle(first, ended_at=time.time(), outcome="completed")
    # the next job of the scope, through a gate with other events (as every task makes one)
    second = gate.with_events(gate.events).admit(JOB, "early/t")
    assert seen == [False, True]
    assert second.lease_id == "lease-2" == ledger.views.job(second.job_id)["lease_id"]
    gate.holding.settle(second, ended_at=time.time(), outcome="completed")
    assert limits.taken == limits.released == ["lease-1", "lease-2"]  # one lease a job


def test_slots_asked_under_caps_that_changed_meanwhile_go_back(ledger, prices):
    """An admin raised the cap between two jobs: the slots asked under the old caps go back and
    the job takes them under the new ones."""
    ledger.config.set_budget(BudgetRule("moved", hourly_cap_cents=3600))
    limits = _Limits()
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    gate.holding.settle(gate.admit(JOB, "moved/t"), ended_at=time.time(), outcome="completed")
    ledger.config.set_budget(BudgetRule("moved", hourly_cap_cents=7200))
    second = gate.admit(JOB, "moved/t")
    assert second.caps == (("moved", 7200),)
    # the early ask and the admission's own run side by side: either may be answered first
    wait_for(lambda: len(limits.released) == 2, 30, "the early lease to go back")
    assert second.lease_id in limits.taken and second.lease_id not in limits.released
    gate.holding.settle(second, ended_at=time.time(), outcome="completed")
    assert sorted(limits.released) == sorted(limits.taken) == ["lease-1", "lease-2", "lease-3"]


@pytest.mark.usefixtures("prefect_api")
def test_an_early_ask_over_a_limit_prefect_does_not_have_takes_real_slots(ledger, prices):
    """Prefect grants a lease over a limit it does not have and takes none of its slots. An
    early ask can come first: beside the admission that makes its scope's limits, or after a
    limit was deleted. The lease goes back, the limit is made again, and the job holds real
    slots (it ran with none: Prefect counted 720 for three jobs of 360)."""
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.limits import RateLimits, limit_name

    ledger.config.set_budget(BudgetRule("gone", hourly_cap_cents=720))
    limits = RateLimits()
    gate = Gate(ledger, limits, catalog=Catalog.load(prices), recheck_s=3600)
    first = gate.admit(JOB, "gone/t")
    gate.holding.settle(first, ended_at=time.time(), outcome="completed")
    assert "gone/t" in gate.leases.admitted_at_once  # the next job of the scope asks early
    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name(limit_name("gone"))
    second = gate.admit(JOB, "gone/t")
    try:
        assert limits.active_slots("gone") == 360
    finally:
        gate.holding.settle(second, ended_at=time.time(), outcome="completed")
    assert limits.active_slots("gone") == 0
    limits.close()


@pytest.mark.usefixtures("prefect_api")
def test_slots_asked_for_a_job_the_ledger_makes_wait_go_back_at_once(ledger, prices):
    """Real Prefect limits with room (the hourly cap fits two jobs) while the org's period
    budget has none: the second job's early slots go back as soon as it is told it waits, not
    when it ends, and its scope's next job asks for none while the decision is pending."""
    from prefect_gpu_budget.admission.limits import RateLimits

    ledger.config.set_budget(BudgetRule("spec", hourly_cap_cents=720))
    limits = RateLimits()
    acquired: list[str] = []
    acquire = limits.acquire

    def counted(scopes: list[str], slots: int) -> str | None:
        lease = acquire(scopes, slots)
        acquired.append(str(lease))
        return lease

    limits.acquire = counted  # type: ignore[method-assign]
    gate = Gate(ledger, limits, catalog=Catalog.load(prices), recheck_s=3600)
    running = gate.admit(JOB, "spec/t")
    assert limits.active_slots("spec") == 360
    full = ledger.views.job(running.job_id)["reserved_micro"]
    ledger.config.set_budget(
        BudgetRule("spec", hourly_cap_cents=720, period_budget_micro=full, period="month")
    )
    refused: list[AdmissionRefused] = []

    def waiter() -> None:
        try:
            gate.admit(GpuJob(instance_type="local:box", max_runtime="1m", max_wait=6), "spec/t")
        except AdmissionRefused as exc:
            refused.append(exc)

    thread = threading.Thread(target=waiter)
    try:
        thread.start()
        wait_for(lambda: ledger.views.jobs("spec", states=("queued",)), 60, "the job to wait")
        # the early ask runs beside the ledger's decision: it may be answered after the job waits
        wait_for(lambda: len(acquired) == 2, 30, "Prefect to answer the early ask")
        assert acquired[1] != "None", acquired  # asked early: given
        wait_for(lambda: limits.active_slots("spec") == 360, 30, "the early slots to go back")
        assert "spec/t" not in gate.leases.admitted_at_once
        thread.join(timeout=60)
        assert refused and refused[0].state_name == "AdmissionTimeout"
        assert limits.active_slots("spec") == 360 and len(acquired) == 2
    finally:
        thread.join(timeout=60)
        gate.holding.settle(running, ended_at=time.time(), outcome="completed")
    assert limits.active_slots("spec") == 0
    limits.close()


def test_a_job_that_waited_takes_slots_of_its_own_not_those_it_gave_back(ledger, prices):
    """Prefect has room, the ledger's period budget has not: the waiter's early slots go back
    when it is told it waits, and once admitted it holds a lease of its own, not the one it
    gave back (which would leave its slots uncounted while it runs)."""
    ledger.config.set_budget(BudgetRule("late", hourly_cap_cents=3600))
    limits = _Limits()
    gate = Gate(ledger, limits, catalog=Catalog.load(prices), recheck_s=3600)
    first = gate.admit(JOB, "late/t")  # admitted at once: the scope's next job asks early
    full = ledger.views.job(first.job_id)["reserved_micro"]
    ledger.config.set_budget(  # room for one reservation, not two
        BudgetRule("late", hourly_cap_cents=3600, period_budget_micro=2 * full - 1)
    )
    got: dict[str, Admission] = {}
    waiter = threading.Thread(target=lambda: got.update(second=gate.admit(JOB, "late/t")))
    waiter.start()
    wait_for(lambda: ledger.views.jobs("late", states=("queued",)), 60, "the second job to wait")
    wait_for(lambda: limits.released == ["lease-2"], 30, "its early slots to go back")
    gate.holding.settle(first, ended_at=time.time(), outcome="completed")
    waiter.join(timeout=60)
    second = got["second"]
    assert second.lease_id == ledger.views.job(second.job_id)["lease_id"] == "lease-3"
    assert limits.released == ["lease-2", "lease-1"]  # its own lease is still held
    gate.holding.settle(second, ended_at=time.time(), outcome="completed")
    assert sorted(limits.released) == sorted(limits.taken) == ["lease-1", "lease-2", "lease-3"]


def test_a_job_stopped_while_its_slots_are_refused_ends_cancelled(ledger, prices):
    """The ledger admits the job, Prefect's limit is full (an admission elsewhere holds it), and
    its owner stops it while the gate retries: when the gate gives the admission back, the job
    ends Cancelled, not queued again until its max wait runs out."""
    from prefect_gpu_budget.admission.stopping import stop_job

    class Full(SlowLimits):
        def acquire(self, scopes: list[str], slots: int) -> None:
            self.asked.set()
            return None

    ledger.config.set_budget(BudgetRule("full", hourly_cap_cents=3600))
    limits = Full(delay=0)
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    refused: list[AdmissionRefused] = []

    def admit() -> None:
        try:
            gate.admit(GpuJob(instance_type="local:box", max_runtime="1m", max_wait=120), "full/t")
        except AdmissionRefused as exc:
            refused.append(exc)

    waiter = threading.Thread(target=admit, daemon=True)
    waiter.start()
    assert limits.asked.wait(60)
    [row] = ledger.views.jobs("full", states=("admitted",))
    assert stop_job(ledger, row["id"], "full/t", "stopped by its owner") == "stopping"
    waiter.join(timeout=60)
    assert not waiter.is_alive() and refused and refused[0].state_name == "Cancelled"
    assert ledger.views.job(row["id"])["state"] == "cancelled"


@pytest.mark.parametrize("lapsed", [False, True])
def test_slots_asked_early_are_renewed_before_a_slow_decision_takes_them_over(
    ledger, prices, monkeypatch, lapsed
):
    """A ledger slow to decide (an outage, retried): the early lease is past half its life, so
    it is renewed before the admission takes it over; one Prefect no longer knows is not taken
    over, and the job takes slots of its own."""
    from prefect_gpu_budget.admission import leases

    monkeypatch.setattr(leases, "LEASE_S", 0.4)
    renewed: list[str] = []

    class Renewing(_Limits):
        def renew(self, lease_id: str) -> bool:
            renewed.append(lease_id)
            return not (lapsed and lease_id == "lease-2")  # the early one

    ledger.config.set_budget(BudgetRule("lapse", hourly_cap_cents=3600))
    limits = Renewing()
    gate = Gate(ledger, limits, catalog=Catalog.load(prices))
    gate.holding.settle(gate.admit(JOB, "lapse/t"), ended_at=time.time(), outcome="completed")
    ask = ledger.queue.ask

    def slow(new, job_id, lease=None):  # decides once the early lease is past half its life
        wait_for(lambda: len(limits.taken) == 2, 30, "Prefect to answer the early ask")
        time.sleep(0.3)
        return ask(new, job_id, lease)

    ledger.queue.ask = slow
    second = gate.admit(JOB, "lapse/t")
    assert renewed[:1] == ["lease-2"]
    assert second.lease_id == ("lease-3" if lapsed else "lease-2")
    gate.holding.settle(second, ended_at=time.time(), outcome="completed")
    wait_for(lambda: sorted(limits.released) == sorted(limits.taken), 30, "every lease back")

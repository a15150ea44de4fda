"""Stopping a job at its owner's word (admission/stopping.py)."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.stopping import CANCELLED, STOPPING, stop_job
from tests.support.jobs import new_job


def test_a_job_that_moves_between_queued_and_admitted_as_it_is_stopped_is_still_stopped(ledger):
    """Queued when asked to stop as a running job, admitted when asked as a queued one (an
    admission given back, `unadmit`, and another's decision): the stop is asked again."""
    ledger.config.set_budget(BudgetRule("mv", hourly_cap_cents=360))
    ledger.queue.request(new_job("mv/t"))
    waiting, decision = ledger.queue.request(new_job("mv/t"))
    assert decision.verdict == "wait"
    cancel_queued, moved = ledger.queue.cancel_queued, []

    def admitted_meanwhile(*args, **kwargs) -> bool:
        if not moved:  # the first ask finds it admitted; it is queued again at once
            moved.append(True)
            return False
        return cancel_queued(*args, **kwargs)

    ledger.queue.cancel_queued = admitted_meanwhile
    assert stop_job(ledger, waiting, "mv/t", "stopped by its owner") == CANCELLED
    assert ledger.views.job(waiting)["state"] == "cancelled"

    [running] = ledger.views.jobs("mv", states=("admitted",))
    assert stop_job(ledger, running["id"], "mv/t", "stopped by its owner") == STOPPING
    assert stop_job(ledger, running["id"], "mv/t", "again") == STOPPING  # asked already

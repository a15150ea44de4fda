"""The agents' door over a real Prefect server and a real ledger: what one read of a sweep shows
when a write lands between the reads it is made of."""

from __future__ import annotations

from typing import Any

from prefect_gpu_budget.agents.callers import Caller
from prefect_gpu_budget.agents.door import Door
from prefect_gpu_budget.agents.throttle import LocalStore
from prefect_gpu_budget.units import org_of

SESSION = "doorco/t/s"


def _running_sweep(client: Any) -> str:
    flow_id = client.create_flow_from_name("agent-sweep")
    response = client._client.post(
        "/flow_runs/",
        json={
            "flow_id": str(flow_id),
            "parameters": {"session": SESSION},
            "state": {"type": "RUNNING", "name": "Running"},
        },
    )
    response.raise_for_status()
    return response.json()["id"]


def test_a_cancel_between_the_runs_read_and_the_records_shows_the_run_cancelling(
    prefect_api: str, ledger: Any, monkeypatch: Any
) -> None:
    from prefect.client.orchestration import get_client

    from prefect_gpu_budget.admission.rules.policy import BudgetRule

    ledger.config.set_budget(BudgetRule(org_of(SESSION)))
    with get_client(sync_client=True) as client:
        door = Door(ledger, client, throttles=LocalStore())
        caller = Caller(session=SESSION, grant="g")
        run_id = _running_sweep(client)
        assert door.sweep(caller, run_id)["state"] == "Running"
        read_cancelled = ledger.sweeps.cancelled
        landed: list[dict[str, Any]] = []

        def cancel_lands_first(asked: str) -> bool:  # after the door read the run
            if not landed:
                landed.append(door.cancel_sweep(caller, run_id))
            return read_cancelled(asked)

        monkeypatch.setattr(ledger.sweeps, "cancelled", cancel_lands_first)
        view = door.sweep(caller, run_id)
    assert landed and view["cancelled"] is True
    assert view["state"] == "Cancelling", view

"""`deploy` registers the deployments on a work pool, schedules and parameters included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate

from prefect_gpu_budget.deployments import EXAMPLE_SPEC, ROOT, deploy


@pytest.fixture
def deployed(prefect_api) -> Iterator[list]:
    """The deployments on a process work pool of the session's server, deleted after: `serve`
    in a later test of the same server upserts the same names, and a run of it would take this
    one's pull steps."""
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="gpu-test", type="process"))
    ids = deploy("gpu-test", sweep_cron="30 1 * * *")
    try:
        yield ids
    finally:
        with get_client(sync_client=True) as client:
            for deployment_id in ids:
                client.delete_deployment(deployment_id)
            client.delete_work_pool("gpu-test")


def test_deploy_to_a_process_work_pool(deployed):
    ids = deployed
    assert len(ids) == 5
    with get_client(sync_client=True) as client:
        mine = [d for d in client.read_deployments() if d.work_pool_name == "gpu-test"]
        flows = {f.id: f.name for f in client.read_flows()}
    assert {(flows[d.flow_id], d.name) for d in mine} == {
        ("gpu-sweep", "sweep"),
        ("gpu-budget-spend-report", "daily"),
        ("gpu-budget-bill-import", "daily"),
        ("gpu-budget-reconcile", "every-5-minutes"),
        ("agent-sweep", "agents"),
    }
    found = {d.name: d for d in mine}
    [bill] = [d for d in mine if d.entrypoint.endswith("bill_import.py:bill_import")]
    assert bill.schedules[0].schedule.cron == "0 6 * * *"
    sweep = found["sweep"]
    assert sweep.entrypoint == "prefect_gpu_budget/sweeps/flow.py:gpu_sweep"
    assert sweep.pull_steps[0]["prefect.deployments.steps.set_working_directory"][
        "directory"
    ] == str(ROOT)
    [schedule] = sweep.schedules
    assert schedule.schedule.cron == "30 1 * * *"
    assert schedule.parameters["spec"]["name"] == "nightly"  # the schedule carries the sweep
    assert EXAMPLE_SPEC.exists()

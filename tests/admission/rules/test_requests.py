"""A queued job as the decision sees it (admission/rules/requests.py): built the same from the
row the ledger records and from the `NewJob` it records it from."""

from __future__ import annotations

from prefect_gpu_budget.admission.ledger import NewJob
from prefect_gpu_budget.admission.rules.requests import Request
from tests.admission.rules.pools import job


def test_a_request_carries_what_the_decision_reads_of_its_job():
    asked = NewJob(
        scope="acme/vision/agent-7",
        name="sweep/0003",
        instance_type="local:box",
        provisioning="on-demand",
        nodes=2,
        rate_micro_per_hour=7_200_000,
        rate_cents=720,
        priority=5,
        max_runtime_s=600.0,
        expected_runtime_s=120.0,
        holder="host:1:1",
        on_limit="reject",
        max_wait_s=30.0,
    )
    shape = job("acme/vision", 8, 2)
    req = Request.of("j1", asked, 1000.0, shape)
    assert req == Request(
        "j1",
        "acme/vision/agent-7",
        7_200_000,
        720,
        600.0,
        120.0,
        5,
        1000.0,
        on_limit="reject",
        max_wait_s=30.0,
        shape=shape,
    )
    assert Request.of("j1", asked, 1000.0).shape is None  # no pool: no shape

"""A job that asks for accelerators, placed through the ledger on SQLite and PostgreSQL: a pool
within the team's quota at its local price, a cloud when the quota is used, a budget that leaves
only a cheaper offering, one line and nothing reserved where nothing fits."""

from __future__ import annotations

import time

import pytest

from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.admission.rules.quota import Pool, TeamQuota
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.placement.choice import Unplaceable
from prefect_gpu_budget.placement.offerings import Route
from prefect_gpu_budget.placement.placing import place_job
from prefect_gpu_budget.pricing.catalog import Catalog, local_row
from prefect_gpu_budget.units import BudgetInputError
from tests.support.jobs import new_job

NODE = (8, 192, 2048)
VERTEX = Route("vertex-prod", "gcp", ("us-central1",), ("on-demand", "spot", "flex-start"))
POOL = Route("lab-a", "local", pool="lab-a", gpu_model="H200", instance_types=("local:h200x8",))


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.load(local=[local_row("h200x8", "12", 8, 192, 2048)])


@pytest.fixture
def lab(ledger):
    pool = Pool("acme", "lab-a", 1, NODE, ("local:h200x8",), "H200")
    ledger.config.set_pool(pool, [TeamQuota("lab-a", "acme/vision", NODE)])
    ledger.config.set_budget(
        BudgetRule("acme", hourly_cap_cents=20_000, period_budget_micro=10**10)
    )
    return ledger


def _job(**kw) -> GpuJob:
    return GpuJob(accelerators="H200:8", max_runtime="2h", **kw)


def test_a_pool_within_quota_at_its_local_price_is_chosen(lab, catalog):
    placed = place_job(_job(), "acme/vision/s1", lab, catalog=catalog, routes=[POOL, VERTEX])
    assert (placed.job.instance_type, placed.job.pool) == ("local:h200x8", "lab-a")
    assert placed.job.accelerators == "H200:8" and placed.job.placed
    assert placed.launcher is None  # a pool's machine: the local launcher
    lines = placed.lines()
    assert (
        lines[0].startswith("local:h200x8 on-demand (lab-a): $12.00/h x1") and "CHOSEN" in lines[0]
    )
    assert all("costlier than local:h200x8" in line for line in lines[1:])


def test_a_team_whose_quota_is_in_use_goes_to_the_cloud(lab, catalog):
    other = new_job(
        "acme/vision/other",
        instance_type="local:h200x8",
        pool="lab-a",
        node_gpus=8,
        rate_micro_per_hour=12_000_000,
        rate_cents=1200,
    )
    _, decision = lab.queue.request(other)
    assert decision.verdict == "admit", decision
    placed = place_job(_job(), "acme/vision/s1", lab, catalog=catalog, routes=[POOL, VERTEX])
    assert placed.job.instance_type == "gcp:a3-ultragpu-8g" and placed.job.pool is None
    why = {c.offering.launcher: c.passed_over for c in placed.placement.considered}
    assert why["lab-a"] == "pool lab-a: acme/vision's quota has 0 GPUs free"


def test_a_team_with_no_quota_in_the_pool_is_not_offered_it(lab, catalog):
    placed = place_job(_job(), "acme/nlp/s1", lab, catalog=catalog, routes=[POOL, VERTEX])
    assert placed.job.instance_type.startswith("gcp:")
    why = {c.offering.launcher: c.passed_over for c in placed.placement.considered}
    assert why["lab-a"] == "pool lab-a: acme/nlp has no quota there"


def test_an_hourly_cap_leaves_only_the_cheaper_cloud_offering(ledger, catalog):
    ledger.config.set_budget(BudgetRule("acme", hourly_cap_cents=5_000, period_budget_micro=10**10))
    placed = place_job(_job(), "acme/vision", ledger, catalog=catalog, routes=[VERTEX])
    assert (placed.job.instance_type, placed.job.provisioning) == ("gcp:a3-ultragpu-8g", "spot")
    why = {c.offering.provisioning: c.passed_over for c in placed.placement.considered}
    assert why["on-demand"] == "hourly cap of acme: $50.00/h left"


def _waited(ledger, provisioning: str, wait_s: float) -> None:
    """An earlier job of that offering, admitted and started `wait_s` later, then ended."""
    asked = new_job(
        "acme/vision/old",
        instance_type="gcp:a3-ultragpu-8g",
        provisioning=provisioning,
        rate_micro_per_hour=86_760_000,
        rate_cents=8676,
        max_runtime_s=7200,
    )
    job_id, decision = ledger.queue.request(asked)
    assert decision.verdict == "admit", decision
    started = time.time() + wait_s
    assert ledger.settlements.mark_started(job_id, started)
    ledger.settlements.settle(
        job_id, ended_at=started + 60, outcome="completed", scope="acme/vision/old"
    )


def test_a_deadline_none_can_meet_is_one_line_and_reserves_nothing(lab, catalog):
    for _ in range(3):  # on-demand capacity has been taking three hours to come
        _waited(lab, "on-demand", 3 * 3600)
    before = len(lab.views.jobs())
    with pytest.raises(Unplaceable) as refused:
        place_job(_job(deadline="2h"), "acme/vision/s1", lab, catalog=catalog, routes=[VERTEX])
    message = str(refused.value)
    assert message == (
        "accelerators: no offering ends before the deadline (2h); closest: "
        "gcp:a3-ultragpu-8g spot us-central1 (vertex-prod), which may end in 2h11m"
    )
    assert len(lab.views.jobs()) == before  # nothing recorded, nothing reserved


def test_an_accelerator_no_offering_has_is_one_line(lab, catalog):
    with pytest.raises(BudgetInputError, match=r"^accelerators: no offering has H10 "):
        place_job(GpuJob(accelerators="H10:8", max_runtime="1h"), "acme", lab, catalog=catalog)


def test_an_agents_job_is_offered_only_the_launchers_its_team_may_use(lab, catalog):
    """`allowed`: the team's `AgentLimits.launchers`; `local` grants the pools."""
    pools_only = place_job(
        _job(), "acme/vision/s1", lab, catalog=catalog, routes=[POOL, VERTEX], allowed=["local"]
    )
    assert {c.offering.launcher for c in pools_only.placement.considered} == {"lab-a"}
    cloud = place_job(
        _job(),
        "acme/vision/s1",
        lab,
        catalog=catalog,
        routes=[POOL, VERTEX],
        allowed=["vertex:vertex-prod", "sagemaker:vertex-prod"],
    )
    assert {c.offering.launcher for c in cloud.placement.considered} == {"vertex-prod"}
    assert cloud.job.instance_type.startswith("gcp:")
    with pytest.raises(BudgetInputError) as none:
        place_job(_job(), "acme/vision/s1", lab, catalog=catalog, routes=[POOL, VERTEX], allowed=[])
    assert "\n" not in str(none.value) and str(none.value).startswith("accelerators: ")
    assert lab.views.jobs() == []

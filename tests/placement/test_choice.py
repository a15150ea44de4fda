"""The choice: each offering is the right answer in turn, as its prices, waits, interruptions,
the budgets and the deadline make it; and none, with the closest named."""

from __future__ import annotations

import pytest

from prefect_gpu_budget.placement.accelerators import matching, parse_accelerators
from prefect_gpu_budget.placement.choice import (
    Defaults,
    History,
    Need,
    Unplaceable,
    expect,
    place,
)
from prefect_gpu_budget.placement.offerings import Offering, Route, offerings
from prefect_gpu_budget.placement.prices import catalog_rates
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import usd_to_micro

HOUR = 3600.0
VERTEX = Route("vertex-prod", "gcp", ("us-central1",), ("on-demand", "spot", "flex-start"))
SAGEMAKER = Route("sm-prod", "sagemaker", ("us-east-1",), ("on-demand", "spot"))


def _offerings(text: str, *routes: Route) -> list[Offering]:
    catalog = Catalog.load()
    shapes = matching(parse_accelerators(text), catalog.rows())
    rates, _ = catalog_rates(catalog, shapes)
    return offerings(shapes, rates, routes)


def _anything(offering: Offering, reservation: int) -> None:
    return None


def _chosen(placement) -> tuple[str, str]:
    return placement.chosen.offering.key, placement.chosen.offering.provisioning


def test_every_saved_route_is_offered_with_its_clouds_limits():
    found = _offerings("A10G:1", VERTEX, SAGEMAKER)
    assert {(o.key, o.provisioning) for o in found} == {
        ("sagemaker:ml.g5.xlarge", "on-demand"),
        ("sagemaker:ml.g5.xlarge", "spot"),
    }
    assert all(o.runtime_limit_s == 28 * 86400 for o in found)
    flex = [o for o in _offerings("H200:8", VERTEX) if o.provisioning == "flex-start"]
    assert flex and flex[0].runtime_limit_s == 7 * 86400


def test_with_no_deadline_a_resumable_job_goes_to_spot():
    need = Need(nodes=1, runtime_s=4 * HOUR, max_runtime_s=6 * HOUR, resumable=True)
    placed = place(_offerings("L4:1", VERTEX, SAGEMAKER), need, {}, _anything)
    assert placed.chosen.offering.provisioning == "spot"
    assert placed.chosen.reservation_micro > placed.chosen.expected.cost_micro  # worst case held
    assert [c.passed_over for c in placed.considered].count(None) == 1
    assert all("costlier than" in c.passed_over for c in placed.considered if c.passed_over)


def test_a_tight_deadline_and_no_wait_leave_on_demand():
    need = Need(
        nodes=1, runtime_s=2 * HOUR, max_runtime_s=2 * HOUR, max_wait_s=60, deadline_s=2.1 * HOUR
    )
    placed = place(_offerings("A100:1", VERTEX), need, {}, _anything)
    assert _chosen(placed) == ("gcp:a2-highgpu-1g", "on-demand")
    why = {c.offering.provisioning: c.passed_over for c in placed.considered}
    assert "over max wait" in why["spot"] and "over max wait" in why["flex-start"]
    assert why["spot"] == "one start in ten waits over 5m, over max wait"


def test_a_budget_that_refuses_the_dearer_offerings_leaves_flex_start():
    history = {("gcp:a2-highgpu-1g", "spot", "us-central1"): History((60.0,) * 5, 10.0, 8)}
    need = Need(nodes=1, runtime_s=3 * HOUR, max_runtime_s=3 * HOUR, deadline_s=12 * HOUR)

    def cap(offering: Offering, reservation: int) -> str | None:
        if offering.provisioning == "on-demand":
            return "team cap: $5.00/h left"
        return None

    placed = place(_offerings("A100:1", VERTEX), need, history, cap)
    # spot is interrupted 0.8 times an hour here, a non-resumable job loses half its run each
    # time: flex-start, billed at most on-demand, is the cheaper expectation
    assert _chosen(placed) == ("gcp:a2-highgpu-1g", "flex-start")
    assert {c.offering.provisioning: c.passed_over for c in placed.considered}["on-demand"] == (
        "team cap: $5.00/h left"
    )


def test_history_of_a_discounted_bill_makes_flex_start_the_cheapest():
    need = Need(nodes=2, runtime_s=8 * HOUR, max_runtime_s=10 * HOUR)
    offers = _offerings("H200:8", VERTEX)
    flex = ("gcp:a3-ultragpu-8g", "flex-start", "us-central1")
    without = place(offers, need, {}, _anything)
    assert _chosen(without)[1] != "flex-start"  # at its on-demand bound it is not the cheapest
    history = {flex: History((1800.0,) * 4, 40.0, 0, billed_over_reserved=0.35)}
    assert _chosen(place(offers, need, history, _anything)) == ("gcp:a3-ultragpu-8g", "flex-start")


def test_the_clouds_own_limits_pass_over_a_long_job():
    need = Need(nodes=1, runtime_s=8 * 86400, max_runtime_s=10 * 86400)
    placed = place(_offerings("H200:8", VERTEX, SAGEMAKER), need, {}, _anything)
    why = {(c.offering.cloud, c.offering.provisioning): c.passed_over for c in placed.considered}
    assert "runs at most 7d" in why["gcp", "flex-start"]
    assert (
        placed.chosen.offering.cloud == "gcp"
        and placed.chosen.offering.provisioning != "flex-start"
    )


def test_a_pool_within_quota_at_its_local_price_wins():
    pool = Offering(
        "local", "dgx-a", "on-demand", "", "team-pool", "H100 80GB", 8, usd_to_micro(8), pool="dgx"
    )
    need = Need(nodes=1, runtime_s=HOUR, max_runtime_s=HOUR)
    assert place([*_offerings("H100:8", VERTEX), pool], need, {}, _anything).chosen.offering is pool

    def quota(offering: Offering, reservation: int) -> str | None:
        return "pool dgx: team quota of 8 GPUs in use" if offering.pool else None

    placed = place([*_offerings("H100:8", VERTEX), pool], need, {}, quota)
    assert placed.chosen.offering is not pool


def test_a_deadline_no_offering_meets_names_the_closest_and_holds_nothing():
    need = Need(nodes=1, runtime_s=5 * HOUR, max_runtime_s=5 * HOUR, deadline_s=4 * HOUR)
    asked = []

    def fits(offering: Offering, reservation: int) -> None:
        asked.append(offering)

    with pytest.raises(
        Unplaceable, match=r"no offering ends before the deadline \(4h\); closest: "
    ) as e:
        place(_offerings("H100:8", VERTEX, SAGEMAKER), need, {}, fits)
    assert "on-demand" in str(e.value) and "\n" not in str(e.value)
    assert asked == []  # no budget was even asked: nothing to reserve


def test_expected_figures_follow_history_once_there_is_enough():
    offer = _offerings("L4:1", VERTEX)[0]
    need = Need(nodes=1, runtime_s=HOUR, max_runtime_s=HOUR)
    few = History((5000.0,) * 2)
    assert expect(offer, need, few, Defaults()).wait_s == Defaults().wait_s[offer.provisioning]
    many = History((10.0, 20.0, 5000.0))
    expected = expect(offer, need, many, Defaults())
    assert (expected.wait_s, expected.late_wait_s) == (20.0, 5000.0)  # the median, the 9th decile
    assert expected.late_end_s == 5000.0 + HOUR

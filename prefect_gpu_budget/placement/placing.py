"""Placing a job that asks for accelerators: the offerings of the admin's saved launchers and
pools, priced as the gate prices them, each asked of the budgets on the job's path and the
team's pool quota as they stand, each offering's history from the ledger, and the choice. The
job comes back as one that names its machine, provisioning and pool, and passes the gate as any
other: nothing is reserved here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.prices import ledger_prices
from prefect_gpu_budget.admission.rules.quota import team_of
from prefect_gpu_budget.job import GpuJob
from prefect_gpu_budget.placement.accelerators import matching, parse_accelerators
from prefect_gpu_budget.placement.choice import Fits, Need, Placement, place
from prefect_gpu_budget.placement.history import offering_histories
from prefect_gpu_budget.placement.offerings import Offering, Route, offerings, pool_shapes
from prefect_gpu_budget.placement.prices import catalog_rates
from prefect_gpu_budget.placement.routes import (
    allowed_routes,
    launcher_route,
    pool_routes,
    route_ref,
    saved_launchers,
)
from prefect_gpu_budget.pricing.catalog import Catalog
from prefect_gpu_budget.units import fmt_usd, org_of, scope_path


@dataclass(frozen=True)
class Placed:
    """The job as placed (its machine, provisioning, pool), the saved launcher block that
    starts it (None: a pool's, the local launcher), and why."""

    job: GpuJob
    launcher: object | None
    placement: Placement

    def lines(self) -> list[str]:
        return self.placement.lines()


def saved_routes(ledger: Ledger, org: str | None) -> tuple[list[Route], dict[str, object]]:
    """Every saved route, the org's capacity pools and the Prefect API's saved Vertex AI and
    SageMaker launcher blocks (none without an API), and those blocks by name."""
    routes: list[Route] = []
    blocks: dict[str, object] = {}  # by `route_ref`: a Vertex AI and a SageMaker launcher
    for name, block in saved_launchers():  # may share a name
        route = launcher_route(name, block)
        if route is not None:
            routes.append(route)
            blocks[route_ref(route.cloud, route.launcher)] = block
    return [*pool_routes(ledger, org=org), *routes], blocks


def budget_fits(ledger: Ledger, scope: str | None, now: float | None = None) -> Fits:
    """Each offering asked of the budgets on `scope`'s path as they stand now (the new rate
    within each hourly cap, the reservation within each period's remaining budget) and, for a
    pool, of the team's quota there. No scope: every budget and quota fits (a quote of the
    offerings alone)."""
    now = time.time() if now is None else now
    path = set(scope_path(scope)) if scope else set()
    org = scope.split("/")[0] if scope else None
    rules = [r for r in ledger.views.status(org, now=now) if r["scope"] in path] if org else []
    pools = {p["pool"]: p for p in ledger.views.capacity_status(org)} if org else {}
    team = team_of(scope) if scope else None

    def fits(offering: Offering, reservation: int) -> str | None:
        rate = offering.rate_micro_per_hour  # per node: nodes are in the reservation
        for rule in rules:
            cap = rule["hourly_cap_micro"]
            if cap is not None and rule["running_rate_micro"] + rate > cap:
                left = max(cap - rule["running_rate_micro"], 0)
                return f"hourly cap of {rule['scope']}: {fmt_usd(left)}/h left"
            left = rule["remaining_micro"]
            if left is not None and reservation > left:
                return f"{rule['period']} budget of {rule['scope']}: {fmt_usd(max(left, 0))} left"
        return _pool_refusal(offering, pools, team) if offering.pool and team else None

    return fits


def _pool_refusal(offering: Offering, pools: dict[str, Any], team: str | None) -> str | None:
    """Why the team's quota in the offering's pool cannot take a whole machine now, or None."""
    pool = pools.get(offering.pool or "")
    own = next((t for t in (pool or {}).get("teams", []) if t["team"] == team), None)
    if own is None:
        return f"pool {offering.pool}: {team or 'this scope'} has no quota there"
    free = own["quota"][0] - own["used"][0]
    if free < offering.gpus:
        return f"pool {offering.pool}: {team}'s quota has {max(free, 0)} GPUs free"
    return None


def place_job(
    job: GpuJob,
    scope: str | None,
    ledger: Ledger,
    *,
    catalog: Catalog | None = None,
    routes: Sequence[Route] | None = None,
    blocks: dict[str, object] | None = None,
    allowed: Collection[str] | None = None,
    now: float | None = None,
) -> Placed:
    """`job` (asking for accelerators) placed on the cheapest offering that fits: one-line
    `BudgetInputError`s for an accelerator no offering has, a count no machine holds, a
    deadline none can meet (naming the closest). The job's `vcpu` and `memory_gib` are each
    node's least; the placed job takes whole machines. `allowed`: an agent's job, only on the
    routes its team's limits grant (`AgentLimits.launchers`)."""
    if routes is None:
        routes, blocks = saved_routes(ledger, org_of(scope) if scope else None)
    routes = allowed_routes(routes, allowed)
    catalog = catalog or Catalog.load(local=ledger_prices(ledger.url))  # the gate's prices
    machines = pool_shapes(catalog.rows(), routes)
    shapes = [
        s
        for s in matching(parse_accelerators(job.accelerators), machines)
        if s.vcpu >= (job.vcpu or 0) and s.memory_gib >= (job.memory_gib or 0)
    ]
    rates, _ = catalog_rates(catalog, shapes)
    need = Need(
        nodes=job.nodes,
        runtime_s=job.expected_runtime or job.max_runtime,
        max_runtime_s=job.reserve_runtime_s,
        max_wait_s=job.max_wait,
        deadline_s=job.deadline,
        resumable=job.checkpoint is not None,
    )
    placement = place(
        offerings(shapes, rates, routes),
        need,
        offering_histories(ledger),
        budget_fits(ledger, scope, now),
    )
    chosen = placement.chosen.offering
    placed = job.model_copy(
        update={
            "instance_type": chosen.key,
            "provisioning": chosen.provisioning,
            "pool": chosen.pool,
            "gpus": None,
            "vcpu": None,
            "memory_gib": None,
            # taken back, a job with a checkpoint is placed again (`tasks.gpu_job`), not
            # queued again for the same offering
            "requeue": job.requeue and job.checkpoint is None,
        }
    )
    choice = json.dumps(
        {
            "accelerators": job.accelerators,
            "considered": [c.as_dict() for c in placement.considered],
        }
    )
    block = (blocks or {}).get(route_ref(chosen.cloud, chosen.launcher))
    return Placed(placed.placed_as(choice), block, placement)

"""What the ledger's rows stand for: a job asking to be admitted (`NewJob`), a budget row as a
`BudgetRule`, an admitted job's row as a `Hold`, and what blocks a waiting job (its `wait_key`
and the tally of its waits), the row of a new job and what a decision writes into it. The
reads several stores share are in `queries`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from prefect_gpu_budget.admission.ledger.tables import ended_unrun
from prefect_gpu_budget.admission.rules.policy import (
    OVERRUN_WINDOW,
    BudgetRule,
    Decision,
    Hold,
)
from prefect_gpu_budget.admission.rules.quota import (
    Placed,
    Pool,
    Shape,
    job_share,
    pool_for,
    team_of,
)
from prefect_gpu_budget.units import BudgetInputError


@dataclass(frozen=True)
class NewJob:
    """What the gate records when a job asks to be admitted."""

    scope: str
    name: str
    instance_type: str
    provisioning: str
    nodes: int
    rate_micro_per_hour: int
    rate_cents: int
    priority: int
    max_runtime_s: float
    expected_runtime_s: float | None
    holder: str
    launcher: str = "local"
    on_limit: str | None = None
    max_wait_s: float | None = None
    flow_run_id: str | None = None
    pool: str | None = None
    """A pool the job names; None: the pool serving its instance type, if any."""
    node_gpus: int = 0
    node_vcpu: int = 0
    node_memory_gib: int = 0
    grant: str | None = None
    """An agent's grant id: the job queues only while the grant is live (see `revoke_agent`)."""
    partial: bool = False
    """The job asks for a part of each machine (`GpuJob.gpus`...): it needs a capacity pool."""
    priority_class: str | None = None
    """An org's own class the job names: `priority` is set from it when it is recorded."""
    choice: str | None = None
    """How the gate placed a job that asked for accelerators (`GpuJob.choice`)."""


def budget_rule(row: Any) -> BudgetRule:
    """The budget a row of `budgets` or `templates` stands for."""
    return BudgetRule(
        scope=row["scope"],
        hourly_cap_cents=row["hourly_cap_cents"],
        period_budget_micro=row["period_budget_micro"],
        period=row["period"],
        timezone=row["timezone"],
        on_limit=row["on_limit"],
        max_wait_s=row["max_wait_s"],
        reservation_mode=row["reservation_mode"],
        notify_block=row["notify_block"],
    )


def hold_of(row: Any, scope: str | None = None, now: float | None = None) -> Hold:
    """The Hold an admitted job's row stands for (`scope` where the row does not carry it).

    Given `now`, the hold is anchored where its spend can fall: at the job's start once it has
    started (a cloud job may wait hours for capacity after admission), else at `now` (nothing is
    spent before it starts) and marked unstarted (`policy.held_in` counts it whole in every
    period from now on). Without `now`, at its admission, as the decision then saw it.
    """
    start, began = row["admitted_at"], True
    if now is not None:
        started = row.get("started_at")
        began = started is not None and started <= now
        start = started if began else max(start, now)
    return Hold(
        scope or row["scope"],
        row.get("rate_cents", 0),
        row["reserved_micro"],
        start,
        start + row["reserve_seconds"],
        row["rate_micro_per_hour"],
        start + row["max_runtime_s"],
        began,
    )


SLOTS_HELD = "prefect_slots"
"""What blocks an admission given back because Prefect's limit was full (`Queue.unadmit`)."""
STARTING = "starting"
"""A job's wait from its admission to its start (`wait_spans`)."""


def wait_key(decision: Decision) -> str | None:
    """What blocks a waiting job, as its row's `wait_key` says: `limit scope` (None: nothing)."""
    if decision.verdict != "wait":
        return None
    return f"{decision.limit} {decision.scope}" if decision.scope else str(decision.limit)


def wait_tally(row: Any, decision: Decision, now: float) -> dict[str, Any]:
    """The columns that say what held a queued job and for how long: the limit and scope
    holding it now (`wait_key`) since when, and seconds per limit and scope that held it before
    (`waits`, JSON). Only a change of what blocks it writes anything."""
    old = row["wait_key"] if row is not None else None
    key = wait_key(decision)
    if key == old and row is not None:
        return {}
    out: dict[str, Any] = {"wait_key": key, "wait_since": now if key else None}
    if old is not None:
        waits = json.loads(row["waits"] or "{}")
        waits[old] = round(waits.get(old, 0.0) + now - (row["wait_since"] or now), 3)
        out["waits"] = json.dumps(waits)
    return out


LEARNED_OUTCOMES = ("completed", "failed", "timed_out")
"""Jobs that ran their course: cancelled, preempted or reconciled ones teach nothing."""
OVERRUN_SAMPLE = 20 * OVERRUN_WINDOW
"""How many of an org's latest settled jobs estimate mode learns from."""
OVERRUN_REFRESH_S = 30.0


def in_pool(pools: list[Pool], org: str, job: NewJob) -> NewJob:
    """The job with the pool of its org's `pools` it runs in (named, or serving its instance
    type) and its per-node shape (`job_share`: vCPU and memory left at 0 take the pool's
    proportional default; a job that names no GPUs, vCPU or memory takes a whole machine)."""
    found = pool_for(pools, job.instance_type, job.pool)
    if job.pool is not None and found is None:
        raise BudgetInputError("pool", f"no capacity pool {job.pool!r} in {org}")
    if found is None and job.partial:
        raise BudgetInputError(
            "gpus",
            f"a part of a machine runs only in a capacity pool, and no pool of {org} "
            f"serves {job.instance_type}",
        )
    if found is None:
        return replace(job, pool=None)
    vcpu, memory = job.node_vcpu or None, job.node_memory_gib or None
    res = job_share(found, job.node_gpus, vcpu, memory)
    return replace(job, pool=found.name, node_gpus=res[0], node_vcpu=res[1], node_memory_gib=res[2])


def new_job_row(job_id: str, org: str, job: NewJob, now: float) -> dict[str, Any]:
    """The row of a job asking to be admitted, queued until it is decided."""
    return {
        "id": job_id,
        "org": org,
        "state": "queued",
        "reason": "",
        "requested_at": now,
        "heartbeat_at": now,
        "reserved_micro": 0,
        "reserve_seconds": 0.0,
        "team": team_of(job.scope),
        **{
            k: v for k, v in job.__dict__.items() if k not in ("grant", "partial", "priority_class")
        },
    }


def decided_values(decision: Decision, now: float, reason: str, *, stamp: bool) -> dict[str, Any]:
    """What a queued job's decision writes into its row besides what held it (`wait_tally`):
    the admission and its reservation, its end unrun, or its new reason to wait (`reason`: the
    one it had); with its heartbeat when its holder decided it (`stamp`) or it left the queue."""
    values: dict[str, Any] = {}
    if stamp or decision.verdict != "wait":
        values["heartbeat_at"] = now
    if decision.verdict == "admit":
        values.update(
            state="admitted",
            admitted_at=now,
            reserved_micro=decision.reserved_micro,
            reserve_seconds=decision.reserve_seconds,
            reason=decision.reason,
            placement=",".join(map(str, decision.placement)),
        )
    elif decision.verdict in ("reject", "timeout"):
        ended = "rejected" if decision.verdict == "reject" else "timed_out"
        values.update(ended_unrun(ended, decision.reason, now))
    elif decision.reason != reason:
        values["reason"] = decision.reason
    return values


def shape_of(row: Mapping[str, Any]) -> Shape | None:
    """The shape a job's row asks of its pool (None: it runs in none)."""
    if row["pool"] is None:
        return None
    node = (row["node_gpus"], row["node_vcpu"], row["node_memory_gib"])
    return Shape(row["pool"], row["team"], node, row["nodes"])


def placed_of(row: Mapping[str, Any], stopping: bool = False) -> Placed:
    """An admitted job's footprint in its pool, as its row records it (`stopping`: it was
    asked to stop)."""
    where = tuple(int(i) for i in (row["placement"] or "").split(",") if i)
    shape = shape_of(row)
    assert shape is not None, row["id"]
    return Placed(row["id"], shape, where, row["priority"], row["admitted_at"], stopping)

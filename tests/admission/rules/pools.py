"""Pools, team quotas and jobs for the rules' tests: a pool of p5.48xlarge nodes, shapes of a
team's GPUs, a capacity over them, and an admission as the gate makes it (`preemption.fit`)."""

from __future__ import annotations

from prefect_gpu_budget.admission.rules import preemption
from prefect_gpu_budget.admission.rules.capacity import Capacity
from prefect_gpu_budget.admission.rules.quota import (
    Placed,
    Pool,
    Shape,
    TeamQuota,
    proportional,
)

P5 = (8, 192, 2048)  # ml.p5.48xlarge: 8 H100, 192 vCPU, 2 TiB


def pool(nodes: int = 4, node=P5, **kw) -> Pool:
    return Pool("acme", "lab-a", nodes, node, gpu_model="H100", **kw)


def job(team: str, gpus: int, nodes: int = 1) -> Shape:
    """`nodes` nodes of `gpus` GPUs each (with their share of a node's vCPU and memory)."""
    return Shape("lab-a", team, proportional(pool(), gpus), nodes)


def capacity(pool: Pool, quotas: list[TeamQuota], placed=()) -> Capacity:
    return Capacity({pool.name: pool}, {(q.pool, q.team): q for q in quotas}, list(placed))


def admit(cap: Capacity, job_id: str, shape: Shape, priority: int = 0, at: float = 0.0) -> bool:
    fit = preemption.fit(cap, shape, priority)
    if fit.ok:
        cap.add(Placed(job_id, shape, fit.placement, priority, at))
    return fit.ok

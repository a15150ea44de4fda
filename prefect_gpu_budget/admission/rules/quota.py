"""Hardware in the one decision: capacity pools, team quotas with lending and borrowing, fair
share and all-or-nothing (gang) fit, in the manner of SageMaker HyperPod task governance (Kueue
underneath) and Vertex AI's Dynamic Workload Scheduler. Pure: no I/O.

Resources are (accelerators, vCPU, memory GiB). A pool is `nodes` machines of one shape (an
on-prem inventory: each node of a job goes on its own machine) or a cloud quota (totals only).
A team's quota in a pool is its nominal quota, what it is guaranteed; it may borrow up to
`borrow_pct` percent more from what other teams leave idle and lend (`lend_pct` of their quota),
plus capacity no team holds. Idle capacity is shared by fair-share weight: the team with the
least borrowed per weight goes first. Who is preempted so that a waiting job fits, by its team's
`reclaim` and `within_team` settings, is `preemption.py`; how teams' queues are ordered and what
a waiting job blocks, `queueing.py`; what an org's pools hold while the decision walks its queue,
and why a job does not fit, `capacity.py`.

Every reason names the resource that binds (accelerators, vCPU, memory, nodes) with amounts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from prefect_gpu_budget.units import BudgetInputError

Res = tuple[int, int, int]
"""(accelerators, vCPU, memory GiB)."""
ZERO: Res = (0, 0, 0)


def add(a: Res, b: Res) -> Res:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def sub(a: Res, b: Res) -> Res:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


def fits_in(a: Res, b: Res) -> bool:
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2]


def times(a: Res, k: int) -> Res:
    return (a[0] * k, a[1] * k, a[2] * k)


def pos(a: Res) -> Res:
    return (max(0, a[0]), max(0, a[1]), max(0, a[2]))


def low(a: Res, b: Res) -> Res:
    return (min(a[0], b[0]), min(a[1], b[1]), min(a[2], b[2]))


def pct(a: Res, percent: int) -> Res:
    return (a[0] * percent // 100, a[1] * percent // 100, a[2] * percent // 100)


@dataclass(frozen=True)
class Pool:
    """What can run at once in one org: `nodes` x `node` (accelerators, vCPU, memory)."""

    org: str
    name: str
    nodes: int
    node: Res
    instance_types: tuple[str, ...] = ()
    """Jobs on these instance types run in this pool (unless a job names its pool)."""
    gpu_model: str = ""
    kind: str = "inventory"
    """`inventory`: each node of a job needs its own machine; `quota`: cloud totals only."""
    backfill: bool = False
    """Let a smaller job pass a blocked bigger one when it fits now: in a pool without team
    quotas (one queue) any blocked job; in a pool with them, a job within its team's quota that
    waits for machines (which borrowers otherwise wait behind). Off: no starvation."""

    @property
    def total(self) -> Res:
        return times(self.node, self.nodes)


def proportional(pool: Pool, gpus: int, vcpu: int | None = None, memory: int | None = None) -> Res:
    """HyperPod's default: k of a node's G accelerators bring k/G of its vCPU and memory."""
    g, v, m = pool.node
    return (
        gpus,
        vcpu if vcpu is not None else (gpus * v // g if g else 0),
        memory if memory is not None else (gpus * m // g if g else 0),
    )


def job_share(pool: Pool, gpus: int, vcpu: int | None, memory: int | None) -> Res:
    """What one node of a job takes of a machine: `proportional`, except that a job that names
    no accelerators, vCPU or memory (a CPU machine type priced without them) takes a whole
    machine: a job never consumes nothing."""
    if not gpus and vcpu is None and memory is None:
        return (0, pool.node[1], pool.node[2])
    return proportional(pool, gpus, vcpu, memory)


RECLAIM = ("any", "lower_priority", "never")
"""How a team's job within its quota takes back capacity the team lent (Kueue's
`reclaimWithinCohort`: Any, LowerPriority, Never)."""
WITHIN_TEAM = ("lower_priority", "never")
"""Whether a team's job preempts the team's own lower-priority work (HyperPod's
`PreemptTeamTasks`, Kueue's `withinClusterQueue`: LowerPriority, Never)."""
QUEUEING = ("best_effort_fifo", "strict_fifo")
"""A team's queue in a pool (Kueue's `queueingStrategy`: BestEffortFIFO, StrictFIFO)."""
TEAM_SETTINGS = {"reclaim": RECLAIM, "within_team": WITHIN_TEAM, "queueing": QUEUEING}


def team_setting(name: str, value: object) -> str:
    """A team's `reclaim`, `within_team` or `queueing` setting, spelt ours (`lower_priority`,
    `lower-priority`) or as Kueue and HyperPod spell it (`LowerPriority`, `StrictFIFO`); a
    one-line error naming the setting and its values otherwise."""
    allowed = TEAM_SETTINGS[name]
    key = re.sub(r"[^a-z]", "", str(value).lower())
    for choice in allowed:
        if choice.replace("_", "") == key:
            return choice
    shown = str(value)[:40]
    raise BudgetInputError(
        name, f"must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {shown!r}"
    )


@dataclass(frozen=True)
class TeamQuota:
    pool: str
    team: str
    """`org/team`."""
    quota: Res
    """Its nominal quota: what it is guaranteed."""
    borrow_pct: int = 50
    """May use up to quota x (1 + borrow_pct / 100) when others leave capacity idle: 50 by
    default, as HyperPod's `BorrowLimit` (its default sharing is `LendAndBorrow`)."""
    lend_pct: int = 100
    """The part of its idle quota others may borrow."""
    weight: int = 50
    """Fair share of idle capacity, 0-100; 0 = always last."""
    reclaim: str = "any"
    """Its job within quota preempts `any` job borrowing the team's capacity, `lower_priority`
    ones only, or `never` (see RECLAIM)."""
    within_team: str = "lower_priority"
    """Its job within quota preempts its own lower-priority work (`lower_priority`) or not
    (`never`); see WITHIN_TEAM."""
    queueing: str = "best_effort_fifo"
    """`best_effort_fifo`: a job of the team that cannot start lets the team's next ones try;
    `strict_fifo`: they wait behind it (see QUEUEING)."""

    @property
    def ceiling(self) -> Res:
        return add(self.quota, pct(self.quota, self.borrow_pct))


@dataclass(frozen=True)
class Shape:
    """What a job occupies: `nodes` x `per_node` in `pool`, counted against `team`."""

    pool: str
    team: str | None
    per_node: Res
    nodes: int

    @property
    def total(self) -> Res:
        return times(self.per_node, self.nodes)


@dataclass(frozen=True)
class Placed:
    """An admitted job's footprint."""

    job_id: str
    shape: Shape
    placement: tuple[int, ...]
    priority: int
    admitted_at: float
    stopping: bool = False
    """Already asked to stop (preempted): it goes first when victims are chosen again."""


@dataclass(frozen=True)
class Fit:
    ok: bool
    reason: str = ""
    placement: tuple[int, ...] = ()
    victims: tuple[str, ...] = ()
    """Jobs to preempt so that this one fits (its team's `reclaim` and `within_team`)."""
    blocks: tuple[str, ...] = ()
    """Queue keys a job that cannot start blocks: later jobs needing them wait behind it."""
    unasked: str = ""
    """`reason` as it reads when nobody is asked to stop (a budget blocks the job too, or it
    ends): without the victims it names."""


def team_of(scope: str) -> str | None:
    parts = scope.split("/")
    return "/".join(parts[:2]) if len(parts) >= 2 else None


def pool_for(pools: Sequence[Pool], instance_type: str, named: str | None = None) -> Pool | None:
    """The pool a job runs in: the one it names, else the one serving its instance type."""
    for pool in pools:
        if named is not None:
            if pool.name == named:
                return pool
        elif instance_type in pool.instance_types:
            return pool
    return None

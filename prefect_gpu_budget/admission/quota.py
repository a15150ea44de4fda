"""Hardware in the one decision: capacity pools, team quotas with lending and borrowing, fair
share, all-or-nothing (gang) fit and preemption victims, in the manner of SageMaker HyperPod task
governance (Kueue underneath) and Vertex AI's Dynamic Workload Scheduler. Pure: no I/O.

Resources are (accelerators, vCPU, memory GiB). A pool is `nodes` machines of one shape (an
on-prem inventory: each node of a job goes on its own machine) or a cloud quota (totals only).
A team's quota in a pool is what it is guaranteed; it may borrow up to `borrow_pct` percent more
from what other teams leave idle and lend (`lend_pct` of their quota), plus capacity no team
holds. Idle capacity is shared by fair-share weight: the team with the least borrowed per weight
goes first. A job within its own quota may take back lent capacity by preempting lower-priority
borrowed work: the lowest priority first, then the most recently admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
    """Let a smaller job pass a blocked bigger one when it fits now (off: no starvation)."""

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


@dataclass(frozen=True)
class TeamQuota:
    pool: str
    team: str
    """`org/team`."""
    quota: Res
    borrow_pct: int = 0
    """May use up to quota x (1 + borrow_pct / 100) when others leave capacity idle."""
    lend_pct: int = 100
    """The part of its idle quota others may borrow."""
    weight: int = 50
    """Fair share of idle capacity, 0-100; 0 = always last."""

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


@dataclass(frozen=True)
class Fit:
    ok: bool
    reason: str = ""
    placement: tuple[int, ...] = ()
    victims: tuple[str, ...] = ()
    """Borrowed jobs to preempt so that this job (within its quota) fits."""
    holds: tuple[str, ...] = ()
    """Queue keys a blocked job holds: later jobs needing them wait behind it."""


def team_of(scope: str) -> str | None:
    parts = scope.split("/")
    return "/".join(parts[:2]) if len(parts) >= 2 else None


def _gpus(res: Res, model: str) -> str:
    return f"{res[0]} {model}".strip() if res[0] else f"{res[1]} vCPU"


def _binding(need: Res, room: Res) -> int:
    """Which resource binds: the first (GPUs, vCPU, memory) that `need` exceeds `room` in."""
    return next((i for i in range(3) if need[i] > room[i]), 0)


def _amount(res: Res, which: int, model: str) -> str:
    """One resource of `res`, with its unit: `2 H100`, `48 vCPU`, `512 GiB of memory`."""
    if which == 0:
        return f"{res[0]} {model or 'GPUs'}"
    return f"{res[1]} vCPU" if which == 1 else f"{res[2]} GiB of memory"


@dataclass
class Capacity:
    """Usage of an org's pools while the decision walks its queue."""

    pools: Mapping[str, Pool]
    quotas: Mapping[tuple[str, str], TeamQuota]
    placed: list[Placed] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.placed = list(self.placed)

    # -- usage -------------------------------------------------------------------------

    def _node_used(self, pool: Pool, without: frozenset[str] = frozenset()) -> list[Res]:
        used = [ZERO] * pool.nodes
        for job in self.placed:
            if job.shape.pool == pool.name and job.job_id not in without:
                for index in job.placement:
                    if index < pool.nodes:
                        used[index] = add(used[index], job.shape.per_node)
        return used

    def pool_used(self, pool: str, without: frozenset[str] = frozenset()) -> Res:
        total = ZERO
        for job in self.placed:
            if job.shape.pool == pool and job.job_id not in without:
                total = add(total, job.shape.total)
        return total

    def team_used(self, pool: str, team: str, without: frozenset[str] = frozenset()) -> Res:
        total = ZERO
        for job in self.placed:
            if job.shape.pool == pool and job.shape.team == team and job.job_id not in without:
                total = add(total, job.shape.total)
        return total

    def _teams(self, pool: str) -> list[TeamQuota]:
        return [q for (p, _), q in self.quotas.items() if p == pool]

    def share(self, pool: str, team: str | None) -> float:
        """Fair share: dominant borrowed resource (as a part of the pool) per weight."""
        quota = self.quotas.get((pool, team or ""))
        if quota is None or pool not in self.pools:
            return 0.0
        borrowed = pos(sub(self.team_used(pool, quota.team), quota.quota))
        total = self.pools[pool].total
        dominant = max((b / t for b, t in zip(borrowed, total, strict=True) if t), default=0.0)
        if quota.weight <= 0:
            return float("inf") if dominant or borrowed != ZERO else 1e9
        return dominant / quota.weight

    def status(self, pool: str) -> list[dict]:
        """Per team: quota, used, borrowed, lendable (idle and open to others) and lent (the
        part of the borrowing its idle quota carries: what no team holds is lent first, the rest
        in proportion to what each team can lend)."""
        teams = self._teams(pool)
        used = {q.team: self.team_used(pool, q.team) for q in teams}
        borrowed = {q.team: pos(sub(used[q.team], q.quota)) for q in teams}
        lendable = {
            q.team: low(pos(sub(q.quota, used[q.team])), pct(q.quota, q.lend_pct)) for q in teams
        }
        unassigned = pos(sub(self.pools[pool].total, _sum(q.quota for q in teams)))
        rest = pos(sub(_sum(borrowed.values()), unassigned))
        offered = _sum(lendable.values())
        out = []
        for q in teams:
            lent = tuple(
                r * ln // o if o else 0
                for r, ln, o in zip(rest, lendable[q.team], offered, strict=True)
            )
            out.append(
                {
                    "team": q.team,
                    "quota": q.quota,
                    "used": used[q.team],
                    "borrowed": borrowed[q.team],
                    "lent": lent,
                    "lendable": lendable[q.team],
                    "borrow_pct": q.borrow_pct,
                    "lend_pct": q.lend_pct,
                    "weight": q.weight,
                }
            )
        return out

    # -- the checks ----------------------------------------------------------------------

    def never_fits(self, shape: Shape) -> str | None:
        pool = self.pools[shape.pool]
        if pool.kind == "inventory":
            if shape.nodes > pool.nodes:
                return f"{shape.nodes} nodes asked, pool {pool.name} has {pool.nodes}"
            if not fits_in(shape.per_node, pool.node):
                i = _binding(shape.per_node, pool.node)
                return (
                    f"one node of this job needs {_amount(shape.per_node, i, pool.gpu_model)}, "
                    f"more than a machine of pool {pool.name} has "
                    f"({_amount(pool.node, i, pool.gpu_model)})"
                )
        elif not fits_in(shape.total, pool.total):
            return f"needs more than all of pool {pool.name}"
        teams = self._teams(pool.name)
        if teams:
            quota = self.quotas.get((pool.name, shape.team or ""))
            if quota is None:
                return f"team {shape.team} has no quota in pool {pool.name}"
            if not fits_in(shape.total, quota.ceiling):
                i, model = _binding(shape.total, quota.ceiling), pool.gpu_model
                borrow = f" plus its borrow limit {quota.borrow_pct}%" if quota.borrow_pct else ""
                return (
                    f"needs {_amount(shape.total, i, model)}, more than team {quota.team}'s "
                    f"quota of {_amount(quota.quota, i, model)}{borrow} in pool {pool.name}"
                )
        return None

    def _place(self, pool: Pool, shape: Shape, without: frozenset[str]) -> tuple[int, ...] | None:
        """All of the job's nodes at once, or None: nothing is ever placed in part."""
        if pool.kind == "quota":
            used = self.pool_used(pool.name, without)
            return () if fits_in(add(used, shape.total), pool.total) else None
        free = [sub(pool.node, used) for used in self._node_used(pool, without)]
        candidates = [i for i, f in enumerate(free) if fits_in(shape.per_node, f)]
        if len(candidates) < shape.nodes:
            return None
        candidates.sort(key=lambda i: (free[i][0], free[i][1], free[i][2], i))  # best fit
        return tuple(sorted(candidates[: shape.nodes]))

    def _borrow_ok(self, pool: Pool, shape: Shape, without: frozenset[str]) -> bool:
        """Everything used above quotas, after this job, fits in what teams lend plus what no
        team holds."""
        teams = self._teams(pool.name)
        if not teams:
            return True
        unassigned = pos(sub(pool.total, _sum(q.quota for q in teams)))
        borrowed, lendable = ZERO, unassigned
        for q in teams:
            used = self.team_used(pool.name, q.team, without)
            if q.team == shape.team:
                used = add(used, shape.total)
            borrowed = add(borrowed, pos(sub(used, q.quota)))
            lendable = add(lendable, low(pos(sub(q.quota, used)), pct(q.quota, q.lend_pct)))
        return fits_in(borrowed, lendable)

    def within_quota(self, shape: Shape) -> bool:
        """Whether the job fits in its team's own quota (needs to borrow nothing)."""
        quota = self.quotas.get((shape.pool, shape.team or ""))
        if quota is None:
            return True
        used = self.team_used(shape.pool, quota.team)
        return fits_in(add(used, shape.total), quota.quota)

    def check(self, shape: Shape, priority: int) -> Fit:
        """Can the job start now? If not, why, and which borrowed jobs to preempt if any."""
        pool = self.pools[shape.pool]
        quota = self.quotas.get((shape.pool, shape.team or ""))
        if quota is not None:
            used = self.team_used(pool.name, quota.team)
            if not fits_in(add(used, shape.total), quota.ceiling):
                i, model = _binding(add(used, shape.total), quota.ceiling), pool.gpu_model
                return Fit(
                    False,
                    f"team {quota.team} uses {_amount(used, i, model)} of its quota "
                    f"{_amount(quota.quota, i, model)} (+{quota.borrow_pct}% borrow limit) "
                    f"in pool {pool.name}; this job needs {_amount(shape.total, i, model)}",
                    holds=(f"team:{pool.name}:{quota.team}",),
                )
        placement = self._place(pool, shape, frozenset())
        borrow_ok = self._borrow_ok(pool, shape, frozenset())
        if placement is not None and borrow_ok:
            return Fit(True, placement=placement)
        within = self.within_quota(shape)
        if not borrow_ok and not within:
            assert quota is not None
            return Fit(
                False,
                f"team {quota.team} is at its quota {_gpus(quota.quota, pool.gpu_model)} in "
                f"pool {pool.name} and other teams lend no idle capacity now",
                holds=(f"team:{pool.name}:{quota.team}",),
            )
        reason = self._capacity_reason(pool, shape)
        if pool.backfill:
            holds: tuple[str, ...] = ()
        elif within or quota is None:
            holds = (f"pool:{pool.name}",)
        else:  # a borrower holds other borrowers and its own team, never a team's own quota
            holds = (f"borrow:{pool.name}", f"team:{pool.name}:{quota.team}")
        victims = self._victims(pool, shape, priority) if within and quota is not None else ()
        if victims:
            names = ", ".join(v[:8] for v in victims)
            reason += f"; reclaiming capacity lent to other teams: preempting {names}"
        return Fit(False, reason, victims=victims, holds=holds)

    def _capacity_reason(self, pool: Pool, shape: Shape) -> str:
        if pool.kind == "quota":
            free = pos(sub(pool.total, self.pool_used(pool.name)))
            return (
                f"waiting for {_gpus(shape.total, pool.gpu_model)} in pool {pool.name}: "
                f"{_gpus(free, pool.gpu_model)} free"
            )
        free_nodes = sum(
            1 for used in self._node_used(pool) if fits_in(shape.per_node, sub(pool.node, used))
        )
        return (
            f"waiting for {shape.nodes} x {_gpus(shape.per_node, pool.gpu_model)} in pool "
            f"{pool.name}: {free_nodes} node{'' if free_nodes == 1 else 's'} free"
        )

    def _victims(self, pool: Pool, shape: Shape, priority: int) -> tuple[str, ...]:
        """Borrowed, lower-priority jobs whose end lets this job fit: lowest priority first,
        then most recently admitted; then the set is minimised."""
        over = {
            q.team
            for q in self._teams(pool.name)
            if q.team != shape.team and not fits_in(self.team_used(pool.name, q.team), q.quota)
        }
        candidates = sorted(
            (
                j
                for j in self.placed
                if j.shape.pool == pool.name and j.shape.team in over and j.priority < priority
            ),
            key=lambda j: (j.priority, -j.admitted_at),
        )
        chosen: list[Placed] = []
        for job in candidates:
            gone = frozenset(v.job_id for v in chosen)
            team = job.shape.team or ""
            # only work above its team's quota is borrowed: never cut a team below its quota
            if fits_in(self.team_used(pool.name, team, gone), self.quotas[(pool.name, team)].quota):
                continue
            chosen.append(job)
            gone = frozenset(v.job_id for v in chosen)
            if self._place(pool, shape, gone) is not None and self._borrow_ok(pool, shape, gone):
                break
        else:
            return ()
        for job in list(reversed(chosen)):  # minimise: keep whoever is not needed
            rest = frozenset(v.job_id for v in chosen if v is not job)
            if self._place(pool, shape, rest) is not None and self._borrow_ok(pool, shape, rest):
                chosen.remove(job)
        return tuple(j.job_id for j in chosen)

    def add(self, job: Placed) -> None:
        self.placed.append(job)


def _sum(items: Iterable[Res]) -> Res:
    total = ZERO
    for item in items:
        total = add(total, item)
    return total


def pool_for(pools: Sequence[Pool], instance_type: str, named: str | None = None) -> Pool | None:
    """The pool a job runs in: the one it names, else the one serving its instance type."""
    for pool in pools:
        if named is not None:
            if pool.name == named:
                return pool
        elif instance_type in pool.instance_types:
            return pool
    return None

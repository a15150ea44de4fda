"""What an org's pools hold while the decision walks its queue (`Capacity`): each pool's and
each team's use, what a team may borrow and lend, where a job's nodes go, and why a job does not
fit, every reason naming the resource that binds (accelerators, vCPU, memory, nodes) with
amounts. Pure: no I/O. The pools, quotas and shapes themselves are `quota.py`'s."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prefect_gpu_budget.admission.rules.quota import (
    ZERO,
    Placed,
    Pool,
    Res,
    Shape,
    TeamQuota,
    add,
    fits_in,
    low,
    pct,
    pos,
    sub,
)


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


_NAMES = ("accelerators", "vCPU", "memory")


@dataclass
class Capacity:
    """Usage of an org's pools while the decision walks its queue."""

    pools: Mapping[str, Pool]
    quotas: Mapping[tuple[str, str], TeamQuota]
    placed: list[Placed] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.placed = list(self.placed)
        self._used: dict[tuple[str, str | None], Res] = {}
        self._seen: tuple[int, int] = (0, -1)

    # -- usage -------------------------------------------------------------------------

    def node_used(self, pool: Pool, without: frozenset[str] = frozenset()) -> list[Res]:
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

    def team_used(self, pool: str, team: str | None, without: frozenset[str] = frozenset()) -> Res:
        if not without:  # asked for every pick of the walk: kept until `placed` changes
            seen = (id(self.placed), len(self.placed))
            if seen != self._seen:
                self._used, self._seen = {}, seen
            if (pool, team) not in self._used:
                self._used[(pool, team)] = self._team_total(pool, team, without)
            return self._used[(pool, team)]
        return self._team_total(pool, team, without)

    def _team_total(self, pool: str, team: str | None, without: frozenset[str]) -> Res:
        total = ZERO
        for job in self.placed:
            if job.shape.pool == pool and job.shape.team == team and job.job_id not in without:
                total = add(total, job.shape.total)
        return total

    def teams(self, pool: str) -> list[TeamQuota]:
        return [q for (p, _), q in self.quotas.items() if p == pool]

    def quota_of(self, pool: str, team: str | None) -> Res:
        """A team's nominal quota in a pool (nothing for a team without one)."""
        quota = self.quotas.get((pool, team or ""))
        return quota.quota if quota is not None else ZERO

    def borrowing(self, pool: str, team: str | None, without: frozenset[str] = frozenset()) -> bool:
        """Whether a team uses more than its nominal quota in a pool (with `without` gone)."""
        return not fits_in(self.team_used(pool, team, without), self.quota_of(pool, team))

    def share(
        self,
        pool: str,
        team: str | None,
        extra: Res = ZERO,
        without: frozenset[str] = frozenset(),
    ) -> float:
        """Fair share, as Kueue's dominant resource share: per resource, what the team uses
        above its nominal quota (with `extra` more, and `without` gone) as a part of what can be
        lent in the pool (what no team holds plus each team's `lend_pct` of its quota); the
        largest of them, per fair-share weight. 0 for a team within its quota, whatever its
        weight; a team of weight 0 that borrows: infinite (last to borrow, first to give
        back)."""
        quota = self.quotas.get((pool, team or ""))
        if quota is None or pool not in self.pools:
            return 0.0
        used = add(self.team_used(pool, quota.team, without), extra)
        borrowed = pos(sub(used, quota.quota))
        if borrowed == ZERO:
            return 0.0
        if quota.weight <= 0:
            return math.inf
        lendable = self.lendable(pool)
        dominant = max((b / t for b, t in zip(borrowed, lendable, strict=True) if t), default=0.0)
        return dominant / quota.weight

    def lendable(self, pool: str) -> Res:
        """What can be lent in a pool, used or not: what no team holds, plus each team's
        `lend_pct` of its quota (Kueue's lendable resources of a cohort); the pool's total
        where that is nothing."""
        teams = self.teams(pool)
        total = self.pools[pool].total
        free = pos(sub(total, _sum(q.quota for q in teams)))
        found = add(free, _sum(pct(q.quota, q.lend_pct) for q in teams))
        return found if found != ZERO else total

    def status(self, pool: str) -> list[dict]:
        """Per team: quota, used, borrowed, lendable (idle and open to others) and lent (the
        part of the borrowing its idle quota carries: what no team holds is lent first, the rest
        in proportion to what each team can lend), and its preemption and queueing settings."""
        teams = self.teams(pool)
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
                    "reclaim": q.reclaim,
                    "within_team": q.within_team,
                    "queueing": q.queueing,
                }
            )
        return out

    # -- the checks ----------------------------------------------------------------------

    def never_fits(self, shape: Shape) -> str | None:
        pool = self.pools[shape.pool]
        model = pool.gpu_model
        if pool.kind == "inventory":
            if shape.nodes > pool.nodes:
                return f"{shape.nodes} nodes asked, pool {pool.name} has {pool.nodes}"
            if not fits_in(shape.per_node, pool.node):
                i = _binding(shape.per_node, pool.node)
                return (
                    f"one node of this job needs {_amount(shape.per_node, i, model)}, "
                    f"more than a machine of pool {pool.name} has "
                    f"({_amount(pool.node, i, model)})"
                )
        elif not fits_in(shape.total, pool.total):
            i = _binding(shape.total, pool.total)
            return (
                f"needs {_amount(shape.total, i, model)}, more than all of pool {pool.name} "
                f"({_amount(pool.total, i, model)})"
            )
        if self.teams(pool.name):
            quota = self.quotas.get((pool.name, shape.team or ""))
            if quota is None:
                return f"team {shape.team} has no quota in pool {pool.name}"
            if not fits_in(shape.total, quota.ceiling):
                i = _binding(shape.total, quota.ceiling)
                borrow = f" plus its borrow limit {quota.borrow_pct}%" if quota.borrow_pct else ""
                return (
                    f"needs {_amount(shape.total, i, model)}, more than team {quota.team}'s "
                    f"quota of {_amount(quota.quota, i, model)}{borrow} in pool {pool.name}"
                )
            teams = self.teams(pool.name)
            lent = add(  # the most others may ever lend: what no team holds, and their lend_pct
                pos(sub(pool.total, _sum(q.quota for q in teams))),
                _sum(pct(q.quota, q.lend_pct) for q in teams if q.team != quota.team),
            )
            if not fits_in(shape.total, add(quota.quota, lent)):
                i = _binding(shape.total, add(quota.quota, lent))
                return (
                    f"needs {_amount(shape.total, i, model)}, more than team {quota.team}'s "
                    f"quota of {_amount(quota.quota, i, model)} plus the most other teams may "
                    f"lend ({_amount(lent, i, model)}) in pool {pool.name}"
                )
        return None

    def place(self, pool: Pool, shape: Shape, without: frozenset[str]) -> tuple[int, ...] | None:
        """All of the job's nodes at once, or None: nothing is ever placed in part."""
        if pool.kind == "quota":
            used = self.pool_used(pool.name, without)
            return () if fits_in(add(used, shape.total), pool.total) else None
        free = [sub(pool.node, used) for used in self.node_used(pool, without)]
        candidates = [i for i, f in enumerate(free) if fits_in(shape.per_node, f)]
        if len(candidates) < shape.nodes:
            return None
        candidates.sort(key=lambda i: (free[i][0], free[i][1], free[i][2], i))  # best fit
        return tuple(sorted(candidates[: shape.nodes]))

    def _lending(self, pool: Pool, shape: Shape, without: frozenset[str]) -> tuple[Res, Res]:
        """Everything used above nominal quotas once this job runs (with `without` gone), and
        what can carry it: what teams lend of their idle quota plus what no team holds."""
        teams = self.teams(pool.name)
        borrowed = ZERO
        lendable = pos(sub(pool.total, _sum(q.quota for q in teams)))
        for q in teams:
            used = self.team_used(pool.name, q.team, without)
            if q.team == shape.team:
                used = add(used, shape.total)
            borrowed = add(borrowed, pos(sub(used, q.quota)))
            lendable = add(lendable, low(pos(sub(q.quota, used)), pct(q.quota, q.lend_pct)))
        return borrowed, lendable

    def borrow_ok(self, pool: Pool, shape: Shape, without: frozenset[str]) -> bool:
        """Everything used above quotas, after this job, fits in what teams lend plus what no
        team holds."""
        if not self.teams(pool.name):
            return True
        borrowed, lendable = self._lending(pool, shape, without)
        return fits_in(borrowed, lendable)

    def within_quota(self, shape: Shape, without: frozenset[str] = frozenset()) -> bool:
        """Whether the job fits in its team's own nominal quota (needs to borrow nothing)."""
        quota = self.quotas.get((shape.pool, shape.team or ""))
        if quota is None:
            return True
        used = self.team_used(shape.pool, quota.team, without)
        return fits_in(add(used, shape.total), quota.quota)

    def blocked(self, shape: Shape, without: frozenset[str] = frozenset()) -> str | None:
        """Why the job cannot start now (with `without` gone), naming the resource that binds
        and the amounts: its team's quota and borrow limit, what others lend, the machines.
        None: it can start."""
        pool = self.pools[shape.pool]
        quota = self.quotas.get((shape.pool, shape.team or ""))
        model = pool.gpu_model
        if quota is not None:
            used = self.team_used(pool.name, quota.team, without)
            if not fits_in(add(used, shape.total), quota.ceiling):
                i = _binding(add(used, shape.total), quota.ceiling)
                return (
                    f"team {quota.team} uses {_amount(used, i, model)} of its quota "
                    f"{_amount(quota.quota, i, model)} (+{quota.borrow_pct}% borrow limit) "
                    f"in pool {pool.name}; this job needs {_amount(shape.total, i, model)}"
                )
        placed = self.place(pool, shape, without) is not None
        lent_ok = self.borrow_ok(pool, shape, without)
        if quota is not None and not lent_ok and not self.within_quota(shape, without):
            return self._borrow_reason(pool, quota, shape, without)
        if not placed:
            return self.capacity_reason(pool, shape, without)
        if quota is not None and not lent_ok:
            return self._borrow_reason(pool, quota, shape, without)
        return None

    def _borrow_reason(
        self, pool: Pool, quota: TeamQuota, shape: Shape, without: frozenset[str]
    ) -> str:
        """Why borrowing stops the job: what it would borrow against what is left to lend, or
        (a job within its quota) how much of the team's idle quota others have borrowed."""
        model = pool.gpu_model
        borrowed, lendable = self._lending(pool, shape, without)
        used = self.team_used(pool.name, quota.team, without)
        mine = pos(sub(add(used, shape.total), quota.quota))
        if mine == ZERO:
            i = _binding(borrowed, lendable)
            return (
                f"team {quota.team}'s idle quota in pool {pool.name} is lent: other teams "
                f"borrow {_amount(borrowed, i, model)}, and {_amount(lendable, i, model)} "
                "can be lent once this job runs"
            )
        extra = sub(mine, pos(sub(used, quota.quota)))
        left = pos(sub(lendable, sub(borrowed, extra)))
        i = _binding(extra, left)
        return (
            f"team {quota.team} uses {_amount(used, i, model)} of its quota "
            f"{_amount(quota.quota, i, model)} in pool {pool.name} and this job would borrow "
            f"{_amount(extra, i, model)}; other teams lend {_amount(left, i, model)} idle now"
        )

    def capacity_reason(
        self, pool: Pool, shape: Shape, without: frozenset[str] = frozenset()
    ) -> str:
        """What the machines lack: the nodes (or totals) free for this job and, where it is not
        the accelerators, the resource that binds, with how much of it is free."""
        model = pool.gpu_model
        headline = 0 if shape.per_node[0] else 1  # what `_gpus` names
        if pool.kind == "quota":
            free = pos(sub(pool.total, self.pool_used(pool.name, without)))
            reason = (
                f"waiting for {_gpus(shape.total, model)} in pool {pool.name}: "
                f"{_gpus(free, model)} free"
            )
            i = _binding(shape.total, free)
            if i != headline:
                reason += (
                    f"; {_NAMES[i]} binds: this job needs {_amount(shape.total, i, model)}, "
                    f"{_amount(free, i, model)} free"
                )
            return reason
        free = [sub(pool.node, used) for used in self.node_used(pool, without)]
        count = sum(1 for f in free if fits_in(shape.per_node, f))
        reason = (
            f"waiting for {shape.nodes} x {_gpus(shape.per_node, model)} in pool "
            f"{pool.name}: {count} node{'' if count == 1 else 's'} free"
        )
        enough = [sum(1 for f in free if f[i] >= shape.per_node[i]) for i in range(3)]
        i = min(range(3), key=lambda r: (enough[r], r != headline, r))
        if enough[i] >= shape.nodes and count < shape.nodes:  # no machine has it all at once
            need = ", ".join(_amount(shape.per_node, r, model) for r in range(3))
            reason += f"; no machine has {need} free at once"
        elif i != headline and enough[i] < shape.nodes:
            most = max(f[i] for f in free)
            best = (most, most, most)
            reason += (
                f"; {_NAMES[i]} binds: a node of this job needs "
                f"{_amount(shape.per_node, i, model)}, at most {_amount(best, i, model)} is "
                f"free on a machine ({_gpus(_sum(pos(f) for f in free), model)} free in all)"
            )
        return reason

    def add(self, job: Placed) -> None:
        self.placed.append(job)


def _sum(items: Iterable[Res]) -> Res:
    total = ZERO
    for item in items:
        total = add(total, item)
    return total

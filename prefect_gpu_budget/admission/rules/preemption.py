"""Who is asked to stop so that a waiting job in a capacity pool can start: the team's
preemption settings, as Kueue runs them under SageMaker HyperPod task governance. Pure: no I/O.

A job of team T that cannot start may preempt:
- work of other teams that borrows (uses more than its team's nominal quota), to take back what
  T lent, by T's `reclaim` setting: `any` borrower whatever its priority (HyperPod: lent compute
  is returned when the lender needs it; Kueue's `reclaimWithinCohort: Any`), only
  `lower_priority` ones, or `never`;
- T's own lower-priority work, by T's `within_team` setting (`lower_priority`, HyperPod's
  default for `PreemptTeamTasks`, or `never`).

As in Kueue, the job must fit within T's nominal quota once its victims are gone; only when no
other team's work could be preempted may it preempt its own team's work and borrow at once (a
preempted borrower requeued must not preempt its preemptor back).

Victims, as Kueue orders candidates with fair sharing: jobs already stopping first, then other
teams' borrowed work, from the team with the highest fair share first (what it borrows per
weight, weight 0 first of all: `Capacity.share`, read again after each pick), then the lowest
priority, then the most recently admitted. A job of another team is a victim only while its team
still uses more than its nominal quota (Kueue's rule: the last one taken may leave the team
below it, never more). Kueue's quota is placement-free; here the job must also get machines, so
the set must free a placement (`nodes` machines each with room for one node of the job): the
candidates of each machine are weighed in that order, the machines that cost the least are
taken, and that is compared with Kueue's plain walk (candidates in order until the job fits).
Either set is then minimised (a victim whose removal is not needed is spared), and the one whose
worst victim ranks best is asked. When no set frees a placement within these rules, nobody is
asked: the job waits and says what it waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefect_gpu_budget.admission.rules import queueing
from prefect_gpu_budget.admission.rules.capacity import Capacity
from prefect_gpu_budget.admission.rules.quota import (
    Fit,
    Placed,
    Pool,
    Shape,
    TeamQuota,
    add,
    fits_in,
    sub,
)

Rank = tuple[bool, bool, float, int, float]


def fit(cap: Capacity, shape: Shape, priority: int) -> Fit:
    """Can a job of `shape` at `priority` start now? If not, why (`Capacity.blocked`), what it
    blocks while it waits (`queueing.blocks`), and which jobs to preempt by its team's settings
    (`victims`), if any. Here, not on `Capacity`: the quota's state knows nothing of the
    rules that read it."""
    pool = cap.pools[shape.pool]
    reason = cap.blocked(shape)
    if reason is None:
        return Fit(True, placement=cap.place(pool, shape, frozenset()) or ())
    quota = cap.quotas.get((shape.pool, shape.team or ""))
    blocks = queueing.blocks(pool, quota, cap.within_quota(shape))
    if quota is None:
        return Fit(False, reason, blocks=blocks, unasked=reason)
    chosen, note = victims(cap, pool, quota, shape, priority)
    asked = ""
    if chosen:
        asked = "; preempting " + ", ".join(describe(job, quota.team) for job in chosen)
    return Fit(
        False,
        reason + asked + note,
        victims=tuple(j.job_id for j in chosen),
        blocks=blocks,
        unasked=reason + note,
    )


def victims(
    cap: Capacity, pool: Pool, quota: TeamQuota, shape: Shape, priority: int
) -> tuple[tuple[Placed, ...], str]:
    """The jobs to preempt so that a job of `quota.team` at `priority` fits, and, when there are
    none, a note saying why where it is not plain: the team's setting that keeps them running,
    or the quota of a borrower that freeing a machine would cut into."""
    own, others, spared, kept = [], [], [], []
    borrowing: dict[str | None, bool] = {}
    for job in cap.placed:
        if job.shape.pool != pool.name:
            continue
        if job.shape.team == quota.team:
            if job.priority < priority:
                (own if quota.within_team == "lower_priority" else kept).append(job)
            continue
        team = job.shape.team
        if team not in borrowing:
            borrowing[team] = cap.borrowing(pool.name, team)
        if borrowing[team]:
            if _may_reclaim(quota.reclaim, job.priority, priority):
                others.append(job)
            else:
                spared.append(job)
    chosen: tuple[Placed, ...] = ()
    if others:  # within its nominal quota once they are gone
        chosen = _choose(cap, pool, quota, shape, others + own, nominal=True)
    if not chosen and own:  # only its own team's work: it may borrow as well
        chosen = _choose(cap, pool, quota, shape, own, nominal=False)
    if chosen:
        return chosen, ""
    if kept:
        return (), (
            f"; team {quota.team} does not preempt its own lower-priority work (within_team: never)"
        )
    if not cap.within_quota(shape):
        return (), ""
    if spared and quota.reclaim == "never":
        return (), f"; team {quota.team} takes back no capacity it lent (reclaim: never)"
    if spared:
        return (), (
            f"; team {quota.team} takes back lent capacity only from lower-priority work "
            f"(reclaim: lower_priority), and {len(spared)} borrowing job"
            f"{'' if len(spared) == 1 else 's'} here run at priority {priority} or higher"
        )
    if others:  # borrowers there are, and the settings allow them, but no set will do
        teams = ", ".join(sorted({str(job.shape.team) for job in others}))
        room = "a machine" if pool.kind == "inventory" else "room"
        return (), (
            f"; taking back lent capacity would free {room} for it only by cutting team "
            f"{teams} below its quota"
        )
    return (), ""


def describe(job: Placed, team: str) -> str:
    """A victim as a reason names it: its id, and whether it borrows or yields to priority."""
    why = "lower priority" if job.shape.team == team else "borrowing"
    return f"{job.job_id[:8]} ({job.shape.team}, {why}, priority {job.priority})"


def _may_reclaim(policy: str, victim: int, priority: int) -> bool:
    return policy == "any" or (policy == "lower_priority" and victim < priority)


def _ranker(
    cap: Capacity, pool: Pool, team: str, gone: frozenset[str] = frozenset()
) -> dict[str | None, float]:
    """Each team's fair share in the pool with `gone` gone (`Capacity.share`)."""
    teams = {q.team for q in cap.teams(pool.name)}
    return {t: cap.share(pool.name, t, without=gone) for t in teams if t != team}


def _rank(job: Placed, team: str, shares: dict[str | None, float]) -> Rank:
    """Kueue's order of candidates with fair sharing: already evicted, in another (borrowing)
    queue, from the queue with the highest share, lowest priority, most recently admitted."""
    mine = job.shape.team == team
    share = 0.0 if mine else shares.get(job.shape.team, 0.0)
    return (not job.stopping, mine, -share, job.priority, -job.admitted_at)


def _cost(chosen: Iterable[Placed], team: str, shares: dict[str | None, float]) -> list[Rank]:
    """How much a set of victims costs: its ranks, worst first (compared as lists, a set
    whose worst victim ranks better wins; then the next; then the smaller)."""
    return sorted((_rank(job, team, shares) for job in chosen), reverse=True)


def _fits(
    cap: Capacity,
    pool: Pool,
    quota: TeamQuota,
    shape: Shape,
    gone: frozenset[str],
    nominal: bool,
) -> bool:
    used = cap.team_used(pool.name, quota.team, gone)
    limit = quota.quota if nominal else quota.ceiling
    return (
        fits_in(add(used, shape.total), limit)
        and cap.place(pool, shape, gone) is not None
        and cap.borrow_ok(pool, shape, gone)
    )


def _valid(cap: Capacity, pool: Pool, team: str, chosen: Sequence[Placed]) -> bool:
    """Whether every other team loses its jobs in `chosen` while it borrows: for each, one of
    them (the last taken) leaves it using more than its nominal quota once the rest are gone."""
    by_team: dict[str | None, set[str]] = {}
    for job in chosen:
        if job.shape.team != team:
            by_team.setdefault(job.shape.team, set()).add(job.job_id)
    return all(
        any(cap.borrowing(pool.name, other, frozenset(ids - {last})) for last in ids)
        for other, ids in by_team.items()
    )


def _choose(
    cap: Capacity,
    pool: Pool,
    quota: TeamQuota,
    shape: Shape,
    candidates: Sequence[Placed],
    nominal: bool,
) -> tuple[Placed, ...]:
    """The cheapest minimal set of `candidates` that lets the job fit (within its nominal quota,
    or with `nominal` off within its borrow limit), from Kueue's walk and from the machines
    that cost the least to free; nothing if no set will do."""
    shares = _ranker(cap, pool, quota.team)
    seeds: list[Sequence[Placed]] = [()]
    machines = _machines(cap, pool, quota, shape, candidates, shares)
    if machines is not None:
        seeds.append(machines)
    walked = (_walk(cap, pool, quota, shape, candidates, nominal, seed) for seed in seeds)
    found = [chosen for chosen in walked if chosen]
    if not found:
        return ()
    return min(found, key=lambda chosen: _cost(chosen, quota.team, shares))


def _walk(
    cap: Capacity,
    pool: Pool,
    quota: TeamQuota,
    shape: Shape,
    candidates: Sequence[Placed],
    nominal: bool,
    seed: Sequence[Placed],
) -> tuple[Placed, ...]:
    """From `seed`, candidates taken in order (shares read again after each) until the job fits,
    another team's job only while its team borrows; then whoever is not needed is spared."""
    chosen = list(seed)
    while not _fits(cap, pool, quota, shape, _ids(chosen), nominal):
        gone = _ids(chosen)
        shares = _ranker(cap, pool, quota.team, gone)
        above = {t: cap.borrowing(pool.name, t, gone) for t in {j.shape.team for j in candidates}}
        eligible = [
            job
            for job in candidates
            if job.job_id not in gone and (job.shape.team == quota.team or above[job.shape.team])
        ]
        if not eligible:
            return ()
        chosen.append(min(eligible, key=lambda job: _rank(job, quota.team, shares)))
    for job in list(reversed(chosen)):
        rest = [v for v in chosen if v is not job]
        if _fits(cap, pool, quota, shape, _ids(rest), nominal):
            chosen = rest
    return tuple(chosen)


def _machines(
    cap: Capacity,
    pool: Pool,
    quota: TeamQuota,
    shape: Shape,
    candidates: Sequence[Placed],
    shares: dict[str | None, float],
) -> list[Placed] | None:
    """In an inventory pool, the victims that free the `nodes` machines cheapest to free: on
    each machine, its candidates in order until one node of the job fits there, those not
    needed spared; machines by that cost, skipping one whose victims would take a team below
    its quota by more than its last job. None where no such machines are found (or in a pool
    of totals, where any capacity freed will do)."""
    if pool.kind != "inventory":
        return None
    need = shape.per_node
    options = []
    for machine, used in enumerate(cap.node_used(pool)):
        free = sub(pool.node, used)
        here = sorted(
            (job for job in candidates if machine in job.placement),
            key=lambda job: _rank(job, quota.team, shares),
        )
        picked: list[Placed] = []
        for job in here:
            if fits_in(need, free):
                break
            picked.append(job)
            free = add(free, job.shape.per_node)
        if not fits_in(need, free):
            continue
        for job in list(reversed(picked)):
            if fits_in(need, sub(free, job.shape.per_node)):
                picked.remove(job)
                free = sub(free, job.shape.per_node)
        options.append((_cost(picked, quota.team, shares), machine, picked))
    options.sort(key=lambda option: (option[0], option[1]))
    seed: list[Placed] = []
    taken = 0
    for _, _, picked in options:
        trial = seed + [job for job in picked if job not in seed]
        if not _valid(cap, pool, quota.team, trial):
            continue
        seed, taken = trial, taken + 1
        if taken == shape.nodes:
            return seed
    return None


def _ids(chosen: Iterable[Placed]) -> frozenset[str]:
    return frozenset(job.job_id for job in chosen)

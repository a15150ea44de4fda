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
preempted borrower requeued must not preempt its preemptor back). Victims: jobs already
stopping first, then other teams' borrowed work, then the lowest priority, then the most
recently admitted; a team is never cut below its nominal quota; the set is then minimised.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect_gpu_budget.admission.quota import (
    Capacity,
    Placed,
    Pool,
    Shape,
    TeamQuota,
    add,
    fits_in,
)


def victims(
    cap: Capacity, pool: Pool, quota: TeamQuota, shape: Shape, priority: int
) -> tuple[tuple[Placed, ...], str]:
    """The jobs to preempt so that a job of `quota.team` at `priority` fits, and, when there are
    none because of the team's settings, a note saying which setting keeps them running."""
    own, others, spared, kept = [], [], [], []
    for job in cap.placed:
        if job.shape.pool != pool.name:
            continue
        if job.shape.team == quota.team:
            if job.priority < priority:
                (own if quota.within_team == "lower_priority" else kept).append(job)
        elif cap.borrowing(pool.name, job.shape.team):
            if _may_reclaim(quota.reclaim, job.priority, priority):
                others.append(job)
            else:
                spared.append(job)
    chosen: tuple[Placed, ...] = ()
    if others:  # within its nominal quota once they are gone
        order = sorted(others + own, key=lambda j: _rank(j, quota.team))
        chosen = _minimal(cap, pool, quota, shape, order, nominal=True)
    if not chosen and own:  # only its own team's work: it may borrow as well
        order = sorted(own, key=lambda j: _rank(j, quota.team))
        chosen = _minimal(cap, pool, quota, shape, order, nominal=False)
    if chosen:
        return chosen, ""
    if kept:
        return (), (
            f"; team {quota.team} does not preempt its own lower-priority work (within_team: never)"
        )
    if not spared or not cap.within_quota(shape):
        return (), ""
    if quota.reclaim == "never":
        return (), f"; team {quota.team} takes back no capacity it lent (reclaim: never)"
    return (), (
        f"; team {quota.team} takes back lent capacity only from lower-priority work "
        f"(reclaim: lower_priority), and {len(spared)} borrowing job"
        f"{'' if len(spared) == 1 else 's'} here run at priority {priority} or higher"
    )


def describe(job: Placed, team: str) -> str:
    """A victim as a reason names it: its id, and whether it borrows or yields to priority."""
    why = "lower priority" if job.shape.team == team else "borrowing"
    return f"{job.job_id[:8]} ({job.shape.team}, {why}, priority {job.priority})"


def _may_reclaim(policy: str, victim: int, priority: int) -> bool:
    return policy == "any" or (policy == "lower_priority" and victim < priority)


def _rank(job: Placed, team: str) -> tuple[bool, bool, int, float]:
    """Kueue's order of candidates: already evicted, in another (borrowing) queue, lowest
    priority, most recently admitted."""
    return (not job.stopping, job.shape.team == team, job.priority, -job.admitted_at)


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


def _minimal(
    cap: Capacity,
    pool: Pool,
    quota: TeamQuota,
    shape: Shape,
    candidates: Sequence[Placed],
    nominal: bool,
) -> tuple[Placed, ...]:
    """Candidates taken in order until the job fits (within its nominal quota, or with
    `nominal` off within its borrow limit), never cutting another team below its quota; then
    whoever is not needed is spared. Nothing if even all of them would not do."""
    chosen: list[Placed] = []
    for job in candidates:
        gone = frozenset(v.job_id for v in chosen)
        if job.shape.team != quota.team and not cap.borrowing(pool.name, job.shape.team, gone):
            continue  # only work above its team's quota is borrowed
        chosen.append(job)
        if _fits(cap, pool, quota, shape, frozenset(v.job_id for v in chosen), nominal):
            break
    else:
        return ()
    for job in list(reversed(chosen)):
        rest = frozenset(v.job_id for v in chosen if v is not job)
        if _fits(cap, pool, quota, shape, rest, nominal):
            chosen.remove(job)
    return tuple(chosen)

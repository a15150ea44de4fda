"""The queues inside the org's decision, as Kueue keeps them: in a capacity pool with team
quotas each team has its own queue (a ClusterQueue), ordered by priority then arrival, and a job
waiting in it may block only that queue; a pool without team quotas is one queue shared by all.
Pure: no I/O.

Order across queues (`walk`), as Kueue's fair sharing (on by default in HyperPod task
governance) picks among ClusterQueues: the head of each queue is weighed, and the next job
decided is the head whose team's fair share once it runs is least (`Capacity.share`: what the
team would use above its nominal quota, as a part of what can be lent, per weight; 0 for a head
within its team's nominal quota, so those go first; a borrowing team of weight 0 last), then the
highest priority, then the earliest. This is read afresh before each pick, as admissions change
who is within quota and who has borrowed most.

What a job that cannot start blocks (`blocks`), so that later jobs needing it wait behind it
("block", not "hold": an admitted job holds its rate and reservation, `policy.Hold`):
- in a pool without team quotas: the pool (`pool:<pool>`), unless the pool's `backfill` is on;
- its team's queue (`team:<pool>:<team>`) when the team's `queueing` is `strict_fifo`; with
  `best_effort_fifo` (the default) the team's next jobs try in turn;
- a job within its team's nominal quota that waits for machines blocks borrowing in the pool
  (`borrow:<pool>`): jobs that would borrow wait behind it (nominal quota first), unless the
  pool's `backfill` is on. It never blocks another team's job within that team's quota.
A budget that stops a job makes it block the budget's scope (`policy`) for the later jobs of the
job's own team (`scope_key`), whatever the pool: an org's cap that a team's big job waits for does
not block
another team's job that fits it (each ClusterQueue of Kueue blocks only itself).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prefect_gpu_budget.admission.rules.capacity import Capacity
from prefect_gpu_budget.admission.rules.quota import Pool, Shape, TeamQuota
from prefect_gpu_budget.admission.rules.requests import Request
from prefect_gpu_budget.units import org_of, scope_path


def blocks(pool: Pool, quota: TeamQuota | None, within: bool) -> tuple[str, ...]:
    """The queue keys a job that cannot start blocks (see the module's notes)."""
    if quota is None:
        return () if pool.backfill else (f"pool:{pool.name}",)
    found = []
    if quota.queueing == "strict_fifo":
        found.append(f"team:{pool.name}:{quota.team}")
    if within and not pool.backfill:
        found.append(f"borrow:{pool.name}")
    return tuple(found)


def queue_of(scope: str) -> str:
    """The queue a job of `scope` is in: its team (`org/team`), or the org for a job of the
    org's own scope."""
    return "/".join(scope.split("/")[:2])


def scope_key(scope: str, req_scope: str) -> str:
    """The block a budget of `scope` makes when it stops a job of `req_scope`: it binds the later
    jobs of that job's queue (its team) only, as each of Kueue's ClusterQueues blocks only
    itself; another team's job that fits goes on."""
    return f"{scope}@{queue_of(req_scope)}"


def block_name(key: str) -> str:
    """A block as a job's recorded wait names it: a budget's scope (without its queue), or a
    pool's key as it is."""
    return key.partition("@")[0]


def blocked_keys(req: Request, blocks: Sequence[str]) -> list[str]:
    """What a job that waits blocks, from its decision's `blocks`: a budget's scope for its own
    team's queue; a pool, a team's queue or borrowing in a pool as they are."""
    return [key if ":" in key else scope_key(key, req.scope) for key in blocks]


def all_blocked(queues: Iterable[str], blocked: Mapping[str, Request]) -> bool:
    """Whether a budget of its org blocks every one of `queues` (nothing later can start)."""
    return all(scope_key(org_of(queue), queue) in blocked for queue in queues)


def ahead(
    req: Request, shape: Shape | None, blocked: Mapping[str, Request], capacity: Capacity | None
) -> tuple[str, Request] | None:
    """The first block the job waits behind, with the job that makes it: the budgets of its
    scopes blocked in its team's queue, and with a shape its pool (no team quotas) and its
    team's queue; `borrow:<pool>` only if it would borrow (checked only when such a block
    exists, so the walk stays linear)."""
    keys = [scope_key(scope, req.scope) for scope in scope_path(req.scope)]
    if shape is not None:
        keys += [f"pool:{shape.pool}", f"team:{shape.pool}:{shape.team}"]
    for key in keys:
        if key in blocked:
            return key, blocked[key]
    if shape is None or f"borrow:{shape.pool}" not in blocked:
        return None
    if capacity is None or not capacity.within_quota(shape):
        return f"borrow:{shape.pool}", blocked[f"borrow:{shape.pool}"]
    return None


def describe(key: str) -> str:
    """A block as a reason names it: a scope, a pool, a team's queue, borrowing in a pool."""
    kind, _, rest = key.partition(":")
    if kind == "pool":
        return f"pool {rest}"
    if kind == "team":
        pool, _, team = rest.partition(":")
        return f"the queue of team {team} in pool {pool} (strict FIFO)"
    if kind == "borrow":
        return f"pool {rest}, where jobs within their team's quota go before borrowers"
    return block_name(key)


def walk(ordered: Sequence[Request], capacity: Capacity | None) -> Iterator[Request]:
    """`ordered` (priority, then arrival) in the order the decision weighs it: outside capacity
    pools as it is; with pools, the best head of the per-team queues at each pick."""
    if capacity is None:
        yield from ordered
        return
    queues: dict[tuple[str, str], deque[Request]] = {}
    for req in ordered:
        key = (req.shape.pool, req.shape.team or "") if req.shape is not None else ("", "")
        queues.setdefault(key, deque()).append(req)
    while queues:
        key = min(queues, key=lambda k: _rank(queues[k][0], capacity))
        line = queues[key]
        yield line.popleft()
        if not line:
            del queues[key]


def _rank(req: Request, capacity: Capacity) -> tuple[Any, ...]:
    """Kueue's fair-sharing tournament: the least share once the head is admitted (0 for a head
    within its team's nominal quota, and outside team quotas), then the highest priority,
    then the earliest."""
    shape = req.shape
    share = 0.0
    if shape is not None and shape.pool in capacity.pools:
        share = capacity.share(shape.pool, shape.team, extra=shape.total)
    return (share, -req.priority, req.requested_at, req.job_id)

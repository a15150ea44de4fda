"""Settle what crashed holders left behind: the step that makes promise 3 (nothing lost) true.

A holder that dies leaves its ledger row holding the worst case (its reservation). Reconcile
finds rows whose holder is dead (same host) or silent (heartbeat older than `stale_after`):
- a queued job is cancelled (its waiter is gone);
- the job's launcher is asked about it (a local process by pid and start time, a cloud job by
  its id): a cloud job still waiting for capacity is cancelled and settles at zero, one that
  started meanwhile counts as started; an admitted job that never started settles at zero;
- a job still running keeps its reservation and is left alone (metered), unless it is past its
  max runtime, when it is stopped and settled;
- a job that finished settles from the real times (and billed figure) its launcher reports;
- a job that is gone without a record settles up to the last moment it could have run: its
  last heartbeat plus one heartbeat interval, never past its max runtime. Charging the worst
  case that the evidence allows keeps real spend under the budget.
Settling is exactly once in the ledger, so reconcile may run often and concurrently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from prefect_gpu_budget.admission.ledger import Ledger, holder_alive
from prefect_gpu_budget.admission.limits import RateLimits
from prefect_gpu_budget.admission.rules import orphans
from prefect_gpu_budget.admission.rules.timing import STALE_AFTER_S
from prefect_gpu_budget.launchers.base import Launcher, Probe
from prefect_gpu_budget.launchers.registry import launcher_for

log = logging.getLogger("prefect_gpu_budget.reconcile")


@dataclass(frozen=True)
class Reconciled:
    job_id: str
    scope: str
    action: str
    """`cancelled`, `settled`, `stopped`, `left-running`, `awaiting-lease-expiry` or
    `already-settled`."""
    actual_micro: int = 0


def _probe(row: dict, launchers: Mapping[str, Launcher] | None) -> tuple[Launcher | None, Probe]:
    """Ask the job's launcher about it; `unknown` when nobody can tell."""
    if not row["external_id"]:
        return None, Probe("unknown")
    if row["launcher"] == "local" and holder_alive(row["holder"]) is None:
        return None, Probe("unknown")  # a process on another host: cannot look from here
    try:
        launcher = launcher_for(row["launcher"], launchers)
        if launcher is None:
            return None, Probe("unknown")
        return launcher, launcher.probe(str(row["external_id"]))
    except Exception as exc:  # a cloud that does not answer: fall back to the evidence we hold
        log.warning("could not ask %s about job %s: %s", row["launcher"], row["id"][:8], exc)
        return None, Probe("unknown")


def awaiting_lease_expiry(ledger: Ledger, row: dict, now: float) -> bool:
    """A crashed admission in a capped scope that may hold Prefect slots under a lease whose id
    it did not live to record: nothing can hand those back but the lease's expiry, so the row
    stays open (its rate counted by the ledger, as Prefect counts the slots) until then."""
    return orphans.may_hold_unrecorded_lease(row, now) and any(
        rule.hourly_cap_cents is not None for rule in ledger.config.path_budgets(row["scope"])
    )


def reconcile(
    ledger: Ledger,
    limits: RateLimits | None = None,
    *,
    launchers: Mapping[str, Launcher] | None = None,
    now: float | None = None,
    stale_after: float = STALE_AFTER_S,
) -> list[Reconciled]:
    """Settle or cancel every orphan, the queued first; `launchers` (by kind) answer for jobs
    they ran, else saved launcher blocks named in the ledger rows are loaded. What to do with
    each is decided by `admission/rules/orphans.py`; this carries it out."""
    now = time.time() if now is None else now
    out = []
    found = ledger.views.orphans(now=now, stale_after=stale_after)
    # queued ones first: settling a running orphan frees what a queued one of the same gone
    # holder waits for, and it would be admitted for no one
    for row in sorted(found, key=lambda r: r["state"] != "queued"):
        awaiting = limits is not None and row["state"] != "queued"
        action = orphans.first_look(
            row, awaiting_lease_expiry=awaiting and awaiting_lease_expiry(ledger, row, now)
        )
        launcher = None
        if action is None:
            launcher, probe = _probe(row, launchers)
            action = orphans.decide(
                row, probe, now=now, can_stop=launcher is not None, limits=limits is not None
            )
        out += _carry_out(ledger, limits, launcher, row, action, now)
    return out


def _carry_out(
    ledger: Ledger,
    limits: RateLimits | None,
    launcher: Launcher | None,
    row: dict,
    action: orphans.Action,
    now: float,
) -> list[Reconciled]:
    """Do what was decided for one orphan; what reconcile reports of it."""
    job_id, scope = row["id"], row["scope"]
    if action.verb == "cancel-queued":
        if ledger.queue.cancel_queued(
            job_id, scope, "waiter vanished; cancelled by reconcile", now
        ):
            return [Reconciled(job_id, scope, "cancelled")]
        return []
    if action.verb == "await-lease-expiry":
        return [Reconciled(job_id, scope, "awaiting-lease-expiry")]
    if action.mark_started_at is not None:
        ledger.settlements.mark_started(job_id, action.mark_started_at, row["external_id"])
    if action.verb == "leave-running":
        return [Reconciled(job_id, scope, "left-running")]
    if action.stop:
        assert launcher is not None
        launcher.stop(str(row["external_id"]), grace=5.0)
        if action.real_end_after_stop:
            action = orphans.after_stop(action, launcher.probe(str(row["external_id"])))
    assert action.ended_at is not None
    done = ledger.settlements.settle(
        job_id,
        ended_at=action.ended_at,
        outcome="reconciled",
        billed_seconds=action.billed_seconds,
        actual_micro=action.actual_micro,
        scope=scope,
        now=now,
    )
    if action.release_lease and limits is not None:
        limits.release(action.release_lease)
    if done is None:
        return [Reconciled(job_id, scope, "already-settled")]
    return [Reconciled(job_id, scope, action.reported, done["actual_micro"])]

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
from prefect_gpu_budget.admission.timing import (  # the clocks live in timing; names kept here
    HEARTBEAT_S,
    STALE_AFTER_S,
    UNRECORDED_LEASE_S,
)
from prefect_gpu_budget.admission.timing import LEASE_S as LEASE_S
from prefect_gpu_budget.admission.timing import LIMIT_RETRY_S as LIMIT_RETRY_S
from prefect_gpu_budget.admission.timing import LIVENESS_S as LIVENESS_S
from prefect_gpu_budget.admission.timing import REPOSSESS_S as REPOSSESS_S
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
    return (
        row["lease_id"] is None
        and row["admitted_at"] is not None
        and now < max(row["admitted_at"], row["heartbeat_at"]) + UNRECORDED_LEASE_S
        and any(rule.hourly_cap_cents is not None for rule in ledger.path_budgets(row["scope"]))
    )


def reconcile(
    ledger: Ledger,
    limits: RateLimits | None = None,
    *,
    launchers: Mapping[str, Launcher] | None = None,
    now: float | None = None,
    stale_after: float = STALE_AFTER_S,
) -> list[Reconciled]:
    """Settle or cancel every orphan; `launchers` (by kind) answer for jobs they ran, else
    saved launcher blocks named in the ledger rows are loaded."""
    now = time.time() if now is None else now
    out = []
    for row in ledger.orphans(now=now, stale_after=stale_after):
        job_id, scope = row["id"], row["scope"]
        if row["state"] == "queued":
            if ledger.cancel_queued(job_id, scope, "waiter vanished; cancelled by reconcile", now):
                out.append(Reconciled(job_id, scope, "cancelled"))
            continue
        if limits is not None and awaiting_lease_expiry(ledger, row, now):
            out.append(Reconciled(job_id, scope, "awaiting-lease-expiry"))
            continue
        started = row["started_at"]
        action, billed, actual = "settled", None, None
        launcher, probe = _probe(row, launchers)
        if started is None and probe.started_at is not None:  # it started after its holder left
            ledger.mark_started(job_id, probe.started_at, row["external_id"])
            started = probe.started_at
        if started is None and probe.state == "running" and launcher is not None:
            launcher.stop(str(row["external_id"]), grace=5.0)  # still waiting for capacity
            action = "stopped"
        if started is None:
            ended = now
        elif probe.state == "running":
            if now < started + row["max_runtime_s"]:  # still within its max runtime: metered on
                out.append(Reconciled(job_id, scope, "left-running"))
                continue
            assert launcher is not None
            launcher.stop(str(row["external_id"]), grace=5.0)
            action, ended = "stopped", now
            after = launcher.probe(str(row["external_id"]))
            if after.state == "finished" and after.ended_at is not None:  # its real end
                ended, billed, actual = after.ended_at, after.billed_seconds, after.actual_micro
        elif probe.state == "finished" and probe.ended_at is not None:
            ended = min(probe.ended_at, started + row["max_runtime_s"])
            billed, actual = probe.billed_seconds, probe.actual_micro
        else:  # gone: charge up to the last moment it could have run, never past max runtime
            last_seen = max(row["heartbeat_at"], started) + HEARTBEAT_S
            ended = min(now, last_seen, started + row["max_runtime_s"])
        done = ledger.settle(
            job_id,
            ended_at=ended,
            outcome="reconciled",
            billed_seconds=billed,
            actual_micro=actual,
            scope=scope,
            now=now,
        )
        if row["lease_id"] and limits is not None:
            limits.release(row["lease_id"])
        if done is not None:
            out.append(Reconciled(job_id, scope, action, done["actual_micro"]))
        else:
            out.append(Reconciled(job_id, scope, "already-settled"))
    return out

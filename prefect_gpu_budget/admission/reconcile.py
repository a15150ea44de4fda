"""Settle what crashed holders left behind: the step that makes promise 3 (nothing lost) true.

A holder that dies leaves its ledger row holding the worst case (its reservation). Reconcile
finds rows whose holder is dead (same host) or silent (heartbeat older than `stale_after`):
- a queued job is cancelled (its waiter is gone);
- an admitted job that never started settles at zero;
- a started job whose process still runs (same pid and start time) keeps its reservation and
  is left alone, unless it is past its max runtime, when it is stopped and settled;
- a started job that is gone settles up to the last moment it could have run: its last
  heartbeat plus one heartbeat interval, never past its max runtime. Charging the worst case
  that the evidence allows keeps real spend under the budget.
Settling is exactly once in the ledger, so reconcile may run often and concurrently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prefect_gpu_budget.admission.ledger import Ledger, holder_alive, process_start_ticks
from prefect_gpu_budget.admission.limits import LEASE_S, RateLimits
from prefect_gpu_budget.launchers.local import stop_pid

HEARTBEAT_S = LEASE_S / 4


@dataclass(frozen=True)
class Reconciled:
    job_id: str
    scope: str
    action: str
    """`cancelled`, `settled`, `stopped`, `left-running` or `already-settled`."""
    actual_micro: int = 0


def _local_job_pid(row: dict) -> int | None:
    """The pid of a local job that still runs here, checked against its start time so that a
    reused pid is never taken for it; None if it is gone or ran elsewhere."""
    if row["launcher"] != "local" or not row["external_id"]:
        return None
    if holder_alive(row["holder"]) is None:  # another host: cannot look
        return None
    pid, _, ticks = str(row["external_id"]).partition(":")
    if not pid.isdigit() or not ticks or process_start_ticks(int(pid)) != ticks:
        return None
    return int(pid)


def reconcile(
    ledger: Ledger,
    limits: RateLimits | None = None,
    *,
    now: float | None = None,
    stale_after: float = 120.0,
) -> list[Reconciled]:
    now = time.time() if now is None else now
    out = []
    for row in ledger.orphans(now=now, stale_after=stale_after):
        job_id, scope = row["id"], row["scope"]
        if row["state"] == "queued":
            if ledger.cancel_queued(job_id, scope, "waiter vanished; cancelled by reconcile", now):
                out.append(Reconciled(job_id, scope, "cancelled"))
            continue
        started = row["started_at"]
        action = "settled"
        pid = None if started is None else _local_job_pid(row)
        if pid is not None:
            if now < started + row["max_runtime_s"]:  # still within its max runtime: metered on
                out.append(Reconciled(job_id, scope, "left-running"))
                continue
            stop_pid(pid, grace=5.0)
            action, ended = "stopped", now
        elif started is None:
            ended = now
        else:  # gone: charge up to the last moment it could have run, never past max runtime
            last_seen = max(row["heartbeat_at"], started) + HEARTBEAT_S
            ended = min(now, last_seen, started + row["max_runtime_s"])
        done = ledger.settle(job_id, ended_at=ended, outcome="reconciled", scope=scope, now=now)
        if row["lease_id"] and limits is not None:
            limits.release(row["lease_id"])
        if done is not None:
            out.append(Reconciled(job_id, scope, action, done["actual_micro"]))
        else:
            out.append(Reconciled(job_id, scope, "already-settled"))
    return out

"""Stopping work at its owner's word: one job, or a whole sweep.

A queued job is cancelled at once; an admitted or running one is marked
(`Ledger.settlements.ask_stop`) and its holder, which polls for that, stops it gracefully
(SIGTERM, its kill grace, SIGKILL) and settles it for what it ran. A sweep is first marked
cancelled (`SweepRecords.cancel`, so it starts no more trials), then each of its jobs not yet
ended is stopped so. Used by the agent gateway, the sweep's own watch and Ctrl-C on
`prefect-gpu-budget sweep`.
"""

from __future__ import annotations

from prefect_gpu_budget.admission.ledger import FINAL, Ledger

CANCELLED, STOPPING = "cancelled", "stopping"
TRIES = 5
"""How often a stop is asked of a job that moved between queued and admitted as it was asked."""


def stop_job(ledger: Ledger, job_id: str, scope: str, reason: str) -> str | None:
    """`cancelled` (it was queued), `stopping` (its holder stops it), or None: it has ended."""
    for _ in range(TRIES):  # an admission given back (`unadmit`) may move between the two asks
        if ledger.queue.cancel_queued(job_id, scope, reason):
            return CANCELLED
        if ledger.settlements.ask_stop(job_id, reason):
            return STOPPING
        row = ledger.views.job(job_id)
        if row["state"] in FINAL:
            return None
        if row.get("stop_asked_at"):
            return STOPPING
    return None


def stop_sweep(ledger: Ledger, run_id: str, scope: str, reason: str) -> dict[str, int]:
    """Mark the sweep cancelled and stop each of its jobs not yet ended; how many of each."""
    ledger.sweeps.cancel(run_id)
    counts = {CANCELLED: 0, STOPPING: 0}
    for row in ledger.views.jobs(scope, flow_run_id=run_id):
        if row["state"] not in FINAL:
            became = stop_job(ledger, row["id"], scope, reason)
            if became is not None:
                counts[became] += 1
    return counts

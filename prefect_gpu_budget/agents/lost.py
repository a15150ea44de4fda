"""What an agent is told of a sweep whose worker was lost.

A sweep's flow records its own end (`SweepRecords.end_sweep`) as its last act. A run that
reached a final state without it (its process SIGKILLed with the worker that served it, its
machine gone, a run cancelled from outside) did not end as a sweep: Prefect says `Crashed`
(or `Failed`, `Cancelled`), while the ledger still holds each trial's truth: which finished
and were billed, which were stopped with the worker (and settled by reconcile), which never
started. The door reports the trials from the ledger as ever, and says so in one line, so
that an agent does not start again, and pay again, for what it already has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect_gpu_budget.admission.ledger import FINAL
from prefect_gpu_budget.units import MICRO_PER_USD, fmt_usd


def worker_lost(run_ended: bool, sweep: Mapping[str, Any] | None) -> bool:
    """Whether a sweep's run ended (`run_ended`: its state is final) without the sweep's own
    end recorded: `sweep` is its row (`SweepRecords.sweep`; None before its flow opened it,
    when no trial can have started)."""
    return run_ended and sweep is not None and sweep["ended_at"] is None


def lost_message(trials: Sequence[Mapping[str, Any]], planned: int) -> str:
    """One line on a sweep whose worker was lost, from its trials as the door shows them
    (`state`, `outcome`, `job_id`, `cost_usd`: the ledger's) and how many it planned: how many
    finished and what they were billed, what became of the others, and that starting it again
    re-runs all of them."""
    finished = [t for t in trials if t["outcome"] == "completed"]
    asked = [t for t in trials if t["job_id"] and t["outcome"] != "completed"]
    stopped = [t for t in asked if t["state"] in FINAL]
    unsettled = [t for t in asked if t["state"] not in FINAL]
    never = max(0, planned - len(finished) - len(asked))
    words = [
        f"worker lost: {len(finished)} of {planned} trials finished (billed {_billed(finished)})"
    ]
    if stopped:
        words.append(f"{len(stopped)} stopped, failed or cancelled (billed {_billed(stopped)})")
    if unsettled:
        words.append(f"{len(unsettled)} not settled yet (reconcile settles what ran)")
    if never:
        words.append(f"{never} never started")
    words.append(f"starting it again re-runs all {planned}")
    return "; ".join(words)


def _billed(trials: Sequence[Mapping[str, Any]]) -> str:
    return fmt_usd(sum(round(t["cost_usd"] * MICRO_PER_USD) for t in trials))

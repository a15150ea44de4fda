"""What the agents' door answers, shaped: a sweep, its trials and best trial, and a session's
budget. Pure: `agents.door` reads the ledger and the Prefect API, these shape what it read.

Named once: a figure an agent reads has the name and form `prefect-gpu-budget status --json`
and `ledger --json` give it (dollars as `_usd`, times as ISO 8601 in UTC), whichever door
(REST or MCP) it comes through.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from prefect_gpu_budget.agents.lost import lost_message, worker_lost
from prefect_gpu_budget.placement.recorded import choice_view
from prefect_gpu_budget.units import iso, micro_to_usd, redact_urls, usd

FINAL_RUN_STATES = ("Completed", "Failed", "Crashed", "Cancelled", "TimedOut")
"""A sweep's run in one of these has ended: a long poll answers at once."""


def trial_number(name: str) -> int | None:
    """The trial of a sweep's job name `sweep/0003`."""
    tail = name.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else None


def budget_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """A session's budget from its `Ledger.views.status` row, each figure named as `status
    --json` names it, and when its period ends."""
    return {
        "scope": row["scope"],
        "hourly_cap_usd": usd(row["hourly_cap_micro"]),
        "running_rate_usd_per_hour": usd(row["running_rate_micro"]),
        "period": row["period"],
        "period_start": iso(row["period_start"]),
        "period_end": iso(row["period_end"]),
        "period_budget_usd": usd(row["period_budget_micro"]),
        "settled_usd": usd(row["settled_micro"]),
        "reserved_usd": usd(row["reserved_micro"]),
        "remaining_usd": usd(row["remaining_micro"]),
        "running": row["running"],
        "admitted": row["admitted"],
        "queued": row["queued"],
    }


def template_view(rule: Any, scope: str) -> dict[str, Any]:
    """The budget a session with no job yet will get: its team's session template (`rule`,
    a `BudgetRule`), named as `budget_view` names it."""
    return {
        "scope": scope,
        "from_template": rule.scope,
        "hourly_cap_usd": None if rule.hourly_cap_cents is None else rule.hourly_cap_cents / 100,
        "period": rule.period,
        "period_budget_usd": usd(rule.period_budget_micro),
    }


def sweep_view(
    run: Any,
    meta: Mapping[str, Any] | None,
    recorded: Mapping[int, Mapping[str, Any]],
    jobs: Mapping[int, Mapping[str, Any]],
    cancelled: bool,
) -> dict[str, Any]:
    """A sweep as the door answers it, from its Prefect `run`, its row (`meta`:
    `SweepRecords.sweep`, None before its flow opened it), its trials' records and its latest
    job per trial (both by trial number). `worker_lost`: its run ended without the sweep's own
    end recorded (see `agents.lost`); its trials are still the ledger's, and its message says
    how many finished and what starting it again would re-run."""
    state = run.state
    ended = bool(state and state.is_final())
    trials = [
        trial_view(index, recorded.get(index), jobs.get(index), ended)
        for index in sorted(set(recorded) | set(jobs))
    ]
    message = redact_urls(state.message or "") if state else ""
    if meta is not None and meta["message"] and (not message or state.is_completed()):
        message = redact_urls(meta["message"])
    lost = worker_lost(ended, meta)
    if lost:
        message = lost_message(trials, meta["trials"])
    return {
        "run_id": str(run.id),
        "name": run.name,
        "state": state.name if state else "Unknown",
        "message": message,
        "worker_lost": lost,
        "cancelled": bool(meta["cancelled_at"]) if meta else cancelled,
        "metric": meta["metric"] if meta else None,
        "goal": meta["goal"] if meta else None,
        "trials": trials,
        "spent_usd": round(sum(t["cost_usd"] for t in trials), 6),
        "best": best_trial(trials, meta),
    }


def trial_view(
    index: int | None,
    recorded: Mapping[str, Any] | None,
    row: Mapping[str, Any] | None,
    run_ended: bool = False,
) -> dict[str, Any]:
    """One trial as an agent sees it: its record in the sweep (parameters, metrics, the run's
    final state, how many NaN and infinite values it reported) and its job in the ledger
    (state, outcome, cost, wait, times). A trial with neither a job nor an end of its own is
    `pending` while its sweep's run goes on, `not_started` once that run has ended."""
    row = row or {}
    recorded = recorded or {}
    started, admitted = row.get("started_at"), row.get("admitted_at")
    waited = (
        (started or admitted or row.get("ended_at") or time.time()) - row["requested_at"]
        if row
        else None
    )
    unasked = "not_started" if run_ended else "pending"
    return {
        "trial": index,
        "job_id": row.get("id"),
        "name": row.get("name"),
        "params": recorded.get("params", {}),
        "state": row.get("state") or ("ended" if recorded.get("state") else unasked),
        "outcome": row.get("outcome"),
        "run_state": recorded.get("state"),
        "reason": redact_urls(trial_reason(row, recorded)),
        "metrics": recorded.get("metrics", {}),
        "records": recorded.get("records", 0),
        "non_finite_dropped": recorded.get("non_finite_dropped", 0),
        "cost_usd": micro_to_usd(row.get("actual_micro") or 0),
        "instance_type": row.get("instance_type"),
        "provisioning": row.get("provisioning"),
        "placement": choice_view(row.get("choice")),
        "placements": row.get("places") or None,
        "waited_s": None if waited is None else round(waited, 3),
        "requested_at": iso(row.get("requested_at")),
        "started_at": iso(started),
        "ended_at": iso(row.get("ended_at")),
    }


def trial_reason(row: Mapping[str, Any], recorded: Mapping[str, Any]) -> str:
    """Why a trial is where it is, in the one wording of its ending: none once it completed; a
    stopped one (or one being stopped) in the words of whoever stopped it, its job row's reason,
    which its run's message carries too (`admission.lifecycle`); a settled one that failed or
    ran out of time as its run said; one that waits, or ended unrun, as its row says. An
    admitted or running row holds the admission's words, which say nothing of the trial now:
    none."""
    state = row.get("state")
    if row.get("outcome") == "completed" or (not row and recorded.get("state") == "Completed"):
        return ""
    if row.get("stop_asked_at") or row.get("preempt_at"):
        return row.get("reason") or ""
    if state in ("admitted", "running"):
        return ""
    if state == "settled":
        return recorded.get("reason") or row.get("outcome") or ""
    return row.get("reason") or recorded.get("reason") or ""


def best_trial(
    trials: list[dict[str, Any]], meta: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The trial with the best value of the sweep's metric among those that completed."""
    if meta is None:
        return None
    metric, goal = meta["metric"], meta["goal"]
    scored = [
        (t["metrics"][metric], t["trial"])
        for t in trials
        if t["outcome"] == "completed"
        and isinstance(t["metrics"].get(metric), (int, float))
        and not isinstance(t["metrics"].get(metric), bool)
    ]
    if not scored:
        return None
    value, trial = min(scored) if goal == "min" else max(scored)
    return {"trial": trial, "metric": metric, "goal": goal, "value": value}

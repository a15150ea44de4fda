"""The campaign's figures: the runs' results and the end state summed into one JSON object."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from benchmarks.chaos.config import END_FIGURES, FAULTS, OTHER_FIGURES, PHASES, RUN_FIGURES
from benchmarks.chaos.state import RunResult


def summarise(
    results: list[RunResult], end: dict[str, Any], fault_results: list[RunResult] = ()
) -> dict[str, Any]:
    fault_results = list(fault_results)
    audits = [r.audit for r in results]
    fault_audits = [r.audit for r in fault_results]
    faults = Counter(r.phase for r in results if r.injected)
    random_faults = Counter(r.phase for r in results if r.injected and r.mark is None)
    out: dict[str, Any] = {
        "runs": len(results),
        "faults_injected": sum(faults.values()),
        "faults_by_phase": {p: faults.get(p, 0) for p in PHASES},
        "random_faults_by_phase": {p: random_faults.get(p, 0) for p in PHASES},
        "kills_landed": dict(Counter(r.landed for r in results)),
        "kill_points": dict(Counter(f"{r.landed} {r.position}" for r in results)),
        **{k: end[k] for k in END_FIGURES},
        "slot_mismatch_transient_cents": sum(a.slot_transient_cents or 0 for a in audits),
        "slots_held_past_deadline_cents": end["slots_held_past_deadline_cents"],
        "second_settles_charged": sum(r.second_settles_charged for r in results)
        + end["second_settles_charged"],
        "jobs_outlived_holder": sum(r.outlived for r in [*results, *fault_results]),
        "worker_errors": sum(r.errors for r in [*results, *fault_results]),
        "fault_runs": len(fault_results),
        "faults_by_kind": {
            f: sum(r.injected for r in fault_results if r.fault == f)
            for f in FAULTS
            if any(r.fault == f for r in fault_results)
        },
        "overshoot_micro": sum(r.overshoot_micro for r in fault_results),
        "unmetered_micro": sum(r.unmetered_micro for r in fault_results),
        "stuck_workers": sum(r.stuck for r in results),
        "after_each_run": {
            **{k: sum(getattr(a, k) or 0 for a in [*audits, *fault_audits]) for k in RUN_FIGURES},
            "slot_mismatch_transient_cents": sum(a.slot_transient_cents or 0 for a in audits),
            "unrecorded_lease_slots_cents": sum(a.slot_unrecorded_cents or 0 for a in audits),
            "awaiting_lease_expiry": sum(a.awaiting_lease_expiry for a in audits),
        },
        "end": {k: v for k, v in end.items() if k not in END_FIGURES and k != "messages"},
        "reconciled": dict(Counter(action for r in results for action in r.reconciled)),
        "jobs": end["jobs"],
        "run_s_median": round(statistics.median(r.wall_s for r in results), 2) if results else None,
        "messages": [
            f"run {i + 1} ({r.phase}, killed in {r.landed} at {r.position}): {m}"
            for i, r in enumerate(results)
            if r.lost()
            for m in [f"lost {r.lost()}", *r.audit.messages]
        ][:40]
        + [f"end: {m}" for m in end["messages"]],
    }
    lost = {k: out[k] for k in (*END_FIGURES, *OTHER_FIGURES) if out[k]}
    lost.update({f"after_each_run.{k}": out["after_each_run"][k] for k in RUN_FIGURES})
    out["lost"] = {k: v for k, v in lost.items() if v}
    out["by_fault_run"] = [
        {
            "fault": r.fault,
            "injected": r.injected,
            "outcome": r.position,
            "overshoot_micro": r.overshoot_micro,
            "unmetered_micro": r.unmetered_micro,
            "processes_left": r.outlived,
            "lost": r.lost(),
        }
        for r in fault_results
    ]
    out["messages"] = (
        out["messages"][:40]
        + [
            f"fault run {i + 1} ({r.fault}): {m}"
            for i, r in enumerate(fault_results)
            if r.lost()
            for m in [f"lost {r.lost()}", *r.audit.messages]
        ][:40]
    )
    out["by_run"] = [
        {
            "phase": r.phase,
            "mark": r.mark,
            "injected": r.injected,
            "landed": r.landed,
            "position": r.position,
            "delay_ms": round(r.delay_s * 1000, 1),
            "reconciled": r.reconciled,
            "awaiting_lease_expiry": r.audit.awaiting_lease_expiry,
            "slot_transient_cents": r.audit.slot_transient_cents,
            "unrecorded_lease_slots_cents": r.audit.slot_unrecorded_cents,
            "lost": r.lost(),
        }
        for r in results
    ]
    return out

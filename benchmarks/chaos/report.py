"""The campaign's report: a progress line per run, and the figures as markdown tables."""

from __future__ import annotations

from typing import Any

from benchmarks.chaos.config import (
    END_FIGURES,
    FAULT_GRACE_S,
    FAULT_MAX_RUNTIME_S,
    FAULTS,
    OTHER_FIGURES,
    PHASES,
)
from benchmarks.chaos.state import RunResult
from benchmarks.harness.report import table


def progress(i: int, runs: int, r: RunResult) -> str:
    lost = r.lost()
    verdict = "ok" if not lost else f"LOST {lost}: " + "; ".join(r.audit.messages[:3])
    how = f"at {r.mark}" if r.mark else f"after {r.delay_s * 1000:4.0f} ms"
    transient = r.audit.slot_transient_cents
    return (
        f"run {i + 1}/{runs}: {r.phase:<14} killed {how} in {r.landed} at {r.position:<14} "
        f"reconcile {','.join(r.reconciled) or '-':<17} "
        f"{verdict}{f' (transient {transient})' if transient else ''} ({r.wall_s:.1f} s)"
    )


def fault_progress(j: int, runs: int, r: RunResult) -> str:
    lost = r.lost()
    verdict = "ok" if not lost else f"LOST {lost}: " + "; ".join(r.audit.messages[:3])
    return (
        f"fault {j + 1}/{runs}: {r.phase:<7} {'injected' if r.injected else 'NOT injected'}, "
        f"job {r.position}, overshoot {r.overshoot_micro} micro-USD, unmetered "
        f"{r.unmetered_micro}, processes left {r.outlived}: {verdict} ({r.wall_s:.1f} s)"
    )


def report(out: dict[str, Any]) -> str:
    phases = [[p, str(out["faults_by_phase"][p])] for p in PHASES]
    landed = [[k, str(v)] for k, v in sorted(out["kill_points"].items())]
    end, each, wait_ = out["end"], out["after_each_run"], out["end"]["wait"]
    figures = [[k, str(out[k])] for k in ("runs", "faults_injected", *END_FIGURES, *OTHER_FIGURES)]
    figures += [
        ["capped scopes checked at the end", str(end["capped_scopes_checked"])],
        [
            "Prefect slots held / ledger running rate at the end",
            f"{end['prefect_slots_held']} / {end['ledger_running_rate_cents']}",
        ],
    ]
    per_run = [[k, str(v)] for k, v in each.items()]
    waited = [
        ["waited (s)", str(wait_["waited_s"])],
        ["rows awaiting lease expiry when the runs ended", str(wait_["awaiting_rows_at_start"])],
        ["Prefect slots held then", str(wait_["prefect_slots_held_at_start"])],
        ["of them under leases nobody recorded", str(wait_["unrecorded_lease_slots_at_start"])],
        ["all slots back after (s)", str(wait_["slots_returned_after_s"])],
        [
            "slots vs ledger at reconcile's deadline (cents)",
            str(wait_["slot_difference_at_deadline_cents"]),
        ],
    ]
    fault_rows = [
        [k, str(out["faults_by_kind"].get(k, 0))] for k in FAULTS if k in out["faults_by_kind"]
    ]
    fault_rows += [
        ["overshoot past the reservations (micro-USD)", str(out["overshoot_micro"])],
        ["ran unmetered (micro-USD)", str(out["unmetered_micro"])],
    ]
    reconciled = [[k, str(v)] for k, v in sorted(out["reconciled"].items())]
    reconciled += [[f"{k} (at the end)", str(v)] for k, v in sorted(wait_["reconciled"].items())]
    sections = [
        f"Chaos: {out['runs']} runs of {out['workers_per_run']} admitters on {out['backend']}, "
        f"one SIGKILLed per run (Prefect server: {out['prefect_server']}; seed {out['seed']}, "
        f"{out['cpus']} CPUs, {out['wall_s']:.0f} s, median run {out['run_s_median']} s)",
        "",
        table(["Phase chosen", "Faults injected"], phases),
        "",
        table(["Where the kill landed (phase, last step mark)", "Kills"], landed),
        "",
        table(["Reconcile action", "Jobs"], reconciled or [["-", "0"]]),
        "",
        table(["After each run's reconcile", "Sum"], per_run),
        "",
        table(["Waiting for every lease to expire", "Value"], waited),
        "",
        table(["End state (whole ledger)", "Value"], figures),
    ]
    if out["fault_runs"]:
        sections += [
            "",
            f"{out['fault_runs']} fault runs, guaranteed mode (max_runtime "
            f"{FAULT_MAX_RUNTIME_S:.0f} s, grace {FAULT_GRACE_S:.0f} s)",
            "",
            table(["Fault", "Injected"], fault_rows),
        ]
    if out["messages"]:
        sections += ["", "Findings", "", *[f"- {m}" for m in out["messages"]]]
    sections += ["", "Nothing lost." if not out["lost"] else f"LOST: {out['lost']}"]
    return "\n".join(sections)

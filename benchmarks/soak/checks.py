"""The soak's verdicts: the ledger after the run (through `admission/audit.py`, plus what only
the soak knows: the agents' own counts), Prefect slots left taken, connections flat, and
every target met or missed."""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks.soak.config import FAILURES, MESSAGES, ORG, TARGETS, Config, budgets
from prefect_gpu_budget.admission.audit import audit, slot_mismatches
from prefect_gpu_budget.admission.ledger import Ledger
from prefect_gpu_budget.admission.limits import RateLimits


def check_ledger(cfg: Config, records: list[list[dict[str, Any]]], start: float) -> dict[str, Any]:
    """What the ledger holds after the run: the audit's checks (`admission/audit.py`: no
    orphan, no charge doubled or lost, promise 1 at every admission instant, Prefect's slots
    against the ledger's running rate), and the counts the agents kept against the ledger's."""
    ledger = Ledger(cfg.url, create=False)
    try:
        rows = ledger.views.jobs(ORG)
        status = ledger.views.status(ORG)
        found = audit(ledger, scope=ORG)
    finally:
        ledger.db.dispose()
    problems: list[str] = []
    by_state = Counter(r["state"] for r in rows)
    outcomes = Counter(r["outcome"] for r in rows if r["state"] == "settled")
    left = {s: by_state[s] for s in ("queued", "admitted", "running") if by_state[s]}
    if left:
        problems.append(f"left unsettled: {left}")
    counts: Counter[str] = Counter()
    for lines in records:
        finals = [line for line in lines if line["final"]]
        counts.update(finals[-1]["counts"] if finals else {})
    expected = {
        "rows": (len(rows), counts["submitted"] + cfg.agents),
        "completed": (outcomes["completed"], counts["completed"]),
        "withdrawn": (outcomes["withdrawn"], counts["withdrawn"]),
        "timed out": (by_state["timed_out"], counts["timed_out"] + counts["starved"]),
        "cancelled while waiting": (
            by_state["cancelled"] + outcomes["cancelled"],
            counts["interrupted"] + counts["stuck"],
        ),
        "rejected": (by_state["rejected"], counts["rejected"]),
    }
    problems += [
        f"{what}: ledger {got}, agents {want}"
        for what, (got, want) in expected.items()
        if got != want
    ]
    over = [r["id"][:8] for r in rows if (r["actual_micro"] or 0) > r["reserved_micro"] > 0]
    if over:
        problems.append(f"{len(over)} jobs cost more than their reservation: {over[:3]}")
    for s in status:
        if s["reserved_micro"] or s["running"] or s["queued"]:
            problems.append(
                f"{s['scope']}: reserved {s['reserved_micro']}, running {s['running']}, "
                f"queued {s['queued']} after the run"
            )
    problems += found.messages[:MESSAGES]
    if len(found.messages) > MESSAGES:
        problems.append(f"... and {len(found.messages) - MESSAGES} more findings of the audit")
    return {
        "rows": len(rows),
        "rows_since_start": sum(1 for r in rows if r["requested_at"] >= start),
        "by_state": dict(by_state),
        "settled_outcomes": dict(outcomes),
        "spend_usd": sum(r["actual_micro"] or 0 for r in rows) / 1e6,
        "cancelled_after_admission": {  # where a cancellation can strand a Prefect lease
            "jobs": outcomes["cancelled"],
            "lease_recorded": sum(
                1 for r in rows if r["outcome"] == "cancelled" and r["lease_id"] is not None
            ),
        },
        "audit": {
            "orphans_left": found.orphans_left,
            "double_charges": found.double_charges,
            "missing_charges": found.missing_charges,
            "invariant_violations": found.invariant_violations,
        },
        "problems": problems,
        "leaked_slots": leaked_slots(cfg, rows),
    }


def leaked_slots(cfg: Config, rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per capped scope, the Prefect slots the ledger's running jobs do not explain (the audit's
    `slot_mismatches`); once everything settled, every slot still taken (none expected)."""
    limits = RateLimits()
    try:
        return dict(slot_mismatches(limits, rows, budgets(cfg)).by_scope)
    finally:
        limits.close()


def flat(agents: list[dict[str, Any]], pg: dict[str, float | None]) -> dict[str, Any]:
    """End-window median against first-half maximum: PostgreSQL backends of the gate, and the
    sums over agents of pooled connections, descriptors and threads, with a slack (`slack`):
    fewer than one per agent for the ledger's pool, two per agent for descriptors and threads.
    Those follow what is in flight: on a busy host each agent holds one or two more keep-alive
    sockets and worker threads late in a short run (seen in the suite: descriptors 47 against
    42 over five agents). A leak grows in every agent with its jobs: between the first half's
    maximum and the end window an agent of the short soak runs about a dozen jobs, so one
    descriptor or thread lost in every six jobs still fails."""
    out = {"pg_backends": {"end": pg["end"], "early_max": pg["early_max"], "slack": 0}}
    for key in ("pool", "fds", "threads"):
        ends = [a[key]["end"] for a in agents]
        highs = [a[key]["early_max"] for a in agents]
        out[key] = {
            "end": None if None in ends else sum(ends),
            "early_max": None if None in highs else sum(highs),
            "slack": max(0, len(agents) - 1) if key == "pool" else 2 * len(agents),
        }
    for figure in out.values():
        figure["ok"] = (
            None not in figure.values() and figure["end"] <= figure["early_max"] + figure["slack"]
        )
    return out


def targets(out: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    agents = out["agents"]
    growth = [a["rss_growth_mib"] for a in agents]
    ratio = out["latency"]["admit"]["ratio"]

    bad = sum(out["totals"][k] for k in FAILURES)
    found = {
        "latency_p95_ratio": {
            "value": ratio,
            "target": f"<= {TARGETS['latency_p95_ratio']}",
            "ok": ratio is not None and ratio <= TARGETS["latency_p95_ratio"],
        },
        "rss_growth_mib": {
            "value": max(growth) if None not in growth and growth else None,
            "target": f"<= {TARGETS['rss_growth_mib']} per agent",
            "ok": bool(growth) and None not in growth and max(growth) <= TARGETS["rss_growth_mib"],
        },
        "connections_flat": {
            "value": {k: [v["end"], v["early_max"]] for k, v in out["flat"].items()},
            "target": "[end median, first-half max]: PostgreSQL backends; pool, fds, threads "
            "summed over agents; end <= max",
            "ok": all(v["ok"] for v in out["flat"].values()),
        },
        "connections_returned": {
            "value": [a["final"]["pool_out"] if a["final"] else None for a in agents],
            "target": "0 checked out in every agent after the run",
            "ok": all(a["final"] and a["final"]["pool_out"] == 0 for a in agents),
        },
        "no_errors": {
            "value": bad,
            "target": f"0 of {', '.join(FAILURES)}; every agent exits 0",
            "ok": bad == 0 and all(c == 0 for c in out["agent_exit_codes"]),
        },
        "ledger_consistent": {
            "value": len(out["ledger"]["problems"]),
            "target": "nothing left open; counts, spend and caps consistent",
            "ok": not out["ledger"]["problems"],
        },
        "prefect_slots_returned": {
            "value": out["ledger"]["leaked_slots"],
            "target": "no slot left taken in any Prefect limit",
            "ok": not out["ledger"]["leaked_slots"],
        },
    }
    return found, [name for name, t in found.items() if not t["ok"]]

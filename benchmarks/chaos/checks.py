"""Reconcile as a scheduled reconcile would, tracking the rows it holds open until an unrecorded
lease expires, and what is checked around it: Prefect's slots per org against the ledger
(`admission/audit.py`), and that settling a finished job again charges nothing."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable

from benchmarks.chaos.config import STALE_S
from benchmarks.chaos.state import Setup
from prefect_gpu_budget.admission.audit import SlotCheck, slot_mismatches
from prefect_gpu_budget.admission.ledger import ACTIVE, Ledger
from prefect_gpu_budget.admission.reconcile import Reconciled, reconcile
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.units import org_of


def reconcile_tracked(setup: Setup) -> list[Reconciled]:
    """Reconcile the whole ledger (as a scheduled reconcile would). When it settles a row it
    had held open until an unrecorded lease's latest expiry, Prefect must hold no slots for
    it any more: what Prefect still holds then in that org is counted (`late_cents`)."""
    done = reconcile(setup.ledger, setup.limits, stale_after=STALE_S)
    closed = set()
    for d in done:
        if d.action == "awaiting-lease-expiry":
            setup.awaiting[d.job_id] = org_of(d.scope)
        elif d.job_id in setup.awaiting:
            closed.add(setup.awaiting.pop(d.job_id))
    if closed:
        pending = set(setup.awaiting)
        for check in check_slots(setup, sorted(closed), pending).values():
            if check.mismatch_cents:
                setup.late_cents += check.mismatch_cents
                setup.late += [f"{m} just after reconcile's deadline" for m in check.messages]
    return done


def last_actions(done: Iterable[Reconciled]) -> dict[str, str]:
    """Each job's last reconcile action, in the order the jobs first came up."""
    out: dict[str, str] = {}
    for d in done:
        out[d.job_id] = d.action
    return out


def settle_again(ledger: Ledger, org: str | None) -> int:
    """Settle every finished job of the run (of the ledger: None) once more: how many that
    charged (none may)."""
    return sum(
        ledger.settlements.settle(row["id"], ended_at=time.time() + 3600, outcome="again")
        is not None
        for row in ledger.views.jobs(org)
        if row["state"] not in ACTIVE
    )


def check_slots(setup: Setup, orgs: list[str] | None, awaiting: set[str]) -> dict[str, SlotCheck]:
    """Prefect slots against the ledger's running rate, per org (all orgs with budgets: None)."""
    rules: dict[str, list[BudgetRule]] = defaultdict(list)
    for rule in setup.ledger.config.budgets():
        rules[org_of(rule.scope)].append(rule)
    return {
        org: slot_mismatches(setup.limits, setup.ledger.views.jobs(org), rules[org], awaiting)
        for org in (orgs if orgs is not None else sorted(rules))
    }

"""The end of the campaign: wait until every lease a dead worker may hold unrecorded has
expired, reconcile, and audit the whole ledger."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from benchmarks.chaos.checks import check_slots, last_actions, reconcile_tracked, settle_again
from benchmarks.chaos.config import END_FIGURES, END_MARGIN_S, POLL_S, STALE_S, log
from benchmarks.chaos.state import Setup
from prefect_gpu_budget.admission.audit import audit, awaiting_rows
from prefect_gpu_budget.admission.ledger import ACTIVE
from prefect_gpu_budget.admission.rules.timing import UNRECORDED_LEASE_S


def end_state(setup: Setup) -> dict[str, Any]:
    """Wait until every Prefect lease a dead worker may hold unrecorded has expired and been
    repossessed, reconcile, and audit the whole ledger.

    Reconcile holds the row of such a lease open until UNRECORDED_LEASE_S after its last stamp
    (its admission, or a stamp while it asked for slots), by when the server has returned the
    slots: so the wait lasts until UNRECORDED_LEASE_S after the last such stamp, then until Prefect's slots match the ledger (at most
    END_MARGIN_S more). Meanwhile, every POLL_S, the ledger is reconciled and the slots of the
    orgs where anything was held are compared.
    """
    ledger = setup.ledger
    started = time.time()
    stamps = [  # an unrecorded lease's latest grant is near its row's last stamp
        max(r["admitted_at"], r["heartbeat_at"])
        for r in ledger.views.jobs()
        if r["admitted_at"] is not None and r["lease_id"] is None
    ]
    deadline = max(stamps, default=started) + UNRECORDED_LEASE_S
    bound = deadline + END_MARGIN_S
    awaiting = {r["id"] for r in awaiting_rows(ledger, stale_after=STALE_S)}
    first = check_slots(setup, None, awaiting)
    watch = [
        org for org, c in first.items() if c.slots_cents or c.mismatch_cents or c.transient_cents
    ]
    log(
        f"end: {len(awaiting)} rows awaiting lease expiry, Prefect holds "
        f"{sum(c.slots_cents for c in first.values())} slots in {len(watch)} orgs; waiting up to "
        f"{max(0.0, bound - started):.0f} s for every lease to expire"
    )
    actions: dict[str, str] = {}
    returned_after = at_deadline = None
    told = started
    while True:
        now = time.time()
        actions.update(last_actions(reconcile_tracked(setup)))
        pending = set(setup.awaiting)
        checks = check_slots(setup, watch, pending).values()
        held = sum(c.slots_cents for c in checks)
        off = sum(c.mismatch_cents + c.transient_cents + c.unrecorded_cents for c in checks)
        if held == 0 and returned_after is None:
            returned_after = now - started
        if now >= deadline and at_deadline is None:
            at_deadline = off  # has the repossessor beaten reconcile's deadline?
        if (now >= deadline and not pending and off == 0) or now >= bound:
            waited = time.time() - started
            break
        if now - told >= 15:
            told = now
            log(f"end: {len(pending)} rows awaiting, Prefect holds {held} slots; waiting")
        time.sleep(POLL_S)
    actions.update(last_actions(reconcile_tracked(setup)))
    second = settle_again(ledger, None)
    final = audit(ledger, stale_after=STALE_S)  # the slots apart: nothing explains a difference
    slots = check_slots(setup, None, set()).values()
    out = {
        "orphans_left": final.orphans_left,
        "double_charges": final.double_charges,
        "missing_charges": final.missing_charges,
        "slot_mismatch_cents": sum(c.mismatch_cents for c in slots),
        "invariant_violations": final.invariant_violations,
        "awaiting_lease_expiry_left": final.awaiting_lease_expiry,
        "second_settles_charged": second,
        "jobs": final.jobs,
        "capped_scopes_checked": sum(c.scopes for c in slots),
        "prefect_slots_held": sum(c.slots_cents for c in slots),
        "ledger_running_rate_cents": sum(
            r["rate_cents"] for r in ledger.views.jobs() if r["state"] in ACTIVE
        ),
        "wait": {
            "waited_s": round(waited, 1),
            "deadline_after_s": round(max(0.0, deadline - started), 1),
            "awaiting_rows_at_start": len(awaiting),
            "prefect_slots_held_at_start": sum(c.slots_cents for c in first.values()),
            "unrecorded_lease_slots_at_start": sum(c.unrecorded_cents for c in first.values()),
            "slots_returned_after_s": None if returned_after is None else round(returned_after, 1),
            "slot_difference_at_deadline_cents": at_deadline,
            "reconciled": dict(Counter(actions.values())),
        },
        "slots_held_past_deadline_cents": setup.late_cents,
        "messages": [*setup.late, *final.messages][:40],
    }
    slot_messages = [m for c in slots for m in c.messages]
    out["messages"] += [m for m in slot_messages if m not in out["messages"]][:40]
    log(
        f"end: waited {out['wait']['waited_s']} s; "
        + ", ".join(f"{k} {out[k]}" for k in END_FIGURES)
    )
    return out

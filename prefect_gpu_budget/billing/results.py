"""What an import of the bill did (`BillImport`), with what it found on the way: a job's figure
held for an admin (`HeldBill`) and a closed period over its budget by the bill (`OverByBill`);
and how each reads, for people (`summary`, `held_line`, `over_line`) and as JSON (`as_json`).

The ledger's store of bills (`admission/ledger/bills.py`) builds them; `billing.imports`, the
CLI and the daily flow read them. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from prefect_gpu_budget.units import fmt_usd, usd

__all__ = [
    "BillImport",
    "HeldBill",
    "OverByBill",
    "as_json",
    "fmt_utc",
    "held_line",
    "over_line",
    "summary",
]


@dataclass(frozen=True)
class OverByBill:
    """A closed period whose spend, trued up from the bill, passed its budget."""

    scope: str
    period_start: float
    period_end: float
    budget_micro: int
    spent_micro: int


@dataclass(frozen=True)
class HeldBill:
    """A job's final figure held for an admin to accept (`Bills.accept`)."""

    job_id: str
    scope: str
    billed_micro: int
    reason: str


@dataclass
class BillImport:
    """What one import (or `forget`) did."""

    source: str
    billing_period: str
    lines: int
    changed: bool
    """False: the same lines as the last import of this period, and no figure turned final."""
    jobs_final: int = 0
    jobs_provisional: int = 0
    untagged_micro: int = 0
    account_micro: int = 0
    booked_micro: int = 0
    """What the budgets' period spend moved by, summed over every budget's periods."""
    drift_micro: int = 0
    """What the import changed in the bills booked on top of settlements, counted once."""
    moved: dict[str, int] = field(default_factory=dict)
    """What each budget's period spend moved by, by the budget's scope."""
    over_by_bill: list[OverByBill] = field(default_factory=list)
    """Closed periods this import found over their budget (newly, or by more than before)."""
    orgs: list[str] = field(default_factory=list)
    twice: int = 0
    """Lines read more than once in this import (alike in all they say): booked once."""
    twice_where: str = ""
    """Where one of them was read again, for the message."""
    copies: dict[str, int] = field(default_factory=dict)
    """Lines already held under another billing period (by that period): not booked again."""
    refused: int = 0
    refused_micro: int = 0
    """Lines naming a job they cannot be true of: kept apart, booked nowhere."""
    held: list[HeldBill] = field(default_factory=list)
    """Jobs whose final figure this import held for an admin."""
    provisional: dict[str, int] = field(default_factory=dict)
    """How many jobs are provisional, by the reason."""


def fmt_utc(t: float) -> str:
    """An instant as `YYYY-MM-DD HH:MM UTC`."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M ") + "UTC"


def _booked_parts(done: BillImport) -> list[str]:
    """What a changed import booked: its figures, the drift, the budgets moved, the lines
    booked nowhere."""
    final = f"{done.jobs_final} job(s) final"
    provisional = ", ".join(
        f"{count} provisional ({reason})" for reason, count in sorted(done.provisional.items())
    )
    parts = [f"{final}, {provisional or '0 provisional'}"]
    if done.held:
        parts.append(f"{len(done.held)} job(s) held for an admin to accept (`bill accept`)")
    parts.append(f"drift booked {fmt_usd(done.drift_micro)}")
    moved = ", ".join(f"{scope} {fmt_usd(amount)}" for scope, amount in done.moved.items())
    parts.append(f"budgets moved: {moved or 'none'}")
    if done.untagged_micro:
        parts.append(f"untagged {fmt_usd(done.untagged_micro)}")
    if done.account_micro:
        parts.append(f"account-level {fmt_usd(done.account_micro)} (not spread over scopes)")
    if done.refused:
        parts.append(
            f"{done.refused} line(s) refused, {fmt_usd(done.refused_micro)} "
            "(not true of the jobs they name: `bill drift`)"
        )
    return parts


def summary(done: BillImport) -> str:
    """One line of what an import did, for people: the drift it booked once, and apart what
    each budget's period spend moved by (every budget on a job's path moves by its bill)."""
    head = f"{done.source} {done.billing_period}: {done.lines} lines"
    once = []
    if done.twice:
        once.append(f"{done.twice} line(s) read twice, booked once (e.g. {done.twice_where})")
    for period, count in sorted(done.copies.items()):
        once.append(f"{count} line(s) already held under {done.source} {period}: not booked again")
    if not done.changed:
        return "; ".join([f"{head}, unchanged since the last import", *once])
    booked = _booked_parts(done)
    return f"{head}; " + "; ".join([booked[0], *once, *booked[1:]])


def held_line(held: HeldBill) -> str:
    """One line for a job's figure held for an admin."""
    return (
        f"held: job {held.job_id} ({held.scope}) billed {fmt_usd(held.billed_micro)}, {held.reason}"
    )


def over_line(mark: OverByBill) -> str:
    """One line for a closed period over its budget by the bill."""
    return (
        f"over by bill: {mark.scope} spent {fmt_usd(mark.spent_micro)} of its "
        f"{fmt_usd(mark.budget_micro)} budget in the period from "
        f"{fmt_utc(mark.period_start)} to {fmt_utc(mark.period_end)}"
    )


def as_json(done: BillImport) -> dict[str, Any]:
    """What an import did, as `bill import --json` prints it (money in dollars)."""
    return {
        "source": done.source,
        "billing_period": done.billing_period,
        "lines": done.lines,
        "changed": done.changed,
        "jobs_final": done.jobs_final,
        "jobs_provisional": done.jobs_provisional,
        "provisional": done.provisional,
        "booked_usd": usd(done.booked_micro),
        "drift_usd": usd(done.drift_micro),
        "moved_usd": {scope: usd(amount) for scope, amount in done.moved.items()},
        "untagged_usd": usd(done.untagged_micro),
        "account_usd": usd(done.account_micro),
        "read_twice": done.twice,
        "copies": done.copies,
        "refused": done.refused,
        "refused_usd": usd(done.refused_micro),
        "held": [
            {
                "job_id": h.job_id,
                "scope": h.scope,
                "billed_usd": usd(h.billed_micro),
                "reason": h.reason,
            }
            for h in done.held
        ],
        "over_by_bill": [
            {"scope": m.scope, "budget_usd": usd(m.budget_micro), "spent_usd": usd(m.spent_micro)}
            for m in done.over_by_bill
        ],
    }

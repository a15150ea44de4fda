"""An import of a bill, from what was read to what the ledger holds: the lines checked (the
budgets' currency), grouped by (source, billing period), each group imported whole in one
transaction (`Ledger.bills.import_bill`). Everything is read and checked before anything is
written: a bad file changes nothing, and the previous import stays in force."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from prefect_gpu_budget.billing.files import check_currency
from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.units import fmt_usd


def import_lines(
    ledger: Any,
    lines: Sequence[BillLine],
    *,
    read_from: str,
    provisional_hours: float,
    periods: Iterable[tuple[str, str]] = (),
    now: float | None = None,
) -> list[Any]:
    """Import `lines`, one (source, billing period) at a time; `periods` names groups to
    import even when no line of them was read (a delivery that bills nothing replaces what an
    earlier one billed). Returns each group's `BillImport`, in order."""
    check_currency(lines)
    groups: dict[tuple[str, str], list[BillLine]] = defaultdict(list)
    for key in periods:
        groups[key]
    for line in lines:
        groups[(line.source, line.billing_period)].append(line)
    return [
        ledger.bills.import_bill(
            source,
            period,
            group,
            read_from=read_from,
            provisional_hours=provisional_hours,
            now=now,
        )
        for (source, period), group in sorted(groups.items())
    ]


def summary(done: Any) -> str:
    """One line of what an import did, for people: the drift it booked once, and apart what
    each budget's period spend moved by (every budget on a job's path moves by its bill)."""
    head = f"{done.source} {done.billing_period}: {done.lines} lines"
    parts = []
    if done.twice:
        parts.append(f"{done.twice} line(s) read twice, booked once (e.g. {done.twice_where})")
    for period, count in sorted(done.copies.items()):
        parts.append(f"{count} line(s) already held under {done.source} {period}: not booked again")
    if not done.changed:
        return "; ".join([f"{head}, unchanged since the last import", *parts])
    final = f"{done.jobs_final} job(s) final"
    provisional = ", ".join(
        f"{count} provisional ({reason})" for reason, count in sorted(done.provisional.items())
    )
    parts.insert(0, f"{final}, {provisional or '0 provisional'}")
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
    return f"{head}; " + "; ".join(parts)


def held_line(held: Any) -> str:
    """One line for a job's figure held for an admin."""
    return (
        f"held: job {held.job_id} ({held.scope}) billed {fmt_usd(held.billed_micro)}, {held.reason}"
    )


def over_line(mark: Any) -> str:
    """One line for a closed period over its budget by the bill."""
    from prefect_gpu_budget.admission.rules import periods

    return (
        f"over by bill: {mark.scope} spent {fmt_usd(mark.spent_micro)} of its "
        f"{fmt_usd(mark.budget_micro)} budget in the period from "
        f"{periods.fmt_instant(mark.period_start, 'UTC')} to "
        f"{periods.fmt_instant(mark.period_end, 'UTC')}"
    )

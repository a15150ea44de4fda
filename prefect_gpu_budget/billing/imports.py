"""An import of a bill, from what was read to what the ledger holds: the lines checked (the
budgets' currency), grouped by (source, billing period), each group imported whole in one
transaction by the store of bills (`BillStore`, which the ledger's `Ledger.bills` is).
Everything is read and checked before anything is written: a bad file changes nothing, and the
previous import stays in force.

`import_export` is the one door: `bill import` and the daily flow (`flows/bill_import.py`)
both read a `BillSource` and import what it read through it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Protocol

from prefect_gpu_budget.billing.files import check_currency
from prefect_gpu_budget.billing.lines import BillLine
from prefect_gpu_budget.billing.results import BillImport
from prefect_gpu_budget.billing.sources import BillSource

__all__ = ["BillStore", "import_export", "import_lines"]


class BillStore(Protocol):
    """Where imports of the bill are kept, and what they change in the budgets is booked
    (`admission.ledger.bills.Bills` is one)."""

    def import_bill(
        self,
        source: str,
        billing_period: str,
        lines: Sequence[BillLine],
        *,
        read_from: str,
        provisional_hours: float,
        now: float | None,
    ) -> BillImport:
        """Replace what the store holds of (source, billing period) with `lines`, whole."""
        ...


def import_lines(
    store: BillStore,
    lines: Sequence[BillLine],
    *,
    read_from: str,
    provisional_hours: float,
    periods: Iterable[tuple[str, str]] = (),
    now: float | None = None,
) -> list[BillImport]:
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
        store.import_bill(
            source,
            period,
            group,
            read_from=read_from,
            provisional_hours=provisional_hours,
            now=now,
        )
        for (source, period), group in sorted(groups.items())
    ]


def import_export(
    source: BillSource,
    periods: list[str],
    store: BillStore,
    provisional_hours: float,
    *,
    now: float | None = None,
) -> list[BillImport]:
    """Read `periods` (`YYYY-MM`) from `source` and import each (source, billing period) it
    holds whole, an empty one included: what `bill import` and the daily flow both do."""
    read = source.read(periods)
    lines = [line for group in read.values() for line in group]
    return import_lines(
        store,
        lines,
        read_from=source.where(),
        provisional_hours=provisional_hours,
        periods=read.keys(),
        now=now,
    )

"""An import of a bill, from what was read to what the ledger holds: the lines checked (the
budgets' currency), grouped by (source, billing period), each group imported whole in one
transaction by the store of bills (`BillStore`, which the ledger's `Ledger.bills` is).
Everything is read and checked before anything is written: a bad file changes nothing, and the
previous import stays in force.

`import_export` is the one door: `bill import` and the daily flow (`flows/bill_import.py`)
both read a `BillSource` and import what it read through it. It streams: the source's reads
(`BillSource.stream`) hand their lines one at a time to the store's `import_reads`, which
stages them batch by batch, so an import's memory is bounded by a batch, not by the month
(docs/bill.md, "Size"). `import_lines` imports a list already read."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from prefect_gpu_budget.billing.files import check_currency
from prefect_gpu_budget.billing.lines import BillLine, BillRead
from prefect_gpu_budget.billing.reading import number_repeats
from prefect_gpu_budget.billing.results import BillImport
from prefect_gpu_budget.billing.sources import BillSource

__all__ = ["BillStore", "import_export", "import_lines", "reads_of"]


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


class StreamingStore(BillStore, Protocol):
    """A store that takes reads line by line (`Bills` is one): memory bounded by a batch."""

    def import_reads(
        self,
        reads: Iterable[BillRead],
        *,
        read_from: str,
        provisional_hours: float,
        now: float | None,
    ) -> list[BillImport]:
        """Import every (source, billing period) the reads hold (or name), each whole, in
        order; their repeated line ids numbered read by read; a line in another currency
        refused before anything is replaced."""
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


def reads_of(source: Any, periods: list[str]) -> list[BillRead]:
    """`periods` of `source` as reads: its `stream`, or, for a source without one, what its
    `read` returns (read whole, already numbered), as one read."""
    stream = getattr(source, "stream", None)
    if stream is not None:
        return list(stream(periods))
    found = source.read(periods)
    return [BillRead([line for group in found.values() for line in group], tuple(found))]


def import_export(
    source: BillSource,
    periods: list[str],
    store: BillStore,
    provisional_hours: float,
    *,
    now: float | None = None,
) -> list[BillImport]:
    """Read `periods` (`YYYY-MM`) from `source` and import each (source, billing period) it
    holds whole, an empty one included: what `bill import` and the daily flow both do. A store
    with `import_reads` takes the lines as they are read; another is handed each period
    whole (`import_lines`)."""
    reads = reads_of(source, periods)
    if hasattr(store, "import_reads"):
        return store.import_reads(
            reads, read_from=source.where(), provisional_hours=provisional_hours, now=now
        )
    lines = [line for read in reads for line in number_repeats(list(read.lines))]
    return import_lines(
        store,
        lines,
        read_from=source.where(),
        provisional_hours=provisional_hours,
        periods=[key for read in reads for key in read.periods],
        now=now,
    )

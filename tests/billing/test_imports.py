"""The one door of an import (billing/imports.py): `import_export` reads a `BillSource` and
hands each (source, billing period) it holds, an empty one included, whole to a `BillStore`, in
order; a line in another currency is refused before anything is handed on. The ledger's store
of bills is a `BillStore` (a real ledger's import: tests/billing/test_once.py,
tests/blocks/test_billing.py)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace

import pytest

from prefect_gpu_budget.admission.ledger.bills import Bills
from prefect_gpu_budget.billing.imports import BillStore, import_export, import_lines
from prefect_gpu_budget.billing.lines import BillError, BillLine, BillRead
from prefect_gpu_budget.billing.results import BillImport

LINE = BillLine(
    source="aws-cur2",
    billing_period="2026-11",
    line_id="l1",
    line_type="Usage",
    usage_start=0.0,
    usage_end=3600.0,
    billed_micro=1_000_000,
    currency="USD",
)


class _Source:
    def __init__(self, read: dict[tuple[str, str], list[BillLine]]) -> None:
        self.found = read
        self.asked: list[list[str]] = []

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        self.asked.append(periods)
        return self.found

    def where(self) -> str:
        return "s3://lab-billing/gpu"


class _Store:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str], str, float, float | None]] = []

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
        ids = [line.line_id for line in lines]
        self.calls.append((source, billing_period, ids, read_from, provisional_hours, now))
        return BillImport(source, billing_period, len(ids), changed=bool(ids))


def test_each_period_read_is_imported_whole_an_empty_one_included() -> None:
    source = _Source(
        {
            ("aws-cur2", "2026-11"): [LINE, replace(LINE, line_id="l2")],
            ("aws-cur2", "2026-10"): [],
        }
    )
    store = _Store()
    done = import_export(source, ["2026-10", "2026-11"], store, 0.0, now=5.0)
    assert source.asked == [["2026-10", "2026-11"]]
    assert store.calls == [
        ("aws-cur2", "2026-10", [], "s3://lab-billing/gpu", 0.0, 5.0),
        ("aws-cur2", "2026-11", ["l1", "l2"], "s3://lab-billing/gpu", 0.0, 5.0),
    ]
    assert [(d.billing_period, d.lines, d.changed) for d in done] == [
        ("2026-10", 0, False),
        ("2026-11", 2, True),
    ]


def test_a_line_in_another_currency_is_refused_before_anything_is_imported() -> None:
    store = _Store()
    euros = replace(LINE, line_id="l2", currency="EUR", where="b.csv, row 4")
    with pytest.raises(BillError, match="b.csv, column line_item_currency_code, row 4"):
        import_lines(store, [LINE, euros], read_from="b.csv", provisional_hours=48)
    assert store.calls == []


def test_the_ledgers_store_of_bills_is_a_bill_store() -> None:
    wanted = inspect.signature(BillStore.import_bill).parameters
    has = inspect.signature(Bills.import_bill).parameters
    assert list(has) == list(wanted)
    assert [p.kind for p in has.values()] == [p.kind for p in wanted.values()]


def test_a_source_without_a_stream_is_read_whole_as_one_read() -> None:
    from prefect_gpu_budget.billing.imports import reads_of

    source = _Source({("aws-cur2", "2026-11"): [LINE], ("aws-cur2", "2026-10"): []})
    [read] = reads_of(source, ["2026-10", "2026-11"])
    assert list(read.lines) == [LINE]
    assert set(read.periods) == {("aws-cur2", "2026-11"), ("aws-cur2", "2026-10")}


def test_a_streaming_store_is_handed_the_reads_as_they_are() -> None:
    class _Streaming(_Store):
        def import_reads(self, reads, *, read_from, provisional_hours, now):
            self.reads = list(reads)
            return []

    class _Stream(_Source):
        def stream(self, periods: list[str]) -> list[BillRead]:
            self.asked.append(periods)
            return [BillRead(iter([LINE]), (("aws-cur2", p),)) for p in periods]

    store, source = _Streaming(), _Stream({})
    assert import_export(source, ["2026-11"], store, 0.0) == []
    assert source.asked == [["2026-11"]] and store.calls == []
    [read] = store.reads
    assert read.periods == (("aws-cur2", "2026-11"),) and next(iter(read.lines)) is LINE

"""An import of a bill in bounded memory (admission/ledger/bill_staging.py): the lines are read
as they come and written in batches, so memory does not grow with them; a bad line anywhere,
the last line of the last file included, leaves the previous import in force and nothing
staged; the same month again writes no line; a line id repeated across a read is numbered as
`number_repeats` numbers a list. On SQLite and PostgreSQL."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from prefect_gpu_budget.admission.ledger import Ledger, bill_staging
from prefect_gpu_budget.admission.ledger.tables import bill_lines, bill_staged
from prefect_gpu_budget.admission.rules import periods
from prefect_gpu_budget.admission.rules.policy import BudgetRule
from prefect_gpu_budget.billing.files import FilesSource
from prefect_gpu_budget.billing.imports import import_export
from prefect_gpu_budget.billing.lines import BillError, BillLine, BillRead
from prefect_gpu_budget.billing.reading import number_repeats
from tests.billing import fixtures

NOV = periods.bounds("month", "UTC", 1793750400.0)[0]  # 2026-11-01T00:00Z
NOW = NOV + 40 * 86400


@pytest.fixture
def lab(ledger):
    for scope in ("lab", "lab/vision"):
        rule = BudgetRule(scope, period_budget_micro=10**9, period="month")
        ledger.config.set_budget(rule, now=NOV - 60)
    return ledger


def _untagged(n: int, first: int = 0) -> Iterator[BillLine]:
    for i in range(first, first + n):
        yield BillLine(
            source="aws-cur2",
            billing_period="2026-11",
            line_id=f"li-{i:08d}",
            line_type="Usage",
            usage_start=NOV + (i % 700) * 3600,
            usage_end=NOV + (i % 700 + 1) * 3600,
            billed_micro=10_000 + i % 997,
            currency="USD",
            resource_id=f"i-{i % 50:017x}",
            description="USE1-BoxUsage:g5.xlarge",
            where=f"cur.parquet, row {i + 1}",
        )


def _statements(ledger: Ledger) -> list[tuple[str, int]]:
    """Every statement the ledger runs from now on, with how many rows of parameters."""
    seen: list[tuple[str, int]] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        seen.append((statement, len(parameters) if executemany else 1))

    sa.event.listen(ledger.db.engine, "before_cursor_execute", record)
    return seen


def _stage_rows(ledger: Ledger) -> int:
    with ledger.db.read() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(bill_staged)).scalar_one()


def _lines(ledger: Ledger) -> list[tuple]:
    with ledger.db.read() as conn:
        query = sa.select(bill_lines).order_by(bill_lines.c.line_id)
        return [tuple(row) for row in conn.execute(query)]


def test_lines_are_read_as_they_are_written_a_batch_at_a_time(lab, monkeypatch) -> None:
    monkeypatch.setattr(bill_staging, "STAGE_BATCH", 7)
    read = 0

    def lines() -> Iterator[BillLine]:
        nonlocal read
        for line in _untagged(50):
            read += 1
            yield line

    statements = _statements(lab)
    written, ahead = 0, []

    def note(conn, cursor, statement, parameters, context, executemany) -> None:
        nonlocal written
        if statement.startswith(f"INSERT INTO {bill_staged.name}"):
            ahead.append(read - written)
            written += len(parameters) if executemany else 1

    sa.event.listen(lab.db.engine, "before_cursor_execute", note)
    [done] = lab.bills.import_reads([BillRead(lines())], provisional_hours=0, now=NOW)
    assert done.lines == 50 and done.untagged_micro == sum(x.billed_micro for x in _untagged(50))
    assert written == 50 and max(ahead) <= 7  # never more than a batch read ahead
    assert [n for s, n in statements if s.startswith(f"INSERT INTO {bill_staged.name}")] == [
        7,
        7,
        7,
        7,
        7,
        7,
        7,
        1,
    ]
    assert _stage_rows(lab) == 0  # the stage is emptied


@pytest.mark.parametrize("lines", [20_000])
def test_memory_does_not_grow_with_the_lines(tmp_path: Path, monkeypatch, lines: int) -> None:
    """Peak traced memory of an import of 3 x `lines` lines against one of `lines` lines, in
    one process: a ledger that held every line would need about three times as much."""
    monkeypatch.setattr(bill_staging, "STAGE_BATCH", 1_000)
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    peaks = []
    for n in (lines, 3 * lines):
        tracemalloc.start()
        [done] = ledger.bills.import_reads([BillRead(_untagged(n))], provisional_hours=0, now=NOW)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert done.lines == n
    ledger.db.dispose()
    assert peaks[1] < 1.5 * peaks[0], peaks


def _two_files(folder: Path, job: str, bad: dict | None = None) -> list[Path]:
    """The reference's CUR rows (`job`'s two hours and credit, a tax, an untagged line) in
    one file, and 40 untagged hours in a second, its last row changed by `bad`."""
    folder.mkdir()
    reference = fixtures.cur_rows()
    for row in reference[:3]:
        row["resource_tags"] = {"user_gpu_budget_job": job}
    rows = []
    for i, line in enumerate(_untagged(40)):
        row = fixtures.cur_rows()[4]
        row["identity_line_item_id"] = line.line_id
        row["line_item_unblended_cost"] = row["line_item_net_unblended_cost"] = 0.01 * (i + 1)
        rows.append(row)
    rows[-1].update(bad or {})
    first = fixtures.write_parquet(folder / "part-0.parquet", reference)
    return [first, fixtures.write_parquet(folder / "part-1.parquet", rows)]


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"line_item_currency_code": "EUR"}, "part-1.parquet, column line_item_currency_code"),
        (
            {"line_item_usage_end_date": fixtures._t("2026-11-01T00:00:00Z")},
            "part-1.parquet, column line_item_usage_end_date",
        ),
    ],
    ids=["currency", "ends-before-it-starts"],
)
def test_a_bad_last_line_of_the_last_file_leaves_the_previous_import_in_force(
    lab, tmp_path: Path, monkeypatch, bad: dict, said: str
) -> None:
    monkeypatch.setattr(bill_staging, "STAGE_BATCH", 4)  # many batches staged before it
    start = fixtures._t("2026-11-03T10:00:00Z").timestamp()
    external = fixtures.ARN.rsplit("/", 1)[-1]
    rate = {"rate_micro_per_hour": 36_000_000, "rate_cents": 3600}  # its bill is not held
    job = fixtures.settled_job(lab, "lab/vision", start, 1.34, external_id=external, **rate)
    job = job["id"]
    good = _two_files(tmp_path / "a", job)
    [first] = import_export(FilesSource(good), [], lab.bills, 0.0, now=NOW)
    assert first.changed and first.lines == 45 and first.jobs_final == 1
    before = (_lines(lab), lab.views.period_settled("lab", NOV), lab.bills.drift())
    assert before[1] == 45_251_000  # $37.688 + $12.563 - $5.00, rounded to the micro-dollar
    with pytest.raises(BillError, match=f"{said}, row 40"):
        import_export(FilesSource(_two_files(tmp_path / "b", job, bad)), [], lab.bills, 0.0)
    assert (_lines(lab), lab.views.period_settled("lab", NOV), lab.bills.drift()) == before
    assert _stage_rows(lab) == 0


def test_a_read_that_fails_halfway_changes_nothing(lab, monkeypatch) -> None:
    monkeypatch.setattr(bill_staging, "STAGE_BATCH", 10)
    lab.bills.import_reads([BillRead(_untagged(30))], provisional_hours=0, now=NOW)
    before = _lines(lab)

    def cut() -> Iterator[BillLine]:
        yield from (replace(x, billed_micro=1) for x in _untagged(25))
        raise BillError("s3://bills/part-3.csv.gz", "unreadable gzip file (truncated?)")

    with pytest.raises(BillError, match="part-3.csv.gz"):
        lab.bills.import_reads([BillRead(cut())], provisional_hours=0, now=NOW)
    assert _lines(lab) == before and _stage_rows(lab) == 0


def test_the_same_month_again_writes_no_line(lab) -> None:
    [first] = lab.bills.import_reads([BillRead(_untagged(120))], provisional_hours=0, now=NOW)
    statements = _statements(lab)
    [again] = lab.bills.import_reads([BillRead(_untagged(120))], provisional_hours=0, now=NOW)
    assert first.changed and not again.changed and again.lines == 120
    touched = [s for s, _ in statements if bill_lines.name in s]
    assert not any(s.lstrip().startswith(("INSERT", "DELETE", "UPDATE")) for s in touched)
    restated = [
        replace(x, billed_micro=x.billed_micro + (x.line_id == "li-00000007"))
        for x in _untagged(120)
    ]
    [later] = lab.bills.import_reads([BillRead(restated)], provisional_hours=0, now=NOW)
    assert later.changed and later.untagged_micro == first.untagged_micro + 1


def test_a_repeated_id_is_numbered_as_a_list_is(lab) -> None:
    base = list(_untagged(6))
    twice = [
        *base,
        replace(base[2], billed_micro=5, where="b, row 1"),  # another amount: another line
        replace(base[4], where="b, row 2"),  # the same line read again
        replace(base[1], where="b, row 3"),  # and another, its id before, read after
    ]
    [done] = lab.bills.import_reads([BillRead(iter(twice))], provisional_hours=0, now=NOW)
    assert done.lines == 7 and done.twice == 2
    assert done.twice_where == "b, row 2 (as cur.parquet, row 5)"  # the first read again
    with lab.db.read() as conn:
        ids = sorted(conn.execute(sa.select(bill_lines.c.line_id)).scalars())
    expected = sorted({line.line_id for line in number_repeats(twice)})
    assert ids == expected and "li-00000002#2" in ids


def test_two_lines_of_one_id_that_differ_are_refused_unnumbered(lab) -> None:
    first = next(_untagged(1))
    with pytest.raises(BillError, match="twice, differently"):
        lab.bills.import_bill(
            "aws-cur2", "2026-11", [first, replace(first, billed_micro=3)], provisional_hours=0
        )
    assert _lines(lab) == [] and _stage_rows(lab) == 0


def test_a_stage_a_dead_import_left_is_deleted_a_day_later(lab) -> None:
    old = bill_staging.staged_row("dead", 0, 0, next(_untagged(1)), time.time() - 2 * 86400)
    with lab.db.tx() as conn:
        conn.execute(bill_staged.insert().values(dict(zip(bill_staging.STAGED, old, strict=True))))
    lab.bills.import_reads([BillRead(_untagged(3))], provisional_hours=0, now=NOW)
    assert _stage_rows(lab) == 0

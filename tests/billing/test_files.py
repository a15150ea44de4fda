"""Local bill files in either schema, told apart by their columns, and the currency check."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_gpu_budget.billing.files import check_currency, read_bill_files
from prefect_gpu_budget.billing.lines import BillError
from tests.billing.fixtures import (
    cur_rows,
    gcp_rows,
    write_csv,
    write_gcp_jsonl,
    write_gcp_parquet,
    write_jsonl,
    write_parquet,
)


def test_each_file_is_read_in_the_schema_its_columns_show(tmp_path: Path) -> None:
    paths = [
        write_parquet(tmp_path / "cur.parquet", cur_rows()[:2]),
        write_csv(tmp_path / "cur.csv.gz", cur_rows()[2:], zipped=True),
        write_jsonl(tmp_path / "cur.jsonl", cur_rows()[:1]),
        write_gcp_jsonl(tmp_path / "gcp.jsonl"),
        write_gcp_parquet(tmp_path / "gcp.parquet"),
    ]
    lines = read_bill_files(paths)
    assert [line.source for line in lines] == ["aws-cur2"] * 6 + ["gcp-billing"] * 6
    assert [line.where.rsplit(", row ", 1)[0] for line in lines] == [
        str(p) for p, n in zip(paths, (2, 3, 1, 3, 3), strict=True) for _ in range(n)
    ]
    # li-001 is in two of the files, the GCP rows in two: the same lines read twice keep one
    # id each (the import books them once)
    ids = [line.line_id for line in lines]
    assert ids[5] == ids[0] and ids[9:] == ids[6:9] and len(set(ids)) == 8


def test_one_path_may_be_given_alone(tmp_path: Path) -> None:
    path = write_gcp_jsonl(tmp_path / "gcp.jsonl")
    assert len(read_bill_files(path)) == len(read_bill_files(str(path))) == 3


def test_the_source_forces_the_schema(tmp_path: Path) -> None:
    cur = write_parquet(tmp_path / "cur.parquet", cur_rows())
    assert len(read_bill_files([cur], source="aws-cur2")) == 5
    with pytest.raises(BillError) as caught:
        read_bill_files([cur], source="gcp-billing")
    assert (caught.value.where, caught.value.rule, caught.value.column) == (
        str(cur),
        "missing column",
        "invoice",
    )
    gcp = write_gcp_jsonl(tmp_path / "gcp.jsonl")
    with pytest.raises(BillError) as caught:
        read_bill_files([gcp], source="aws-cur2")
    assert caught.value.column == "identity_line_item_id"
    with pytest.raises(ValueError, match="source is one of aws-cur2, gcp-billing"):
        read_bill_files([cur], source="azure")


def test_a_file_of_neither_schema_is_refused_naming_its_columns(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("date,amount,project\n2026-11-03,4.10,lab\n")
    with pytest.raises(BillError, match="neither a CUR 2.0 nor a GCP billing export") as caught:
        read_bill_files([path])
    assert "date, amount, project" in str(caught.value)
    both = tmp_path / "both.jsonl"
    both.write_text('{"invoice": {"month": "202611"}, "cost": 1, "line_item_unblended_cost": 1}\n')
    with pytest.raises(BillError, match="both a CUR 2.0 and a GCP"):
        read_bill_files([both])


def test_a_file_named_twice_is_refused(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "cur.parquet", cur_rows())
    with pytest.raises(BillError, match="named twice"):
        read_bill_files([path, tmp_path / "." / "cur.parquet"])


def test_another_currency_is_named_by_file_column_and_row(tmp_path: Path) -> None:
    rows = cur_rows()
    rows[3]["line_item_currency_code"] = "EUR"
    cur = write_csv(tmp_path / "cur.csv", rows)
    lines = read_bill_files([cur])
    check_currency(lines[:3], "USD")
    with pytest.raises(BillError) as caught:
        check_currency(lines, "USD")
    assert (caught.value.where, caught.value.column, caught.value.row) == (
        str(cur),
        "line_item_currency_code",
        4,
    )
    assert "'EUR'" in caught.value.rule and "USD" in caught.value.rule
    gcp = gcp_rows()
    gcp[2]["currency"] = "JPY"
    lines = read_bill_files([write_gcp_jsonl(tmp_path / "gcp.jsonl", gcp)])
    with pytest.raises(BillError) as caught:
        check_currency(lines)
    assert (caught.value.column, caught.value.row) == ("currency", 3)
    check_currency(lines[:2], "usd")  # codes compare case-insensitively


def test_files_are_read_line_by_line_a_file_at_a_time(tmp_path: Path) -> None:
    """`iter_bill_files` hands on each line as its row is read: a bad second file is met only
    after the first file's lines, and `FilesSource.stream` reads through it, unnumbered."""
    from prefect_gpu_budget.billing.files import FilesSource, iter_bill_files

    good = write_parquet(tmp_path / "cur.parquet", cur_rows())
    bad = tmp_path / "cut.csv"
    bad.write_text("identity_line_item_id\nli-1\n")  # CUR-like, lacking the required columns
    lines = iter_bill_files([good, bad])
    assert [next(lines).line_id for _ in range(5)][0].startswith("li-001")
    with pytest.raises(BillError, match="cut.csv, column bill_billing_period_start_date"):
        next(lines)
    twice = write_parquet(tmp_path / "again.parquet", cur_rows()[:1])
    [read] = FilesSource([good, twice]).stream([])
    assert read.periods == () and len(list(read.lines)) == 6  # numbered by whoever imports

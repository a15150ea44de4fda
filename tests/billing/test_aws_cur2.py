"""CUR 2.0 files read into bill lines: each format, the tag's key forms, net vs unblended cost,
and the one-line errors a bad file gets."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefect_gpu_budget.billing.aws_cur2 import REQUIRED, is_mark_key, read_cur2_file
from prefect_gpu_budget.billing.lines import BillError, BillLine
from tests.billing.fixtures import (
    ARN,
    AWS_JOB,
    UNTAGGED_ARN,
    cur_rows,
    cur_table,
    write_csv,
    write_jsonl,
    write_parquet,
)

WRITERS: dict[str, Callable[[Path, list[dict[str, Any]]], Path]] = {
    "parquet": lambda p, rows: write_parquet(p.with_suffix(".parquet"), rows),
    "csv": lambda p, rows: write_csv(p.with_suffix(".csv"), rows),
    "csv.gz": lambda p, rows: write_csv(p.with_suffix(".csv.gz"), rows, zipped=True),
    "jsonl": lambda p, rows: write_jsonl(p.with_suffix(".jsonl"), rows),
}


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("kind", WRITERS)
def test_the_reference_rows_read_alike_in_every_format(tmp_path: Path, kind: str) -> None:
    path = WRITERS[kind](tmp_path / "part-0", cur_rows())
    lines = read_cur2_file(path)
    assert [line.line_id for line in lines] == [
        "li-001/2026-11-03T10:00:00Z/2026-11-03T11:00:00Z",
        "li-002/2026-11-03T11:00:00Z/2026-11-03T11:20:00Z",
        "li-003/2026-11-03T10:00:00Z/2026-11-03T11:20:00Z",
        "li-004/2026-11-01T00:00:00Z/2026-12-01T00:00:00Z",
        "li-005/2026-11-04T09:00:00Z/2026-11-04T10:00:00Z",
    ]
    assert [line.billed_micro for line in lines] == [
        37_688_000,
        12_563_000,
        -5_000_000,
        4_100_000,
        1_408_400,
    ]
    assert [line.job_mark for line in lines] == [AWS_JOB, AWS_JOB, AWS_JOB, None, None]
    assert [line.line_type for line in lines] == ["Usage", "Usage", "Credit", "Tax", "Usage"]
    assert [line.usage for line in lines] == [True, True, False, False, True]
    assert [line.resource_id for line in lines] == [ARN, ARN, ARN, None, UNTAGGED_ARN]
    first = lines[0]
    assert first == BillLine(
        source="aws-cur2",
        billing_period="2026-11",
        line_id="li-001/2026-11-03T10:00:00Z/2026-11-03T11:00:00Z",
        line_type="Usage",
        usage_start=_epoch("2026-11-03T10:00:00Z"),
        usage_end=_epoch("2026-11-03T11:00:00Z"),
        billed_micro=37_688_000,
        currency="USD",
        job_mark=AWS_JOB,
        resource_id=ARN,
        description="USE1-Train:ml.p4d.24xlarge",
        where=f"{path}, row 1",
    )
    assert lines[4].where == f"{path}, row 5"


@pytest.mark.parametrize(
    "key",
    ["user_gpu_budget_job", "user:gpu-budget-job", "gpu-budget-job", "USER:GPU-Budget-Job"],
)
@pytest.mark.parametrize("kind", ["parquet", "csv.gz"])
def test_each_form_of_the_tag_key_marks_the_line(tmp_path: Path, key: str, kind: str) -> None:
    rows = cur_rows()[:1]
    rows[0]["resource_tags"] = {"user_team": "vision", key: "job-42"}
    assert read_cur2_file(WRITERS[kind](tmp_path / "f", rows))[0].job_mark == "job-42"


@pytest.mark.parametrize(
    "key", ["user_gpu_budget_jobs", "aws:gpu-budget-job", "user_team", "user_gpu_budget"]
)
def test_other_tags_do_not_mark_it(tmp_path: Path, key: str) -> None:
    rows = cur_rows()[:1]
    rows[0]["resource_tags"] = {key: "job-42"}
    assert read_cur2_file(write_parquet(tmp_path / "f.parquet", rows))[0].job_mark is None
    assert not is_mark_key(key)


def test_two_forms_of_the_tag_with_different_jobs_are_refused(tmp_path: Path) -> None:
    rows = cur_rows()[:2]
    rows[1]["resource_tags"] = {"user_gpu_budget_job": "a", "user:gpu-budget-job": "b"}
    with pytest.raises(BillError) as caught:
        read_cur2_file(write_parquet(tmp_path / "f.parquet", rows))
    assert (caught.value.column, caught.value.row) == ("resource_tags", 2)
    rows[1]["resource_tags"] = {"user_gpu_budget_job": "a", "user:gpu-budget-job": "a"}
    assert read_cur2_file(write_parquet(tmp_path / "g.parquet", rows))[1].job_mark == "a"


def test_a_flattened_tag_column_stands_in_for_the_map(tmp_path: Path) -> None:
    rows = cur_rows()[:2]
    for row, mark in zip(rows, ["job-1", None], strict=True):
        del row["resource_tags"]
        row["resource_tags_user_gpu_budget_job"] = mark
    lines = read_cur2_file(write_csv(tmp_path / "f.csv", rows))
    assert [line.job_mark for line in lines] == ["job-1", None]


def test_the_net_unblended_cost_is_billed_where_given(tmp_path: Path) -> None:
    rows = cur_rows()[:3]
    rows[0]["line_item_net_unblended_cost"] = 30.15  # a discount on the first hour
    rows[1]["line_item_net_unblended_cost"] = None  # no discount figure: the unblended cost
    for kind in ("parquet", "csv.gz", "jsonl"):
        lines = read_cur2_file(WRITERS[kind](tmp_path / f"net-{kind.replace('.', '-')}", rows))
        assert [line.billed_micro for line in lines] == [30_150_000, 12_563_000, -5_000_000]
    for row in rows:
        del row["line_item_net_unblended_cost"]
    lines = read_cur2_file(write_parquet(tmp_path / "plain.parquet", rows))
    assert [line.billed_micro for line in lines] == [37_688_000, 12_563_000, -5_000_000]


def test_money_is_rounded_half_up_to_the_micro_dollar(tmp_path: Path) -> None:
    rows = cur_rows()[:2]
    rows[0]["line_item_net_unblended_cost"] = "0.0000005"
    rows[1]["line_item_net_unblended_cost"] = "-0.0000015"
    lines = read_cur2_file(write_csv(tmp_path / "f.csv", rows))
    assert [line.billed_micro for line in lines] == [1, -2]


def test_currency_is_kept_and_assumed_usd_only_without_the_column(tmp_path: Path) -> None:
    rows = cur_rows()[:2]
    rows[1]["line_item_currency_code"] = "EUR"
    lines = read_cur2_file(write_parquet(tmp_path / "f.parquet", rows))
    assert [line.currency for line in lines] == ["USD", "EUR"]
    rows[1]["line_item_currency_code"] = None
    with pytest.raises(BillError) as caught:
        read_cur2_file(write_parquet(tmp_path / "g.parquet", rows))
    assert (caught.value.column, caught.value.row) == ("line_item_currency_code", 2)
    for row in rows:
        del row["line_item_currency_code"]
    lines = read_cur2_file(write_parquet(tmp_path / "h.parquet", rows))
    assert [line.currency for line in lines] == ["USD", "USD"]


def test_timestamps_with_a_zone_and_iso_offsets_are_utc(tmp_path: Path) -> None:
    table = cur_table(cur_rows()[:1])
    at = table.schema.get_field_index("line_item_usage_start_date")
    zoned = pa.array([datetime(2026, 11, 3, 10, tzinfo=timezone.utc)], pa.timestamp("us", "UTC"))
    table = table.set_column(at, "line_item_usage_start_date", zoned)
    pq.write_table(table, tmp_path / "z.parquet")
    assert read_cur2_file(tmp_path / "z.parquet")[0].usage_start == _epoch("2026-11-03T10:00:00Z")
    rows = cur_rows()[:1]
    rows[0]["line_item_usage_start_date"] = "2026-11-03T11:00:00.000+01:00"
    rows[0]["line_item_usage_end_date"] = "2026-11-03 11:00:00"
    line = read_cur2_file(write_csv(tmp_path / "o.csv", rows))[0]
    assert (line.usage_start, line.usage_end) == (
        _epoch("2026-11-03T10:00:00Z"),
        _epoch("2026-11-03T11:00:00Z"),
    )


def test_a_line_id_repeated_in_one_file_is_numbered(tmp_path: Path) -> None:
    rows = cur_rows()[:1] * 3
    rows = [dict(r) for r in rows]
    rows[0]["line_item_unblended_cost"] = rows[0]["line_item_net_unblended_cost"] = 9.0
    rows[2]["line_item_unblended_cost"] = rows[2]["line_item_net_unblended_cost"] = 1.0
    lines = read_cur2_file(write_parquet(tmp_path / "f.parquet", rows))
    base = "li-001/2026-11-03T10:00:00Z/2026-11-03T11:00:00Z"
    by_id = {line.line_id: line.billed_micro for line in lines}
    assert by_id == {base: 1_000_000, f"{base}#2": 9_000_000, f"{base}#3": 37_688_000}
    # the same rows in another order: each amount keeps its id
    again = read_cur2_file(write_parquet(tmp_path / "g.parquet", rows[::-1]))
    assert {line.line_id: line.billed_micro for line in again} == by_id


def test_without_a_time_interval_the_item_id_alone_is_the_line_id(tmp_path: Path) -> None:
    rows = cur_rows()[:2]
    for row in rows:
        del row["identity_time_interval"]
    lines = read_cur2_file(write_csv(tmp_path / "f.csv", rows))
    assert [line.line_id for line in lines] == ["li-001", "li-002"]


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("column", [*REQUIRED, "resource_tags"])
@pytest.mark.parametrize("kind", ["parquet", "csv.gz"])
def test_a_missing_required_column_is_named(tmp_path: Path, column: str, kind: str) -> None:
    rows = cur_rows()
    for row in rows:
        del row[column]
    with pytest.raises(BillError) as caught:
        read_cur2_file(WRITERS[kind](tmp_path / "f", rows))
    assert (caught.value.rule, caught.value.column, caught.value.row) == (
        "missing column",
        column,
        None,
    )
    assert caught.value.where.endswith(kind)


@pytest.mark.parametrize(
    ("column", "value", "rule"),
    [
        ("line_item_unblended_cost", "12,5", "not an amount of money"),
        ("line_item_unblended_cost", "", "empty"),
        ("line_item_net_unblended_cost", "USD 3", "not an amount of money"),
        ("line_item_usage_start_date", "2026-13-03T10:00:00Z", "not a real date"),
        ("line_item_usage_end_date", "yesterday", "not an ISO 8601 date"),
        ("line_item_usage_end_date", "2026-11-03T09:00:00Z", "ends before it starts"),
        ("bill_billing_period_start_date", "", "empty"),
        ("identity_line_item_id", "", "empty"),
        ("resource_tags", "{user_gpu_budget_job=7}", "not a JSON object of tags"),
    ],
)
def test_a_bad_value_is_named_by_column_and_row(
    tmp_path: Path, column: str, value: str, rule: str
) -> None:
    rows = cur_rows()  # (each row has a net cost too: the unblended one is checked all the same)
    rows[2][column] = value
    path = write_csv(tmp_path / "part.csv.gz", rows, zipped=True)
    with pytest.raises(BillError) as caught:
        read_cur2_file(path)
    error = caught.value
    assert (error.where, error.column, error.row) == (str(path), column, 3)
    assert error.rule.startswith(rule)
    assert str(error).startswith(f"{path}, column {column}, row 3: {rule}")


def test_a_wrong_type_in_parquet_is_named(tmp_path: Path) -> None:
    table = cur_table(cur_rows())
    at = table.schema.get_field_index("identity_line_item_id")
    table = table.set_column(at, "identity_line_item_id", pa.array([1, 2, 3, 4, 5]))
    pq.write_table(table, tmp_path / "f.parquet")
    with pytest.raises(BillError) as caught:
        read_cur2_file(tmp_path / "f.parquet")
    assert (caught.value.column, caught.value.row) == ("identity_line_item_id", 1)
    assert caught.value.rule == "not text: int"


def test_a_truncated_parquet_file_is_refused(tmp_path: Path) -> None:
    whole = write_parquet(tmp_path / "whole.parquet", cur_rows()).read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(BillError) as caught:
        read_cur2_file(cut)
    assert caught.value.where == str(cut)
    assert "Parquet" in caught.value.rule and "\n" not in str(caught.value)


def test_a_truncated_gzip_file_is_refused(tmp_path: Path) -> None:
    rows = cur_rows() * 200  # long enough that the cut falls past the header
    data = write_csv(tmp_path / "whole.csv.gz", rows, zipped=True).read_bytes()
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(data[: len(data) - 40])
    with pytest.raises(BillError) as caught:
        read_cur2_file(cut)
    assert caught.value.where == str(cut) and "gzip" in caught.value.rule


def test_a_cut_csv_row_is_refused_with_its_row(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "f.csv", cur_rows())
    text = path.read_text()
    path.write_text(text[: text.rindex("USE1-Train")])
    with pytest.raises(BillError) as caught:
        read_cur2_file(path)
    assert caught.value.row == 5 and "fields where the header has" in caught.value.rule


def test_a_cut_json_line_is_refused_with_its_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", cur_rows())
    path.write_text(path.read_text()[:-30])
    with pytest.raises(BillError) as caught:
        read_cur2_file(path)
    assert caught.value.row == 5


def test_an_empty_or_absent_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.csv.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "empty.parquet").write_bytes(b"")
    for name in ("empty.csv.gz", "empty.parquet"):
        with pytest.raises(BillError, match="empty file"):
            read_cur2_file(tmp_path / name)
    with pytest.raises(BillError, match="cannot open"):
        read_cur2_file(tmp_path / "absent.parquet")


def test_json_lines_may_leave_tags_out(tmp_path: Path) -> None:
    rows = cur_rows()[:2]
    path = tmp_path / "f.jsonl"
    path.write_text(
        "".join(
            json.dumps({k: str(v) for k, v in r.items() if k != "resource_tags"}) + "\n"
            for r in rows
        )
    )
    assert [line.job_mark for line in read_cur2_file(path)] == [None, None]

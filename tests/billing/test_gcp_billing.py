"""GCP billing export rows read into bill lines: the reference's JSON Lines rows, a Parquet copy
of them, and the same rows as a BigQuery query returns them (a stand-in client: the service
cannot run here), all through the one row adapter."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from google.cloud import bigquery

from prefect_gpu_budget.billing.gcp_billing import (
    line_from_gcp_row,
    read_gcp_bigquery,
    read_gcp_file,
)
from prefect_gpu_budget.billing.lines import BillError
from tests.billing.fixtures import (
    GCP_JOB,
    gcp_rows,
    with_times,
    write_gcp_jsonl,
    write_gcp_parquet,
)
from tests.support.without_extra import run_without

TABLE = "lab-billing.billing_export.gcp_billing_export_resource_v1_0A1B2C_3D4E5F_6A7B8C"


def test_the_reference_rows_give_their_lines(tmp_path: Path) -> None:
    path = write_gcp_jsonl(tmp_path / "export.jsonl")
    lines = read_gcp_file(path)
    assert [line.billed_micro for line in lines] == [2_420_000, 410_000, 0]  # 3.52 - 1.10
    assert [line.job_mark for line in lines] == [GCP_JOB, GCP_JOB, None]
    assert [line.line_type for line in lines] == ["regular", "regular", "tax"]
    assert [line.usage for line in lines] == [True, True, False]
    assert {line.billing_period for line in lines} == {"2026-11"}
    assert {line.source for line in lines} == {"gcp-billing"}
    assert {line.currency for line in lines} == {"USD"}
    assert lines[0].description == "(fixture) Vertex training A100 GPU"
    assert lines[0].resource_id is None
    start = datetime(2026, 11, 3, 10, tzinfo=timezone.utc).timestamp()
    assert (lines[0].usage_start, lines[0].usage_end) == (start, start + 3600)
    assert [line.where for line in lines] == [f"{path}, row {n}" for n in (1, 2, 3)]
    assert len({line.line_id for line in lines}) == 3


def test_the_line_id_is_stable_and_ignores_money(tmp_path: Path) -> None:
    first = read_gcp_file(write_gcp_jsonl(tmp_path / "a.jsonl"))
    rows = gcp_rows()
    rows[0]["cost"] = 3.60  # restated
    rows[0]["credits"][0]["amount"] = -1.2
    again = read_gcp_file(write_gcp_jsonl(tmp_path / "b.jsonl", rows[::-1]))[::-1]
    assert [line.line_id for line in again] == [line.line_id for line in first]
    assert again[0].billed_micro == 2_400_000
    rows[0]["export_time"] = "2026-11-05T01:00:00Z"  # a later row for the same hour
    rows[0]["invoice"] = {"month": "202612"}  # re-delivered under another month
    other = read_gcp_file(write_gcp_jsonl(tmp_path / "c.jsonl", rows))
    assert other[0].line_id == first[0].line_id  # the same usage line: one identity
    assert other[0].version != first[0].version  # appended at another time: another row
    both = read_gcp_file(write_gcp_jsonl(tmp_path / "d.jsonl", [gcp_rows()[0], rows[0]]))
    assert {line.line_id for line in both} == {first[0].line_id, f"{first[0].line_id}#2"}


def test_alike_rows_are_numbered_by_amount(tmp_path: Path) -> None:
    rows = gcp_rows()
    twin = json.loads(json.dumps(rows[1]))
    twin["cost"] = 0.05
    lines = read_gcp_file(write_gcp_jsonl(tmp_path / "a.jsonl", [rows[1], twin, rows[1]]))
    base = lines[1].line_id
    assert [line.line_id for line in lines] == [f"{base}#2", base, f"{base}#2"]  # a copy
    assert lines[1].billed_micro == 50_000


def test_a_parquet_copy_reads_as_the_json_lines(tmp_path: Path) -> None:
    from_json = read_gcp_file(write_gcp_jsonl(tmp_path / "e.jsonl"))
    from_parquet = read_gcp_file(write_gcp_parquet(tmp_path / "e.parquet"))
    strip = [(line.line_id, line.billed_micro, line.job_mark) for line in from_json]
    assert [(line.line_id, line.billed_micro, line.job_mark) for line in from_parquet] == strip


def test_the_detailed_table_gives_the_resource(tmp_path: Path) -> None:
    row = gcp_rows()[0]
    row["resource"] = {"name": "vm-1", "global_name": "//compute.googleapis.com/projects/p/vm-1"}
    line = line_from_gcp_row(row, "t", 4)
    assert line.resource_id == "//compute.googleapis.com/projects/p/vm-1"
    assert line.where == "t, row 4"


@pytest.mark.parametrize(
    ("change", "column", "rule"),
    [
        ({"invoice": {"month": "2026-11"}}, "invoice.month", "not a YYYYMM month"),
        ({"invoice": None}, "invoice", "empty"),
        ({"cost": "3,52"}, "cost", "not an amount of money"),
        ({"cost": None}, "cost", "empty"),
        ({"credits": [{"name": "x", "amount": "lots"}]}, "credits.amount", "not an amount"),
        ({"usage_end_time": "2026-11-03T09:00:00Z"}, "usage_end_time", "ends before it starts"),
        ({"usage_start_time": "soon"}, "usage_start_time", "not an ISO 8601"),
        ({"currency": ""}, "currency", "empty"),
        (
            {
                "labels": [
                    {"key": "gpu-budget-job", "value": "a"},
                    {"key": "gpu-budget-job", "value": "b"},
                ]
            },
            "labels",
            "two gpu-budget-job labels",
        ),
        ({"labels": "gpu-budget-job=a"}, "labels", "not a list of labels"),
    ],
)
def test_a_bad_row_is_named_by_field_and_row(
    tmp_path: Path, change: dict[str, Any], column: str, rule: str
) -> None:
    rows = gcp_rows()
    rows[1].update(change)
    path = write_gcp_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(BillError) as caught:
        read_gcp_file(path)
    assert (caught.value.where, caught.value.column, caught.value.row) == (str(path), column, 2)
    assert caught.value.rule.startswith(rule)


def test_a_missing_field_and_a_csv_file_are_refused(tmp_path: Path) -> None:
    rows = gcp_rows()
    for row in rows:
        del row["cost_type"]
    with pytest.raises(BillError) as caught:
        read_gcp_file(write_gcp_jsonl(tmp_path / "a.jsonl", rows))
    assert (caught.value.rule, caught.value.column) == ("missing column", "cost_type")
    (tmp_path / "b.csv").write_text("invoice.month,cost\n202611,1.0\n")
    with pytest.raises(BillError, match="nested: JSON Lines or Parquet"):
        read_gcp_file(tmp_path / "b.csv")


# -- BigQuery -----------------------------------------------------------------------------------


class _Job:
    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def result(self) -> list[Any]:
        return self.rows


class _Client:
    """Answers every query with the rows it was given, and keeps what it was asked."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows
        self.asked: list[tuple[str, Any]] = []

    def query(self, sql: str, job_config: Any = None) -> _Job:
        self.asked.append((sql, job_config))
        return _Job(self.rows)


def _bigquery_row(row: dict[str, Any]) -> bigquery.Row:
    """A row as the BigQuery client yields it: a `Row`, its times datetimes."""
    row = with_times(row)
    return bigquery.Row(tuple(row.values()), {name: i for i, name in enumerate(row)})


def test_a_month_is_queried_with_a_parameter_and_read_alike(tmp_path: Path) -> None:
    client = _Client([_bigquery_row(r) for r in gcp_rows()])
    lines = read_gcp_bigquery(client, TABLE, "2026-11")
    [(sql, config)] = client.asked
    assert f"FROM `{TABLE}` WHERE invoice.month = @invoice_month" in sql
    assert "202611" not in sql and "2026-11" not in sql
    assert sql.startswith("SELECT ") and "*" not in sql
    for field in ("invoice", "usage_start_time", "labels", "credits", "cost", "resource"):
        assert field in sql
    [parameter] = config.query_parameters
    assert (parameter.name, parameter.type_, parameter.value) == (
        "invoice_month",
        "STRING",
        "202611",
    )
    from_file = read_gcp_file(write_gcp_jsonl(tmp_path / "e.jsonl"))
    assert [(line.line_id, line.billed_micro, line.job_mark) for line in lines] == [
        (line.line_id, line.billed_micro, line.job_mark) for line in from_file
    ]
    assert lines[2].where == f"{TABLE}, row 3"


def test_the_standard_table_is_queried_without_resource() -> None:
    client = _Client([])
    assert read_gcp_bigquery(client, "p.d.gcp_billing_export_v1_X", "2026-11", detailed=False) == []
    assert "resource" not in client.asked[0][0]


@pytest.mark.parametrize("table", ["p.d.t`; DROP TABLE x; --", "just_a_table", "p.d.t where 1=1"])
def test_a_table_name_that_is_not_one_is_refused_before_any_query(table: str) -> None:
    client = _Client([])
    with pytest.raises(ValueError, match="not a BigQuery table name"):
        read_gcp_bigquery(client, table, "2026-11")
    with pytest.raises(ValueError, match="YYYY-MM"):
        read_gcp_bigquery(client, TABLE, "202611")
    assert client.asked == []


def test_a_row_of_another_month_is_refused() -> None:
    rows = gcp_rows()
    rows[1]["invoice"] = {"month": "202610"}
    with pytest.raises(BillError) as caught:
        read_gcp_bigquery(_Client(rows), TABLE, "2026-11")
    assert (caught.value.where, caught.value.column, caught.value.row) == (
        TABLE,
        "invoice.month",
        2,
    )


def test_without_the_bigquery_client_it_names_the_extra() -> None:
    done = run_without(
        ("google.cloud.bigquery",),
        """
        from prefect_gpu_budget.billing.gcp_billing import read_gcp_bigquery
        from prefect_gpu_budget.extras import MissingExtra
        try:
            read_gcp_bigquery(object(), "p.d.t", "2026-11")
        except MissingExtra as exc:
            print("refused:", exc)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "'vertex' extra" in done.stdout

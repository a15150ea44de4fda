"""GCP's Cloud Billing export (the detailed usage cost table,
`gcp_billing_export_resource_v1_<account>`, or the standard one) read into `BillLine`s: a
month from BigQuery (`read_gcp_bigquery`; page by page, `stream_gcp_bigquery`), or a local copy
of the table (`read_gcp_file`; line by line, `iter_gcp_lines`). Both go through one row adapter,
`line_from_gcp_row`, over rows with BigQuery's nested field names.

Fields read: `invoice.month` (`YYYYMM`, the billing period), `usage_start_time`,
`usage_end_time`, `cost`, `currency`, `cost_type` (all required); `credits` (repeated
`name`/`amount`/`type`...: the billed amount is `cost` plus every `credits.amount`), `labels`
(repeated `key`/`value`: the job mark is label `gpu-budget-job`), `sku.description` (the
description), `resource.global_name` (the detailed table only), and, for the line id only,
`billing_account_id`, `service`, `sku.id`, `project.id`, `location`, `system_labels`,
`resource.name`, `adjustment_info.id` and `export_time`.

GCP rows have no id. A line's identity (its `line_id`) is a digest of the fields that name a
usage line: `billing_account_id`, `project.id`, `service` (id, description), `sku` (id,
description), the usage window (`usage_start_time`, `usage_end_time`, as instants, so a BigQuery
timestamp and its ISO text give the same id), `labels` and `system_labels`, `resource` (name,
global name), and, to tell a usage row from the tax or the adjustment of the same usage,
`location`, `cost_type` and `adjustment_info.id`. Never its money (a restated amount keeps its
id), its `invoice.month` (a re-delivery under another month is the same line), nor its
`export_time`, which is kept as the line's `version`: rows of one identity appended at other
times are other rows, numbered within one read (`#2`, `#3`...) by amount, while a copy of a row
(same time, same money) is the same line, booked once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

from prefect_gpu_budget.billing.lines import JOB_MARK, BillError, BillLine, BillRead, to_micro
from prefect_gpu_budget.billing.reading import (
    Rows,
    at,
    money,
    no_nul,
    number_repeats,
    open_rows,
    span,
    text,
    when,
)

SOURCE = "gcp-billing"
REQUIRED = ("invoice", "usage_start_time", "usage_end_time", "cost", "currency", "cost_type")
_MONTH = re.compile(r"\d{4}(0[1-9]|1[0-2])")
_PERIOD = re.compile(r"\d{4}-(0[1-9]|1[0-2])")
_TABLE = re.compile(r"[A-Za-z0-9_:.-]+\.[A-Za-z0-9_]+\.[A-Za-z0-9_$-]+")
"""`project.dataset.table` (a domain-scoped project is `example.com:project`)."""


def line_from_gcp_row(row: Mapping[str, Any], where: str, n: int) -> BillLine:
    """One row of the billing export, nested as BigQuery returns it, as a `BillLine` whose
    `where` is `<where>, row <n>`; its `line_id` is the row's digest, not yet numbered.

    Refuses (`BillError` naming the field and row) a missing or empty required field, an
    `invoice.month` that is not `YYYYMM`, a time that is not one, an amount that is not one,
    and two different `gpu-budget-job` labels.
    """
    invoice = _record(row, "invoice", where, n, required=True)
    month = text(invoice.get("month"), where, "invoice.month", n) or ""
    if not _MONTH.fullmatch(month):
        raise BillError(where, f"not a YYYYMM month: {month[:20]!r}", "invoice.month", n)
    start, end = span(
        row.get("usage_start_time"),
        row.get("usage_end_time"),
        where,
        ("usage_start_time", "usage_end_time"),
        n,
    )
    total = _net_cost(row, where, n)
    labels = _labels(row.get("labels"), where, "labels", n)
    marks = {v for k, v in labels if k.lower() == JOB_MARK and v}
    if len(marks) > 1:
        raise BillError(where, f"two {JOB_MARK} labels: {sorted(marks)}", "labels", n)
    sku = _record(row, "sku", where, n)
    service = _record(row, "service", where, n)
    resource = _record(row, "resource", where, n)
    return BillLine(
        source=SOURCE,
        billing_period=f"{month[:4]}-{month[4:]}",
        line_id=_digest(row, start, end, labels, where, n),
        line_type=text(row.get("cost_type"), where, "cost_type", n) or "",
        usage_start=start,
        usage_end=end,
        billed_micro=to_micro(total, where, "cost", n),
        currency=text(row.get("currency"), where, "currency", n) or "",
        job_mark=marks.pop() if marks else None,
        resource_id=text(
            resource.get("global_name"), where, "resource.global_name", n, required=False
        ),
        description=text(sku.get("description"), where, "sku.description", n, required=False)
        or text(service.get("description"), where, "service.description", n, required=False)
        or text(row.get("cost_type"), where, "cost_type", n)
        or "",
        where=at(where, n),
        version=_version(row.get("export_time"), where, n),
    )


def _net_cost(row: Mapping[str, Any], where: str, n: int) -> Decimal:
    """A row's `cost` plus its `credits`' amounts (each negative)."""
    total = money(row.get("cost"), where, "cost", n)
    credits = row.get("credits")
    if credits is None:
        credits = []
    if not isinstance(credits, list | tuple):
        raise BillError(where, "not a list of credits", "credits", n)
    for credit in credits:
        if not isinstance(credit, Mapping):
            raise BillError(where, "a credit that is not a record", "credits", n)
        total += money(credit.get("amount"), where, "credits.amount", n)
    return total


def _version(exported: object, where: str, n: int) -> str:
    if exported is None or (isinstance(exported, str) and not exported.strip()):
        return ""
    return when(exported, where, "export_time", n).isoformat()


def _record(
    row: Mapping[str, Any], name: str, where: str, n: int, required: bool = False
) -> Mapping[str, Any]:
    value = row.get(name)
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        rule = "empty" if value is None else "not a record"
        raise BillError(where, rule, name, n)
    return value


def _labels(value: object, where: str, column: str, n: int) -> list[tuple[str, str]]:
    """Repeated `key`/`value` records (or a mapping, or pairs) as sorted (key, value) pairs."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        value = list(value.items())
    if not isinstance(value, list | tuple):
        raise BillError(where, "not a list of labels", column, n)
    pairs = []
    for entry in value:
        if isinstance(entry, Mapping):
            key, item = entry.get("key"), entry.get("value")
        elif isinstance(entry, list | tuple) and len(entry) == 2:
            key, item = entry
        else:
            raise BillError(where, "a label that is not a key and a value", column, n)
        if not isinstance(key, str) or not (item is None or isinstance(item, str)):
            raise BillError(where, "a label that is not text", column, n)
        pairs.append(
            (no_nul(key, where, column, n), no_nul((item or "").strip(), where, column, n))
        )
    return sorted(pairs)


def _digest(
    row: Mapping[str, Any],
    start: float,
    end: float,
    labels: list[tuple[str, str]],
    where: str,
    n: int,
) -> str:
    def pick(record: str, *fields: str) -> list[Any]:
        found = _record(row, record, where, n)
        return [_plain(found.get(f)) for f in fields]

    identity = [
        start,
        end,
        _plain(row.get("billing_account_id")),
        _plain(row.get("cost_type")),
        pick("service", "id", "description"),
        pick("sku", "id", "description"),
        pick("project", "id"),
        pick("location", "location", "country", "region", "zone"),
        pick("resource", "name", "global_name"),
        pick("adjustment_info", "id"),
        labels,
        _labels(row.get("system_labels"), where, "system_labels", n),
    ]
    blob = json.dumps(identity, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """A BigQuery value (a Row, nested records, repeated fields) as dicts, lists and scalars."""
    if isinstance(value, Mapping) or hasattr(value, "items") and hasattr(value, "keys"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def gcp_lines(rows: Rows) -> list[BillLine]:
    """The lines of an open file of BigQuery rows (JSON Lines or Parquet), not yet numbered."""
    return list(iter_gcp_lines(rows))


def iter_gcp_lines(rows: Rows) -> Iterator[BillLine]:
    """`gcp_lines` one line at a time, as the rows are read (the columns are checked before
    the first)."""
    if rows.kind.startswith("csv"):
        raise BillError(rows.where, "GCP billing rows are nested: JSON Lines or Parquet, not CSV")
    for column in REQUIRED:
        if column not in rows.columns:
            raise BillError(rows.where, "missing column", column)
    rows.wanted = READ
    for n, row in enumerate(rows.rows, start=1):
        yield line_from_gcp_row(row, rows.where, n)


READ = frozenset(
    (*REQUIRED, "credits", "labels", "system_labels", "sku", "service", "resource", "project")
    + ("location", "billing_account_id", "adjustment_info", "export_time")
)
"""Every field a line is read from (its id's included)."""


def is_gcp(columns: list[str]) -> bool:
    """Whether a file's columns are the billing export's (its nested top-level fields)."""
    return "invoice" in columns and "cost" in columns


def read_gcp_file(path: str | Path) -> list[BillLine]:
    """The lines of a local copy of the export: JSON Lines (one BigQuery row per line, nested,
    plain or gzip) or Parquet with the same nested fields (`labels` and `credits` as lists of
    structs)."""
    return number_repeats(gcp_lines(open_rows(path)))


SELECTED = (
    "billing_account_id",
    "invoice",
    "cost_type",
    "service",
    "sku",
    "STRUCT(project.id AS id) AS project",
    "location",
    "usage_start_time",
    "usage_end_time",
    "labels",
    "system_labels",
    "cost",
    "currency",
    "credits",
    "adjustment_info",
    "export_time",
)
"""The fields a BigQuery read selects (the query is billed by the bytes of the columns it
reads); the detailed table's `resource` besides."""


def read_gcp_bigquery(
    client: Any, table: str, period: str, *, detailed: bool = True
) -> list[BillLine]:
    """A month of the export, queried from BigQuery, numbered (`stream_gcp_bigquery`'s lines,
    as a list)."""
    return number_repeats(list(stream_gcp_bigquery(client, table, period, detailed=detailed)))


def stream_gcp_bigquery(
    client: Any, table: str, period: str, *, detailed: bool = True
) -> Iterator[BillLine]:
    """A month of the export, queried from BigQuery for `invoice.month = 'YYYYMM'`, line by
    line as the result's pages come (the client's row iterator fetches a page at a time), not
    numbered.

    `client` is a `google.cloud.bigquery.Client` (or anything whose `query(sql, job_config=)`
    returns a job whose `result()` yields rows); `table` is `project.dataset.table`, the export
    table or a view of it; `period` is `YYYY-MM`. The month is a query parameter; the table,
    which cannot be one, must be a plain table name. Only the fields read are selected (the
    query is billed by the bytes of the columns it reads); `detailed=False` leaves out
    `resource`, which the standard table lacks. Needs google-cloud-bigquery, which the `vertex`
    extra brings.
    """
    if not _PERIOD.fullmatch(period):
        raise ValueError(f"a billing period is YYYY-MM, not {period!r}")
    if not _TABLE.fullmatch(table):
        raise ValueError(f"not a BigQuery table name (project.dataset.table): {table!r}")
    try:
        from google.cloud import bigquery
    except ImportError:
        from prefect_gpu_budget.extras import MissingExtra

        raise MissingExtra("Reading the GCP billing export from BigQuery", "vertex") from None
    fields = [*SELECTED, "resource"] if detailed else list(SELECTED)
    sql = f"SELECT {', '.join(fields)} FROM `{table}` WHERE invoice.month = @invoice_month"
    config = bigquery.QueryJobConfig(
        query_parameters=[
            bigquery.ScalarQueryParameter("invoice_month", "STRING", period.replace("-", ""))
        ]
    )
    for n, row in enumerate(client.query(sql, job_config=config).result(), start=1):
        line = line_from_gcp_row(_plain(row), table, n)
        if line.billing_period != period:
            raise BillError(table, f"invoice month of {line.billing_period}", "invoice.month", n)
        yield line


@dataclass(frozen=True)
class BigQuerySource:
    """The GCP Cloud Billing detailed usage cost export in BigQuery: each billing period's
    invoice month queried whole (`read_gcp_bigquery`)."""

    NEEDS: ClassVar[tuple[str, ...]] = ("table",)
    table: str
    credentials: Any = None
    """`prefect_gcp.GcpCredentials`; None: the default credentials."""

    @classmethod
    def from_export(cls, export: Any) -> BigQuerySource:
        return cls(str(export.table), export.gcp_credentials)

    def where(self) -> str:
        return f"bigquery:{self.table}"

    def read(self, periods: list[str]) -> dict[tuple[str, str], list[BillLine]]:
        """Each of `periods` (`YYYY-MM`) read whole, an empty one included."""
        client = self._client()
        return {(SOURCE, p): read_gcp_bigquery(client, self.table, p) for p in periods}

    def stream(self, periods: list[str]) -> list[BillRead]:
        """Each of `periods` (`YYYY-MM`) as a read of its own, page by page, an empty one
        included."""
        client = self._client()
        return [
            BillRead(stream_gcp_bigquery(client, self.table, p), ((SOURCE, p),)) for p in periods
        ]

    def _client(self) -> Any:
        from prefect_gcp import GcpCredentials

        return (self.credentials or GcpCredentials()).get_bigquery_client()
